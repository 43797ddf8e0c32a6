// The few-token half of gguf_linear.cpp, the part that depends on the instruction set: included
// once per set, inside its own namespace, with NANOSERVE_AVX512 1 (AVX-512 F/BW/DQ/VL, under a
// `#pragma GCC target`) or 0 (AVX2/FMA/F16C, the file's own flags). Both bodies compute the same
// bits: a block's 32 products of 16-bit activations and weight codes are summed exactly in
// int32 (an exact sum, so its order does not matter), converted to float, multiplied by the
// weights' d and added to the output's one float chain by a fused multiply-add with the
// activations' dx (a power of two), blocks in order. Every output is a function of its
// (x row, weight row) pair alone, whatever the tile, thread or number of x rows, and the int16
// panels of gguf_linear.cpp compute the same chains for large steps (batch invariance).
//
// Expects from the includer: <immintrin.h>, <ATen/Parallel.h>, <cstdint>, <cstring>, <cmath>,
// QuantType, kGroup, kFewMaxTokens, kRowsPerTask, kActLanes and ActBlocks (the quantized activations).

#if NANOSERVE_AVX512
// 32 int16 (one block) and 16 float lanes, one register each.
struct Codes {
  __m512i v;
};
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

// One block's 32 products of one (x row, weight row) pair as 16 int32 partial sums (elements
// 2l, 2l + 1 in lane l); sum_dots adds a tile's such pairs exactly into one register, lane c
// (combo c = i * TN + r) holding the block's whole sum S_irb.
constexpr int kCombos = 16;
constexpr int kTileMaxTokens = 8;  // x rows one tile takes: 8 rows by 2 weight rows fill the 16 combos
struct Dots {
  __m512i v;
};
inline Dots block_dot(Codes a, Codes w) { return {_mm512_madd_epi16(a.v, w.v)}; }
struct Sums {
  __m512i v;
};
// a, b -> per 128-bit lane [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
inline __m512i fold32(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
// two such -> per 128-bit lane the four inputs' sums over that lane
inline __m512i fold64(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
// Up to sixteen registers -> lane c = the sum of register c's sixteen lanes (a tree of 15
// folds; integer adds, so exact and order-free). Missing registers count as zero.
template <int C>
inline Sums sum_dots(const Dots* dots) {
  __m512i r[16];
  for (int c = 0; c < 16; ++c) r[c] = c < C ? dots[c].v : _mm512_setzero_si512();
  __m512i t[8], u[4];
  for (int k = 0; k < 8; ++k) t[k] = fold32(r[2 * k], r[2 * k + 1]);
  for (int k = 0; k < 4; ++k) u[k] = fold64(t[2 * k], t[2 * k + 1]);  // lane L word c: register 4k + c
  const __m512i v0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x44), _mm512_shuffle_i32x4(u[0], u[1], 0xEE));
  const __m512i v1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x44), _mm512_shuffle_i32x4(u[2], u[3], 0xEE));
  return {_mm512_add_epi32(_mm512_shuffle_i32x4(v0, v1, 0x88), _mm512_shuffle_i32x4(v0, v1, 0xDD))};
}
struct Floats {
  __m512 v;
};
inline Floats zero_floats() { return {_mm512_setzero_ps()}; }
inline void store_floats(float* out, Floats f) { _mm512_store_ps(out, f.v); }
// A weight row's value (d or m) for every combo: lane c <- row c % TN of the tile.
struct RowValues {
  __m512 v;
};
// lane c <- token[c / TN] (an x row's value); token holds kActLanes values, zero past TM
template <int TM, int TN>
inline __m512 combos_by_token(const float* token) {
  if constexpr (TM == 1) {
    return _mm512_set1_ps(token[0]);
  } else {
    const __m256 t = _mm256_loadu_ps(token);
    const __m512i index = _mm512_setr_epi32(0 / TN, 1 / TN, 2 / TN, 3 / TN, 4 / TN, 5 / TN, 6 / TN, 7 / TN, 8 / TN,
                                            9 / TN, 10 / TN, 11 / TN, 12 / TN, 13 / TN, 14 / TN, 15 / TN);
    return _mm512_permutexvar_ps(_mm512_min_epi32(index, _mm512_set1_epi32(7)), _mm512_castps256_ps512(t));
  }
}
// acc + (float(S) * d) * dx per combo
template <int TM, int TN>
inline Floats scale_fma(Floats acc, Sums s, RowValues d, const float* dx) {
  const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(s.v), d.v);
  return {_mm512_fmadd_ps(dot, combos_by_token<TM, TN>(dx), acc.v)};
}
// acc + m * (dx * sum(a)) per combo
template <int TM, int TN>
inline Floats min_fma(Floats acc, RowValues m, const float* sx) {
  return {_mm512_fmadd_ps(m.v, combos_by_token<TM, TN>(sx), acc.v)};
}
#else
struct Codes {
  __m256i lo, hi;  // elements 0..15, 16..31
};
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

