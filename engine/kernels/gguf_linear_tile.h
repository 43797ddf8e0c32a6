// The few-token half of gguf_linear.cpp, the part that depends on the instruction set: included
// once per set, inside its own namespace, with NANOSERVE_AVX512 1 (AVX-512 F/BW/DQ/VL, under a
// `#pragma GCC target`) or 0 (AVX2/FMA/F16C, the file's own flags). Both bodies compute the same
// bits: a block's 32 products of 16-bit activations and weight codes are summed exactly in
// sixteen int32 lanes (lane l: elements 2l and 2l + 1); each lane is converted to float,
// multiplied by the weights' d and added by one fused multiply-add with the activations' dx
// (a power of two); the sixteen float lanes are summed in one fixed order at the end. Every
// output is a function of its (x row, weight row) pair alone, whatever the tile or thread.
//
// Expects from the includer: <immintrin.h>, <ATen/Parallel.h>, <cstdint>, <cstring>, <cmath>,
// QuantType, kGroup, kFewMaxTokens, kRowsPerTask and ActBlocks (the quantized activations).

#if NANOSERVE_AVX512
// 32 int16 (one block) and 16 float lanes, one register each.
struct Codes {
  __m512i v;
};
struct Lanes {
  __m512 v;
};
inline Lanes zero_lanes() { return {_mm512_setzero_ps()}; }
inline Codes load_acts(const int16_t* a) { return {_mm512_loadu_si512(a)}; }
// 16 bytes of nibbles -> 32 int16 (low nibbles, then high): widen both copies of the bytes,
// shift the upper copy by 4, keep four bits.
inline Codes unpack_nibbles(const uint8_t* packed) {
  const __m512i both = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed))));
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  return {_mm512_and_si512(_mm512_srlv_epi16(both, shifts), _mm512_set1_epi16(0x0F))};
}
inline Codes minus_eight(Codes c) { return {_mm512_sub_epi16(c.v, _mm512_set1_epi16(8))}; }
inline Codes load_q8(const uint8_t* q) {
  return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)))};
}
struct Scale {
  __m512 v;
};
inline Scale broadcast(float s) { return {_mm512_set1_ps(s)}; }
// acc + (float(a . w per lane pair) * d) * dx
inline Lanes dot_fma(Lanes acc, Codes a, Codes w, Scale d, Scale dx) {
  const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(a.v, w.v)), d.v);
  return {_mm512_fmadd_ps(dot, dx.v, acc.v)};
}
inline __m256 fold_lanes(Lanes acc) {  // lane l + lane l + 8
  return _mm256_add_ps(_mm512_castps512_ps256(acc.v), _mm512_extractf32x8_ps(acc.v, 1));
}
#else
struct Codes {
  __m256i lo, hi;  // elements 0..15, 16..31
};
struct Lanes {
  __m256 lo, hi;  // lanes 0..7, 8..15
};
inline Lanes zero_lanes() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Codes load_acts(const int16_t* a) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16))};
}
inline Codes unpack_nibbles(const uint8_t* packed) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return {_mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask)),
          _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask))};
}
inline Codes minus_eight(Codes c) {
  const __m256i eight = _mm256_set1_epi16(8);
  return {_mm256_sub_epi16(c.lo, eight), _mm256_sub_epi16(c.hi, eight)};
}
inline Codes load_q8(const uint8_t* q) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))};
}
struct Scale {
  __m256 v;
};
inline Scale broadcast(float s) { return {_mm256_set1_ps(s)}; }
inline Lanes dot_fma(Lanes acc, Codes a, Codes w, Scale d, Scale dx) {
  const __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a.lo, w.lo)), d.v);
  const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a.hi, w.hi)), d.v);
  return {_mm256_fmadd_ps(lo, dx.v, acc.lo), _mm256_fmadd_ps(hi, dx.v, acc.hi)};
}
inline __m256 fold_lanes(Lanes acc) { return _mm256_add_ps(acc.lo, acc.hi); }
#endif

// The fixed sum of the sixteen lanes: (l + (l + 8)), then ((0+4)+(2+6)) + ((1+5)+(3+7)).
inline float sum_lanes(Lanes acc) {
  const __m256 v = fold_lanes(acc);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline int32_t load_u32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline int16_t load_u16(const uint8_t* p) {
  int16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One GGUF block -> its 32 signed codes (Q4_0: q - 8; Q4_1: q; Q8_0: q), its scale d and (Q4_1) its min m.
template <int64_t Type>
inline Codes unpack_block(const uint8_t* block) {
  if constexpr (Type == Q8_0) {
    return load_q8(block + 2);
  } else {
    const Codes c = unpack_nibbles(block + (Type == Q4_1 ? 4 : 2));
    return Type == Q4_0 ? minus_eight(c) : c;
  }
}

// Weights read straight from their GGUF blocks: each block is unpacked once per call and used
// by every x row from registers.
template <int64_t Type>
struct BlockRows {
  const uint8_t* blocks;  // [N, row_bytes]
  int64_t row_bytes;
  static constexpr int64_t kBytes = Type == Q4_0 ? 18 : Type == Q4_1 ? 20 : 34;
  Codes codes(int64_t n, int64_t b) const { return unpack_block<Type>(blocks + n * row_bytes + b * kBytes); }
  float d(int64_t n, int64_t b) const { return fp16_at(blocks + n * row_bytes + b * kBytes); }
  float m(int64_t n, int64_t b) const { return fp16_at(blocks + n * row_bytes + b * kBytes + 2); }
  // d (and m) of block b of rows n .. n + TN - 1, as floats; four rows converted in one go.
  template <int TN>
  void headers(int64_t n, int64_t b, float* d_out, float* m_out) const {
    const uint8_t* p = blocks + n * row_bytes + b * kBytes;
    if constexpr (TN == 4) {
      if constexpr (Type == Q4_1) {  // four (d, m) pairs -> d0..d3, m0..m3
        // built in registers: four small stores and a wide load would stall store forwarding
        const __m128i pairs = _mm_setr_epi32(load_u32(p), load_u32(p + row_bytes), load_u32(p + 2 * row_bytes),
                                             load_u32(p + 3 * row_bytes));
        const __m256 dm = _mm256_cvtph_ps(pairs);
        const __m256 split = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
        _mm_storeu_ps(d_out, _mm256_castps256_ps128(split));
        _mm_storeu_ps(m_out, _mm256_extractf128_ps(split, 1));
      } else {
        const __m128i halves = _mm_setr_epi16(load_u16(p), load_u16(p + row_bytes), load_u16(p + 2 * row_bytes),
                                              load_u16(p + 3 * row_bytes), 0, 0, 0, 0);
        _mm_storeu_ps(d_out, _mm_cvtph_ps(halves));
      }
    } else {
      for (int r = 0; r < TN; ++r) {
        d_out[r] = d(n + r, b);
        if constexpr (Type == Q4_1) m_out[r] = m(n + r, b);
      }
    }
  }
  void prefetch(int64_t n, int64_t b, int64_t rows) const {
    // the bytes a tile of `rows` rows reads, one tile ahead: DRAM streams too slowly for
    // several interleaved rows on its own
    const char* next = reinterpret_cast<const char*>(blocks + (n + rows) * row_bytes + b * rows * kBytes);
    _mm_prefetch(next, _MM_HINT_T0);
    _mm_prefetch(next + 64, _MM_HINT_T0);
  }
};

// Q4 weights regrouped by four rows (gguf_linear.cpp's grouped layout): a tile of four rows
// reads one record per block, its d (and m) converted together.
template <int64_t Type>
struct GroupRows {
  const uint8_t* records;  // [N / 4, nb, kBytes]
  int64_t nb;
  static constexpr int64_t kBytes = kGroupCodeBytes + (Type == Q4_1 ? 16 : 8);
  const uint8_t* record(int64_t n, int64_t b) const { return records + ((n / kGroupRows) * nb + b) * kBytes; }
  Codes codes(int64_t n, int64_t b) const {
    const Codes c = unpack_nibbles(record(n, b) + 16 * (n % kGroupRows));
    return Type == Q4_0 ? minus_eight(c) : c;
  }
  float d(int64_t n, int64_t b) const { return fp16_at(record(n, b) + kGroupCodeBytes + 2 * (n % kGroupRows)); }
  float m(int64_t n, int64_t b) const { return fp16_at(record(n, b) + kGroupCodeBytes + 8 + 2 * (n % kGroupRows)); }
  template <int TN>
  void headers(int64_t n, int64_t b, float* d_out, float* m_out) const {
    if constexpr (TN == 4) {  // n is a group's first row: its record's four d (and m) at once
      const uint8_t* h = record(n, b) + kGroupCodeBytes;
      if constexpr (Type == Q4_1) {
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
        _mm_storeu_ps(d_out, _mm256_castps256_ps128(dm));
        _mm_storeu_ps(m_out, _mm256_extractf128_ps(dm, 1));
      } else {
        _mm_storeu_ps(d_out, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h))));
      }
    } else {
      for (int r = 0; r < TN; ++r) {
        d_out[r] = d(n + r, b);
        if constexpr (Type == Q4_1) m_out[r] = m(n + r, b);
      }
    }
  }
  void prefetch(int64_t n, int64_t b, int64_t) const {
    const char* ahead = reinterpret_cast<const char*>(record(n, b)) + 2048;
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
  }
};