// The same sums and chains on AVX2, whose tiles have at most four combos: each combo's eight
// int32 lanes summed exactly (horizontal adds), the float chain on four lanes at once. The
// integer sums are exact and each chain's float operations (a conversion, a product, a fused
// multiply-add) are the AVX-512 body's, so the bits are too.
constexpr int kCombos = 4;
constexpr int kTileMaxTokens = 4;
struct Dots {
  __m256i v;
};
inline Dots block_dot(Codes a, Codes w) {
  return {_mm256_add_epi32(_mm256_madd_epi16(a.lo, w.lo), _mm256_madd_epi16(a.hi, w.hi))};
}
struct Sums {
  __m128i v;  // lane c: combo c's block sum
};
template <int C>
inline Sums sum_dots(const Dots* dots) {
  __m256i r[4];
  for (int c = 0; c < 4; ++c) r[c] = c < C ? dots[c].v : _mm256_setzero_si256();
  // per 128-bit half: [r0, r1, r2, r3] partial sums after two horizontal adds; then the halves
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(r[0], r[1]), _mm256_hadd_epi32(r[2], r[3]));
  return {_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))};
}
struct Floats {
  __m128 v;
};
inline Floats zero_floats() { return {_mm_setzero_ps()}; }
inline void store_floats(float* out, Floats f) { _mm_storeu_ps(out, f.v); }
// lane c <- row[c % TN], token[c / TN] (lanes past the tile's combos: don't care)
template <int TN>
inline __m128 combos_by_row(const float* row) {
  return _mm_setr_ps(row[0], row[1 % TN], row[2 % TN], row[3 % TN]);
}
template <int TM, int TN>
inline __m128 combos_by_token(const float* token) {
  constexpr int last = TM - 1;
  return _mm_setr_ps(token[0], token[std::min(1 / TN, last)], token[std::min(2 / TN, last)],
                     token[std::min(3 / TN, last)]);
}
template <int TM, int TN>
inline Floats scale_fma(Floats acc, Sums s, const float* d_rows, const float* dx) {
  const __m128 dot = _mm_mul_ps(_mm_cvtepi32_ps(s.v), combos_by_row<TN>(d_rows));
  return {_mm_fmadd_ps(dot, combos_by_token<TM, TN>(dx), acc.v)};
}
template <int TM, int TN>
inline Floats min_fma(Floats acc, const float* m_rows, const float* sx) {
  return {_mm_fmadd_ps(combos_by_row<TN>(m_rows), combos_by_token<TM, TN>(sx), acc.v)};
}
#endif

inline int32_t load_u32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline int64_t load_u64(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
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
    } else if constexpr (TN % 4 == 0) {
      for (int g = 0; g < TN; g += 4) headers<4>(n + g, b, d_out + g, m_out + g);
    } else {
      for (int r = 0; r < TN; ++r) {
        d_out[r] = d(n + r, b);
        if constexpr (Type == Q4_1) m_out[r] = m(n + r, b);
      }
    }
  }
#if NANOSERVE_AVX512
  // d (and, with Min, m) of block b of rows n .. n + TN - 1 as RowValues: one gather of each
  // row's first four bytes (d, then m or the first codes).
  template <int TN, bool Min>
  void row_vectors(int64_t n, int64_t b, RowValues& d_out, RowValues& m_out) const {
    const uint8_t* p = blocks + n * row_bytes + b * kBytes;
    if constexpr (TN == 1) {
      d_out = {_mm512_set1_ps(fp16_at(p))};
      if constexpr (Min) m_out = {_mm512_set1_ps(fp16_at(p + 2))};
    } else if constexpr (TN == 2) {  // lane c <- row c % 2: two halves repeated, cheaper than a gather
      const auto pair = [&](int64_t offset) {
        const int32_t both = static_cast<uint16_t>(load_u16(p + offset)) |
                             (static_cast<int32_t>(static_cast<uint16_t>(load_u16(p + row_bytes + offset))) << 16);
        return _mm512_cvtph_ps(_mm256_set1_epi32(both));
      };
      d_out = {pair(0)};
      if constexpr (Min) m_out = {pair(2)};
    } else {
      const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i row = _mm512_and_si512(lane, _mm512_set1_epi32(TN - 1));  // c % TN, TN a power of two
      const __m512i words = _mm512_i32gather_epi32(_mm512_mullo_epi32(row, _mm512_set1_epi32(static_cast<int32_t>(row_bytes))), p, 1);
      d_out = {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(words))};
      if constexpr (Min) m_out = {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)))};
    }
  }
#endif
  void prefetch(int64_t n, int64_t b, int64_t rows) const {
    // the bytes a tile of `rows` rows reads, one tile ahead (the next tile's rows lie together,
    // and a block step covers rows * kBytes of them): DRAM streams too slowly for several
    // interleaved rows on its own
    const char* next = reinterpret_cast<const char*>(blocks + (n + rows) * row_bytes + b * rows * kBytes);
    for (int64_t line = 0; line <= rows * kBytes / 64; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);
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
    } else if constexpr (TN % 4 == 0) {
      for (int g = 0; g < TN; g += 4) headers<4>(n + g, b, d_out + g, m_out + g);
    } else {
      for (int r = 0; r < TN; ++r) {
        d_out[r] = d(n + r, b);
        if constexpr (Type == Q4_1) m_out[r] = m(n + r, b);
      }
    }
  }
#if NANOSERVE_AVX512
  // d (and m) of block b of rows n .. n + TN - 1 (n a group's first row) as RowValues: the
  // records' fp16 headers, four rows to 8 bytes.
  template <int TN, bool Min>
  void row_vectors(int64_t n, int64_t b, RowValues& d_out, RowValues& m_out) const {
    if constexpr (TN == 1) {
      d_out = {_mm512_set1_ps(d(n, b))};
      if constexpr (Min) m_out = {_mm512_set1_ps(m(n, b))};
    } else if constexpr (TN == 2) {  // n the first or third row of a group: its and the next row's halves, repeated
      const uint8_t* h = record(n, b) + kGroupCodeBytes + 2 * (n % kGroupRows);
      d_out = {_mm512_cvtph_ps(_mm256_set1_epi32(load_u32(h)))};
      if constexpr (Min) m_out = {_mm512_cvtph_ps(_mm256_set1_epi32(load_u32(h + 8)))};
    } else {
      const uint8_t* h = record(n, b) + kGroupCodeBytes;
      const int64_t stride = nb * kBytes;  // the next group's record of the same block
      const auto halves = [&](int64_t offset) -> __m512 {
        if constexpr (TN == 16)
          return _mm512_cvtph_ps(_mm256_setr_epi64x(load_u64(h + offset), load_u64(h + stride + offset),
                                                    load_u64(h + 2 * stride + offset), load_u64(h + 3 * stride + offset)));
        else if constexpr (TN == 8)
          return _mm512_broadcast_f32x8(_mm256_cvtph_ps(_mm_set_epi64x(load_u64(h + stride + offset), load_u64(h + offset))));
        else
          return _mm512_broadcast_f32x4(_mm_cvtph_ps(_mm_cvtsi64_si128(load_u64(h + offset))));
      };
      d_out = {halves(0)};
      if constexpr (Min) m_out = {halves(8)};
    }
  }
#endif
  void prefetch(int64_t n, int64_t b, int64_t rows) const {
    for (int64_t g = 0; g < rows; g += kGroupRows) {  // each group's records, 2 KiB ahead
      const char* ahead = reinterpret_cast<const char*>(record(n + g, b)) + 2048;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
  }
};