// y[i, r] (y already offset to column n0) for the TM rows of x and TN weight rows from row n0:
//   sum_lanes(sum_b fma(lanes(a_ib . q_rb) * d_rb, dx_ib)) + sum_b fma(m_rb, dx_ib * sum(a_ib))
// dx is a power of two, so the product's one rounding is that of d times the exact dot.
// The min term (Q4_1 only) is a separate float chain in block order, four rows to a vector.
template <int64_t Type, int TM, int TN, class Weights>
inline void tile(const ActBlocks& x, const Weights& w, int64_t n0, float* y, int64_t ldy) {
  Lanes acc[TM][TN];
  float min_acc[TM][TN];
  __m128 min_acc4[TM];
  for (int i = 0; i < TM; ++i) {
    min_acc4[i] = _mm_setzero_ps();
    for (int r = 0; r < TN; ++r) {
      acc[i][r] = zero_lanes();
      min_acc[i][r] = 0.0f;
    }
  }
  for (int64_t b = 0; b < x.nb; ++b) {
    w.prefetch(n0, b, TN);
    Codes q[TN];
    Scale d[TN];
    alignas(16) float d_rows[4], m_rows[4];
    w.template headers<TN>(n0, b, d_rows, m_rows);
    for (int r = 0; r < TN; ++r) {
      q[r] = w.codes(n0 + r, b);
      d[r] = broadcast(d_rows[r]);
    }
    for (int i = 0; i < TM; ++i) {
      const Codes a = load_acts(x.codes + i * x.k + b * kGroup);
      const Scale dx = broadcast(x.scale[i * x.nb + b]);
      for (int r = 0; r < TN; ++r) acc[i][r] = dot_fma(acc[i][r], a, q[r], d[r], dx);
    }
    if constexpr (Type == Q4_1) {
      if constexpr (TN == 4) {
        const __m128 m = _mm_load_ps(m_rows);
        for (int i = 0; i < TM; ++i)
          min_acc4[i] = _mm_fmadd_ps(m, _mm_set1_ps(x.scaled_sum[i * x.nb + b]), min_acc4[i]);
      } else {
        for (int r = 0; r < TN; ++r)
          for (int i = 0; i < TM; ++i)
            min_acc[i][r] = std::fma(m_rows[r], x.scaled_sum[i * x.nb + b], min_acc[i][r]);
      }
    }
  }
  for (int i = 0; i < TM; ++i) {
    if constexpr (TN == 4) _mm_storeu_ps(min_acc[i], min_acc4[i]);
    for (int r = 0; r < TN; ++r) y[i * ldy + r] = sum_lanes(acc[i][r]) + min_acc[i][r];
  }
}

// Tile shapes: what fits the registers (32 zmm, 16 ymm) without spilling the accumulators.
#if NANOSERVE_AVX512
template <int TM>
constexpr int kFewTileN = 4;
#else
template <int TM>
constexpr int kFewTileN = TM == 1 ? 4 : TM == 2 ? 2 : 1;
#endif

// Up to kFewMaxTokens x rows against weight rows [begin, end), read from their blocks.
template <int64_t Type, int TM, class Weights>
void few_tokens(const ActBlocks& x, const Weights& w, int64_t begin, int64_t end, float* y, int64_t ldy) {
  constexpr int TN = kFewTileN<TM>;
  int64_t r = begin;
  for (; r + TN <= end; r += TN) tile<Type, TM, TN, Weights>(x, w, r, y + r, ldy);
  for (; r < end; ++r) tile<Type, TM, 1, Weights>(x, w, r, y + r, ldy);
}

// y [T, n] for T <= kFewMaxTokens rows of x, each worker taking a range of weight rows
// (whole groups of four in the grouped layout, so that every tile is one group).
template <int64_t Type, class Weights>
void gguf_linear_rows(const ActBlocks& x, int64_t num_tokens, const Weights& w, int64_t n, float* y) {
  const auto rows = [&](int64_t first, int64_t last) {
    switch (num_tokens) {
      case 1: few_tokens<Type, 1>(x, w, first, last, y, n); break;
      case 2: few_tokens<Type, 2>(x, w, first, last, y, n); break;
      case 3: few_tokens<Type, 3>(x, w, first, last, y, n); break;
      default: few_tokens<Type, 4>(x, w, first, last, y, n); break;
    }
  };
  const int64_t groups = n / kGroupRows;
  if (groups == 0) return rows(0, n);  // GGUF rows only: the grouped layout holds whole groups
  at::parallel_for(0, groups, kRowsPerTask / kGroupRows, [&](int64_t begin, int64_t end) {
    rows(begin * kGroupRows, end == groups ? n : end * kGroupRows);  // GGUF rows: the ragged tail too
  });
}

inline void gguf_linear_dispatch(const ActBlocks& x, int64_t num_tokens, const uint8_t* weights, int64_t type,
                                 int64_t layout, int64_t n, float* y) {
  const int64_t row_bytes = x.nb * BlockRows<Q8_0>::kBytes;
  switch (type) {
    case Q4_0:
      if (layout == kGroups)
        gguf_linear_rows<Q4_0>(x, num_tokens, GroupRows<Q4_0>{weights, x.nb}, n, y);
      else
        gguf_linear_rows<Q4_0>(x, num_tokens, BlockRows<Q4_0>{weights, x.nb * BlockRows<Q4_0>::kBytes}, n, y);
      break;
    case Q4_1:
      if (layout == kGroups)
        gguf_linear_rows<Q4_1>(x, num_tokens, GroupRows<Q4_1>{weights, x.nb}, n, y);
      else
        gguf_linear_rows<Q4_1>(x, num_tokens, BlockRows<Q4_1>{weights, x.nb * BlockRows<Q4_1>::kBytes}, n, y);
      break;
    default: gguf_linear_rows<Q8_0>(x, num_tokens, BlockRows<Q8_0>{weights, row_bytes}, n, y); break;
  }
}