// y[i, r] (y already offset to column n0) for the TM rows of x and TN weight rows from row n0:
//   sum_b fma(float(S_irb) * d_rb, dx_ib)  [one float chain per output, blocks in order]
//     + sum_b fma(m_rb, dx_ib * sum(a_ib))  [Q4_1's minimum, a second chain]
// where S_irb = a_ib . q_rb is the block's 32 products summed exactly in int32: a sum with no
// order, so the large-step body (gguf_linear.cpp's int16 panels) computes the very same chains.
// dx is a power of two, so the product's one rounding is that of d times the exact dot.
// The TM * TN outputs ("combos", c = i * TN + r, at most 16) share one register per chain.
template <int64_t Type, int TM, int TN, class Weights>
inline void tile(const ActBlocks& x, const Weights& w, int64_t n0, float* y, int64_t ldy) {
  static_assert(TM * TN <= kCombos, "a tile's outputs must fit one register of combos");
  Floats acc = zero_floats(), min_acc = zero_floats();
  for (int64_t b = 0; b < x.nb; ++b) {
    w.prefetch(n0, b, TN);
    Codes q[TN];
    for (int r = 0; r < TN; ++r) q[r] = w.codes(n0 + r, b);
    Dots dots[TM * TN];
    for (int i = 0; i < TM; ++i) {
      const Codes a = load_acts(x.codes + i * x.k + b * kGroup);
      for (int r = 0; r < TN; ++r) dots[i * TN + r] = block_dot(a, q[r]);
    }
    const Sums sums = sum_dots<TM * TN>(dots);
    const float* dx = x.scale_by_block + b * kActLanes;  // row i's dx in lane i, zero past TM
    const float* sx = x.scaled_sum_by_block + b * kActLanes;
#if NANOSERVE_AVX512
    RowValues d_rows, m_rows;
    w.template row_vectors<TN, Type == Q4_1>(n0, b, d_rows, m_rows);
#else
    float d_rows[TN], m_rows[TN];
    w.template headers<TN>(n0, b, d_rows, m_rows);
#endif
    acc = scale_fma<TM, TN>(acc, sums, d_rows, dx);
    if constexpr (Type == Q4_1) min_acc = min_fma<TM, TN>(min_acc, m_rows, sx);
  }
  alignas(64) float out[kCombos], mins[kCombos];
  store_floats(out, acc);
  store_floats(mins, min_acc);
  for (int i = 0; i < TM; ++i)
    for (int r = 0; r < TN; ++r) {
      const int c = i * TN + r;
      y[i * ldy + r] = Type == Q4_1 ? out[c] + mins[c] : out[c];
    }
}

// Tile shapes: TM x TN outputs fill the sixteen combos of a register where they can (AVX-512);
// AVX2's sixteen registers hold fewer weight rows' codes.
#if NANOSERVE_AVX512
template <int TM>
constexpr int kFewTileN = TM == 1 ? 16 : TM == 2 ? 8 : TM <= 4 ? 4 : 2;
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
  if constexpr (TN > 4)
    for (; r + 4 <= end; r += 4) tile<Type, TM, 4, Weights>(x, w, r, y + r, ldy);
  if constexpr (TN == 2)
    for (; r + 2 <= end; r += 2) tile<Type, TM, 2, Weights>(x, w, r, y + r, ldy);
  for (; r < end; ++r) tile<Type, TM, 1, Weights>(x, w, r, y + r, ldy);
}

// y [T, n] for T <= kTileMaxTokens rows of x (8 on AVX-512, 4 on AVX2), each worker taking a range of weight rows
// (whole groups of four in the grouped layout, so that every tile lies in one group).
// Every weight block is read once per call, whatever T: 5 to 8 rows take tiles of 2 weight
// rows (AVX-512 only; the AVX2 body takes at most 4 rows a call).
template <int64_t Type, class Weights>
void gguf_linear_rows(const ActBlocks& x, int64_t num_tokens, const Weights& w, int64_t n, float* y) {
  const auto rows = [&](int64_t first, int64_t last) {
    switch (num_tokens) {
      case 1: few_tokens<Type, 1>(x, w, first, last, y, n); break;
      case 2: few_tokens<Type, 2>(x, w, first, last, y, n); break;
      case 3: few_tokens<Type, 3>(x, w, first, last, y, n); break;
#if NANOSERVE_AVX512
      case 4: few_tokens<Type, 4>(x, w, first, last, y, n); break;
      case 5: few_tokens<Type, 5>(x, w, first, last, y, n); break;
      case 6: few_tokens<Type, 6>(x, w, first, last, y, n); break;
      case 7: few_tokens<Type, 7>(x, w, first, last, y, n); break;
      default: few_tokens<Type, 8>(x, w, first, last, y, n); break;
#else
      default: few_tokens<Type, 4>(x, w, first, last, y, n); break;
#endif
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
