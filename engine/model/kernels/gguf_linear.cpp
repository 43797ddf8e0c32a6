// y = x @ w.T with w kept in GGUF blocks (Q4_0, Q4_1, Q8_0), for the CPU (AVX2/FMA/F16C; AVX-512
// F/BW/DQ/VL where the CPU has it, chosen at run time).
//
// Block layouts (ggml's block_q4_0 / block_q4_1 / block_q8_0, 32 weights each, along a row):
//   Q4_0: d fp16 | 16 bytes of nibbles            w = d * (q - 8)
//   Q4_1: d fp16 | m fp16 | 16 bytes of nibbles   w = d * q + m
//   Q8_0: d fp16 | 32 int8                        w = d * q
// Byte j of a 4-bit block holds element j in its low nibble and element j + 16 in its high one.
//
// Two paths, by the number of x rows T:
//
// T <= kFewMaxTokens = 8 (decode, and a speculative verify pass of up to 8 rows): integer dot
// products with 16-bit activations (gguf_linear_tile.h); the AVX-512 tiles read each weight block
// once for all T rows, the AVX2 ones take four rows a call.
// Each row of x is cut into blocks of 32; a block is scaled by a power of two, dx = 2^(e - 15)
// where max|x| = f * 2^e, f in [0.5, 1), and rounded to int16: a = rint(x / dx), so every
// element keeps at least 15 significant bits of its block's largest one (bf16 keeps 8 of its
// own). Per weight block the 32 products a * q are summed exactly in int32, then
//   y = sum_b (d_b * (a_b . q_b)) * dx_b   [one float chain in block order: a multiply, a fused multiply-add]
//     + sum_b m_b * (dx_b * sum(a_b))      [Q4_1's minimum, a second chain]
// This is ggml's scheme for its quantized dot products with 16-bit instead of 8-bit activations:
// 8 bits moved the default model's greedy answers at near ties; 16 bits keep them. An output
// depends only on its x row and weight row: the same bits for T = 1..8, any thread count, and
// the AVX2 (four rows a call) and AVX-512 bodies.
//
// More rows (prefill, large batches): x stays float32. Each worker dequantizes a panel
// of kPanelRows weight rows to float32 (gguf's values exactly: a product, then a sum, never
// fused) and multiplies every row of x against it: eight partial sums, lane l taking k = l mod 8
// in order, fused multiply-adds, one fixed pairwise sum. An output depends only on its x row
// and weight row here too. The AVX-512 body runs two x rows per register (the same eight lanes
// each, so the same bits as the AVX2 body) and dequantizes sixteen weights per instruction.
// The two paths differ by the activations' rounding (relative 2^-15 of a block's largest
// element), not by the weights.
//
// isa avx512_bf16 (matmul_precision medium, CPUs with AVX-512 BF16) changes the second path
// only: x is rounded to bf16 (or comes in bf16), the panel's weights too (gguf's float values,
// then round to nearest even: the dense bf16 path's weights), and bf16 dot products (two
// products per 32-bit lane, vdpbf16ps) sum them in float32 per output row, twice the float32
// body's multiply-adds per instruction. An output still depends only on its x row and weight row.
//
// isa amx_bf16 (CPUs with AMX, Sapphire Rapids on) takes the same bf16 panels and packed x, and
// multiplies them by AMX tiles (tdpbf16ps: 16 x 16 outputs, 32 k a block per instruction),
// 3-7x the dot-product body from 16 rows of x on (avx512_bf16_panel::amx_tokens_times_panels).
// Up to 8 rows it is the avx512 decode path, as avx512_bf16 is.
//
// isa int16 (batch invariance, the default on nanoserve's path) runs every step by the first
// path's arithmetic: beyond 8 rows by the int16 panels (avx512_int16_panel, AVX-512 VNNI), else
// by the decode tiles eight rows at a time (four on AVX2); an output's bits then depend on its x row alone,
// whatever T. int16_avx2 is the same by the AVX2 tiles only.
#include <immintrin.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_features.h"

namespace {

constexpr int64_t kGroup = 32;         // weights per block
constexpr int64_t kFewMaxTokens = 8;   // up to this many x rows: 16-bit activations, weights read from their blocks
constexpr int64_t kRowsPerTask = 16;   // weight rows per parallel task on that path
constexpr int64_t kPanelRows = 12;     // more x rows: weight rows dequantized at a time (a multiple of both bodies' tile rows)
constexpr int64_t kTileM = 4;          // x rows per float micro-kernel call
constexpr int64_t kTileN = 3;          // weight rows per float micro-kernel call
constexpr int kMinExponent = -100;     // blocks with max|x| < 2^-100 count as zero (dx would underflow)

enum QuantType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids
// kInt16: every step by the decode path's arithmetic (the int16 panels for large steps where the
// CPU has AVX-512 VNNI, else the decode tiles four x rows at a time); kInt16Avx2: the same by the
// AVX2 decode tiles only (what a CPU without AVX-512 runs).
enum Isa : int64_t { kBest = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmxBf16 = 4, kInt16 = 5, kInt16Avx2 = 6 };
enum Layout : int64_t { kRows = 0, kGroups = 1 };  // GGUF rows, or Q4 rows regrouped by four (below)

// The grouped layout (Q4_0 / Q4_1, repacked once at load): rows taken four at a time, and for
// each block index b of a group of rows n..n+3, one record of
//   64 bytes: the four rows' 16 bytes of nibbles, row n first
//   8 bytes:  the four d (fp16), then for Q4_1 8 bytes: the four m (fp16)
// Records follow b, then the group: [N / 4, K / 32, 72 or 80] bytes, the file's bytes rearranged.
// A decode step then reads one stream of whole cache lines, and the four d (and m) of a tile
// convert in one instruction.
constexpr int64_t kGroupRows = 4;
constexpr int64_t kGroupCodeBytes = 64;

int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: TORCH_CHECK(false, "gguf_linear: unsupported quant type id ", type);
  }
}

int64_t grouped_bytes(int64_t type) { return kGroupCodeBytes + (type == Q4_1 ? 16 : 8); }

// x quantized per block of 32: codes [T, K] int16, scale (dx) [T, K / 32], scaled_sum (dx * sum of codes) [T, K / 32].
// The decode tiles read dx and the scaled sums by block: [K / 32, kActLanes], row i of the call in
// lane i, zero past its rows, so one load gives a block's values for every row (no gather per block).
constexpr int64_t kActLanes = 8;
struct ActBlocks {
  const int16_t* codes;
  const float* scale;
  const float* scaled_sum;
  int64_t k, nb;
  const float* scale_by_block;       // [nb, kActLanes]
  const float* scaled_sum_by_block;  // [nb, kActLanes]
};

// One row of x (K floats) -> its int16 codes, scales and scaled sums (AVX2; integer results, so
// the same on every instruction set).
void quantize_row(const float* x, int64_t nb, int16_t* codes, float* scale, float* scaled_sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kGroup;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, amax);
    float block_max = 0.0f;
    for (int j = 0; j < 8; ++j) block_max = std::max(block_max, lanes[j]);
    __m256 probe = _mm256_setzero_ps();  // NaN where any element is inf or NaN (x * 0)
    for (int j = 0; j < 4; ++j) probe = _mm256_add_ps(probe, _mm256_mul_ps(v[j], _mm256_setzero_ps()));
    const bool finite = _mm256_movemask_ps(_mm256_cmp_ps(probe, probe, _CMP_UNORD_Q)) == 0;
    int exponent = 0;
    std::frexp(block_max, &exponent);
    if (!finite) {  // inf or NaN: the block's output becomes NaN, never a silent number
      std::memset(codes + b * kGroup, 0, kGroup * sizeof(int16_t));
      scale[b] = std::numeric_limits<float>::quiet_NaN();
      scaled_sum[b] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (block_max == 0.0f || exponent < kMinExponent) {
      std::memset(codes + b * kGroup, 0, kGroup * sizeof(int16_t));
      scale[b] = 0.0f;
      scaled_sum[b] = 0.0f;
      continue;
    }
    const __m256 inverse = _mm256_set1_ps(std::ldexp(1.0f, 15 - exponent));
    const __m256i top = _mm256_set1_epi32(32767);
    __m256i total = _mm256_setzero_si256();
    __m256i q[4];
    for (int j = 0; j < 4; ++j) {
      q[j] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse)), top);  // round to nearest even
      total = _mm256_add_epi32(total, q[j]);
    }
    // packs works per 128-bit half: [a0-3 b0-3 a4-7 b4-7] -> reorder the 64-bit quarters
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kGroup), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kGroup + 16), hi);
    int32_t sums[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums), total);
    int32_t sum = 0;
    for (int j = 0; j < 8; ++j) sum += sums[j];
    scale[b] = std::ldexp(1.0f, exponent - 15);
    scaled_sum[b] = scale[b] * static_cast<float>(sum);  // exact: a power of two times |sum| < 2^21
  }
}

// ---- more than kFewMaxTokens rows: float32 x times gguf's weights, dequantized a panel at a time ----

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 32 weights of one block as four vectors of 8 floats (elements 8j..8j+7 in w[j]), from its
// codes (Q4: 16 bytes of nibbles; Q8_0: 32 int8), d and (Q4_1) m.
template <int64_t Type>
inline void dequantize_block(const uint8_t* codes, float d_value, float m_value, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(d_value);
  if constexpr (Type == Q8_0) {
    for (int j = 0; j < 4; ++j) {
      __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * j));
      w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
    }
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(packed, low_mask);                      // elements 0..15
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_mask);  // elements 16..31
    const __m128i nibbles[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    if constexpr (Type == Q4_0) {
      const __m256i eight = _mm256_set1_epi32(8);
      for (int j = 0; j < 4; ++j)
        w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(nibbles[j]), eight)));
    } else {
      const __m256 m = _mm256_set1_ps(m_value);
      for (int j = 0; j < 4; ++j)
        w[j] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles[j]))), m);
    }
  }
}

// Where block b of weight row n lies: its codes, its d and (Q4_1) its m as floats.
struct BlockRef {
  const uint8_t* codes;
  float d, m;
};

// Block b of row n (K / 32 = num_blocks blocks a row), in GGUF rows or in groups of four rows.
template <int64_t Type, bool Grouped>
inline BlockRef block_at(const uint8_t* weights, int64_t n, int64_t num_blocks, int64_t b) {
  if constexpr (Grouped) {
    const uint8_t* group = weights + ((n / kGroupRows) * num_blocks + b) * grouped_bytes(Type);
    const int64_t r = n % kGroupRows;
    return {group + 16 * r, half_at(group + kGroupCodeBytes + 2 * r),
            Type == Q4_1 ? half_at(group + kGroupCodeBytes + 8 + 2 * r) : 0.0f};
  } else {
    const uint8_t* block = weights + (n * num_blocks + b) * block_bytes(Type);
    return {block + (Type == Q4_1 ? 4 : 2), half_at(block), Type == Q4_1 ? half_at(block + 2) : 0.0f};
  }
}

// Row n of the weights (K / 32 blocks) -> K floats.
template <int64_t Type, bool Grouped>
void dequantize_row(const uint8_t* weights, int64_t n, int64_t num_blocks, float* out) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m256 w[4];
    const BlockRef block = block_at<Type, Grouped>(weights, n, num_blocks, b);
    dequantize_block<Type>(block.codes, block.d, block.m, w);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + b * kGroup + 8 * j, w[j]);
  }
}

// The fixed pairwise sum of a vector's eight lanes: ((0+4)+(2+6)) + ((1+5)+(3+7)).
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // i + (i+4)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                         // (0+4)+(2+6), (1+5)+(3+7)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// y[m, n] = x[m, :] . w[n, :] for TM rows of x and TN rows of w; K a multiple of 8.
template <int TM, int TN>
void micro_kernel(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* y, int64_t ldy) {
  __m256 acc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; p += 8) {
    __m256 wv[TN];
    for (int j = 0; j < TN; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + p);
    for (int i = 0; i < TM; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + p);
      for (int j = 0; j < TN; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) y[i * ldy + j] = sum8(acc[i][j]);
}

template <int TM>
void rows_times_panel(const float* x, int64_t ldx, const float* panel, int64_t k, int64_t rows, float* y, int64_t ldy) {
  int64_t j = 0;
  for (; j + kTileN <= rows; j += kTileN) micro_kernel<TM, kTileN>(x, ldx, panel + j * k, k, k, y + j, ldy);
  for (; j < rows; ++j) micro_kernel<TM, 1>(x, ldx, panel + j * k, k, k, y + j, ldy);
}

// All rows of x against one panel of `rows` dequantized weight rows (AVX2 body).
void tokens_times_panel(const float* x, int64_t num_tokens, const float* panel, int64_t k, int64_t rows, float* y,
                        int64_t ldy) {
  int64_t m = 0;
  for (; m + kTileM <= num_tokens; m += kTileM) rows_times_panel<kTileM>(x + m * k, k, panel, k, rows, y + m * ldy, ldy);
  for (; m < num_tokens; ++m) rows_times_panel<1>(x + m * k, k, panel, k, rows, y + m * ldy, ldy);
}

}  // namespace

// The AVX-512 body of the panel product, the same bits as the AVX2 one: a 16-lane register holds
// two rows of x (lanes 0-7 row 2i, 8-15 row 2i + 1, eight k each) against one weight row's eight k
// broadcast to both halves, so lane l of either half takes k = l mod 8 in order through the same
// fused multiply-adds, and each half is summed by sum8. x is first packed by pairs:
// [T / 2, K / 8, 16] floats.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")
namespace avx512_panel {
namespace {

constexpr int kTilePairs = 4;  // pairs of x rows per micro-kernel call
constexpr int kTileRows = 6;   // weight rows per micro-kernel call (kPanelRows a multiple of it)

// dequantize_block's values (the same product, then sum) as two vectors of 16: elements 0-15, 16-31.
template <int64_t Type>
inline void dequantize_block16(const uint8_t* codes, float d_value, float m_value, __m512 w[2]) {
  const __m512 d = _mm512_set1_ps(d_value);
  if constexpr (Type == Q8_0) {
    for (int j = 0; j < 2; ++j)
      w[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * j)))));
  } else {
    const __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m512i low_mask = _mm512_set1_epi32(0x0F);
    __m512i q[2] = {_mm512_and_si512(packed, low_mask), _mm512_srli_epi32(packed, 4)};
    for (int j = 0; j < 2; ++j) {
      if constexpr (Type == Q4_0) {
        w[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(q[j], _mm512_set1_epi32(8))));
      } else {
        w[j] = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(q[j])), _mm512_set1_ps(m_value));
      }
    }
  }
}

template <int64_t Type, bool Grouped>
void dequantize_row16(const uint8_t* weights, int64_t n, int64_t num_blocks, float* out) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m512 w[2];
    const BlockRef block = block_at<Type, Grouped>(weights, n, num_blocks, b);
    dequantize_block16<Type>(block.codes, block.d, block.m, w);
    _mm512_storeu_ps(out + b * kGroup, w[0]);
    _mm512_storeu_ps(out + b * kGroup + 16, w[1]);
  }
}

// x rows 2i, 2i + 1 -> one [K / 8, 16] pair.
void pack_pair(const float* x0, const float* x1, int64_t k, float* out) {
  for (int64_t p = 0; p < k; p += 8) {
    _mm256_storeu_ps(out + 2 * p, _mm256_loadu_ps(x0 + p));
    _mm256_storeu_ps(out + 2 * p + 8, _mm256_loadu_ps(x1 + p));
  }
}

template <int TP, int TN>
void pair_kernel(const float* pairs, const float* w, int64_t k, float* y, int64_t ldy) {
  __m512 acc[TP][TN];
  for (int i = 0; i < TP; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; p += 8) {
    __m512 wv[TN];
    for (int j = 0; j < TN; ++j) wv[j] = _mm512_broadcast_f32x8(_mm256_loadu_ps(w + j * k + p));
    for (int i = 0; i < TP; ++i) {
      const __m512 xv = _mm512_loadu_ps(pairs + i * 2 * k + 2 * p);
      for (int j = 0; j < TN; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < TP; ++i)
    for (int j = 0; j < TN; ++j) {
      y[2 * i * ldy + j] = sum8(_mm512_castps512_ps256(acc[i][j]));
      y[(2 * i + 1) * ldy + j] = sum8(_mm512_extractf32x8_ps(acc[i][j], 1));
    }
}

template <int TP>
void pairs_times_panel(const float* pairs, const float* panel, int64_t k, int64_t rows, float* y, int64_t ldy) {
  int64_t j = 0;
  for (; j + kTileRows <= rows; j += kTileRows) pair_kernel<TP, kTileRows>(pairs, panel + j * k, k, y + j, ldy);
  for (; j < rows; ++j) pair_kernel<TP, 1>(pairs, panel + j * k, k, y + j, ldy);
}

// All rows of x (pairs packed, an odd last row left in x) against one panel.
void tokens_times_panel(const float* x, const float* pairs, int64_t num_tokens, const float* panel, int64_t k,
                        int64_t rows, float* y, int64_t ldy) {
  const int64_t num_pairs = num_tokens / 2;
  int64_t i = 0;
  for (; i + kTilePairs <= num_pairs; i += kTilePairs)
    pairs_times_panel<kTilePairs>(pairs + i * 2 * k, panel, k, rows, y + 2 * i * ldy, ldy);
  const float* rest = pairs + i * 2 * k;
  float* y_rest = y + 2 * i * ldy;
  switch (num_pairs - i) {  // up to kTilePairs - 1 pairs left
    case 3: pairs_times_panel<3>(rest, panel, k, rows, y_rest, ldy); break;
    case 2: pairs_times_panel<2>(rest, panel, k, rows, y_rest, ldy); break;
    case 1: pairs_times_panel<1>(rest, panel, k, rows, y_rest, ldy); break;
    default: break;
  }
  if (num_tokens % 2) rows_times_panel<1>(x + (num_tokens - 1) * k, k, panel, k, rows, y + (num_tokens - 1) * ldy, ldy);
}

}  // namespace
}  // namespace avx512_panel
#pragma GCC pop_options

// What the bf16 and int16 panel bodies share: a 16 x 16 transpose of 32-bit words and the order
// in which a block's 32 16-bit elements are paired.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")
namespace avx512_pairs {
namespace {

// 16 x 16 32-bit words, r[i] word j -> r[j] word i.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], 128-bit lane l: word 4l + c of rows 4i .. 4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i even_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);   // lanes 0, 2 of each
    const __m512i odd_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);    // lanes 1, 3
    const __m512i even_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i odd_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(even_lo, even_hi, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(even_lo, even_hi, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xDD);
  }
}

// Pair j of block b (j < 16) is elements 32b + j and 32b + j + 16: the two nibbles of byte j of
// a 4-bit block. Word 2j of a block's 32 bf16 <- element j, word 2j + 1 <- element j + 16.
inline __m512i pair_order() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
                          19, 3, 18, 2, 17, 1, 16, 0);
}

}  // namespace
}  // namespace avx512_pairs
#pragma GCC pop_options

// The bfloat16 body of the panel product (AVX-512 BF16), for x in float32 or bf16: the dense
// bf16 path's arithmetic. A panel of kBf16PanelRows weight rows is dequantized as above
// (gguf's float values exactly), rounded to bf16 (round to nearest even, as torch's cast) and
// stored by pairs of k: [K / 2, kBf16PanelRows] 32-bit words, word (p, r) holding row r's two
// elements of pair p (pair_order, below); x is rounded and paired alike. A register of sixteen rows' pair p then
// meets one x row's pair p broadcast to every lane, and one dot-product instruction adds both
// products to each row's float32 sum: 32 multiply-adds per instruction, twice the float32
// body's. Lane r takes the pairs in order, so an output depends only on its x row and weight
// row, whatever T, tile or thread; no lanes are summed across.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,f16c")
namespace avx512_bf16_panel {
namespace {

// Measured on Zen 5 at T = 16 / 64 / 256 (bench.gguf_linear): 2 x 12 beats 4 x 6, 3 x 8 and 1 x 24.
constexpr int kRegs = 2;                        // registers of sixteen weight rows per micro-kernel call
constexpr int64_t kBf16PanelRows = 16 * kRegs;  // weight rows per panel
constexpr int kTileTokens = 12;                 // x rows per micro-kernel call: 24 accumulators

using avx512_pairs::pair_order;
using avx512_pairs::transpose16;

// 32 floats of one block (elements 0-15, 16-31) -> its sixteen pairs, bf16 (round to nearest even).
inline __m512i block_pairs(__m512 first, __m512 second) {
  return _mm512_permutexvar_epi16(pair_order(), reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first)));
}

// x [T, K] (float32, or bf16 as uint16) -> bf16 by pairs: [T, K / 2] 32-bit words, block by block.
void pack_x(const float* x, int64_t num_tokens, int64_t k, uint16_t* out) {
  for (int64_t i = 0; i < num_tokens * k; i += kGroup)
    _mm512_storeu_si512(out + i, block_pairs(_mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i + 16)));
}
void pack_x(const uint16_t* x, int64_t num_tokens, int64_t k, uint16_t* out) {
  for (int64_t i = 0; i < num_tokens * k; i += kGroup)
    _mm512_storeu_si512(out + i, _mm512_permutexvar_epi16(pair_order(), _mm512_loadu_si512(x + i)));
}

// Weight rows n0 .. n0 + rows - 1 (rows <= kBf16PanelRows; the rest zero) -> the panel by pairs:
// each row's block dequantized (dequantize_block16), rounded to bf16 pairs, and sixteen rows'
// pairs transposed so that a register holds one pair of sixteen rows.
template <int64_t Type, bool Grouped>
void dequantize_panel(const uint8_t* weights, int64_t n0, int64_t rows, int64_t num_blocks, uint32_t* panel) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int64_t half = 0; half < kBf16PanelRows / 16; ++half) {
      __m512i words[16];  // row r's block b as sixteen pairs of bf16
      for (int r = 0; r < 16; ++r) {
        const int64_t row = half * 16 + r;
        if (row >= rows) {
          words[r] = _mm512_setzero_si512();
          continue;
        }
        __m512 w[2];
        const BlockRef block = block_at<Type, Grouped>(weights, n0 + row, num_blocks, b);
        avx512_panel::dequantize_block16<Type>(block.codes, block.d, block.m, w);
        words[r] = block_pairs(w[0], w[1]);
      }
      transpose16(words);  // words[p]: pair p of the sixteen rows
      for (int p = 0; p < 16; ++p)
        _mm512_storeu_si512(panel + (b * 16 + p) * kBf16PanelRows + half * 16, words[p]);
    }
  }
}

// The same panel from Q4 weights in the grouped layout, without the transpose: sixteen rows are
// four records, whose nibbles are rearranged by byte (vpermt2b) so that byte j of the sixteen
// rows lies in one 128-bit lane; byte j holds pair j (low nibble: element j, high: j + 16), so
// widening it to one 32-bit lane per row gives both codes of the pair. d and m come as
// sixteen-row vectors from the records' headers. The values are dequantize_block16's (a
// product, then a sum), rounded alike. Needs AVX-512 VBMI (vpermt2b; Zen 4 on, Intel from
// Ice Lake, not Cooper Lake): without it the grouped layout takes dequantize_panel.
// vpermt2b indices: table q, byte 16 jj + r <- row (r mod 8)'s byte 4q + jj within two records
// (rows 0-7 or 8-15 of sixteen).
struct RegroupIndex {
  alignas(64) uint8_t bytes[4][64];
};
constexpr RegroupIndex regroup_index() {
  RegroupIndex index{};
  for (int q = 0; q < 4; ++q)
    for (int jj = 0; jj < 4; ++jj)
      for (int r = 0; r < 16; ++r)
        index.bytes[q][16 * jj + r] = static_cast<uint8_t>(((r % 8) / 4) * 64 + 16 * (r % 4) + 4 * q + jj);
  return index;
}
constexpr RegroupIndex kRegroupIndex = regroup_index();

template <int64_t Type>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi,fma,f16c"))) void
dequantize_panel_groups(const uint8_t* weights, int64_t n0, int64_t rows, int64_t num_blocks, uint32_t* panel) {
  static_assert(Type == Q4_0 || Type == Q4_1);
  constexpr int64_t kRecord = kGroupCodeBytes + (Type == Q4_1 ? 16 : 8);
  __m512i gather[4];
  for (int q = 0; q < 4; ++q) gather[q] = _mm512_load_si512(kRegroupIndex.bytes[q]);
  const __mmask64 upper_rows = 0xFF00FF00FF00FF00ull;  // r >= 8 in each lane of 16
  const __m512i low_nibble = _mm512_set1_epi32(0x0F);
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int64_t half = 0; half < kBf16PanelRows / 16; ++half) {
      const int64_t first = half * 16;
      if (first >= rows) {
        for (int p = 0; p < 16; ++p)
          _mm512_storeu_si512(panel + (b * 16 + p) * kBf16PanelRows + first, _mm512_setzero_si512());
        continue;
      }
      __m512i codes[4];
      uint64_t d_bits[4] = {0, 0, 0, 0}, m_bits[4] = {0, 0, 0, 0};
      for (int g = 0; g < 4; ++g) {
        if (first + 4 * g >= rows) {  // rows come in whole groups of four
          codes[g] = _mm512_setzero_si512();
          continue;
        }
        const uint8_t* record = weights + (((n0 + first) / kGroupRows + g) * num_blocks + b) * kRecord;
        codes[g] = _mm512_loadu_si512(record);
        std::memcpy(&d_bits[g], record + kGroupCodeBytes, 8);
        if constexpr (Type == Q4_1) std::memcpy(&m_bits[g], record + kGroupCodeBytes + 8, 8);
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_set_epi64x(d_bits[3], d_bits[2], d_bits[1], d_bits[0]));
      const __m512 m = _mm512_cvtph_ps(_mm256_set_epi64x(m_bits[3], m_bits[2], m_bits[1], m_bits[0]));
      for (int q = 0; q < 4; ++q) {
        const __m512i bytes = _mm512_mask_blend_epi8(upper_rows, _mm512_permutex2var_epi8(codes[0], gather[q], codes[1]),
                                                     _mm512_permutex2var_epi8(codes[2], gather[q], codes[3]));
        for (int jj = 0; jj < 4; ++jj) {
          __m128i lane;
          switch (jj) {  // the lane index must be a constant
            case 0: lane = _mm512_extracti32x4_epi32(bytes, 0); break;
            case 1: lane = _mm512_extracti32x4_epi32(bytes, 1); break;
            case 2: lane = _mm512_extracti32x4_epi32(bytes, 2); break;
            default: lane = _mm512_extracti32x4_epi32(bytes, 3); break;
          }
          const __m512i both = _mm512_cvtepu8_epi32(lane);
          __m512i lo = _mm512_and_si512(both, low_nibble), hi = _mm512_srli_epi32(both, 4);
          __m512 w_lo, w_hi;
          if constexpr (Type == Q4_0) {
            const __m512i eight = _mm512_set1_epi32(8);
            w_lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)));
            w_hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)));
          } else {
            // fused, yet dequantize_block16's bits: d * q is exact in float32 (11 x 4 significant bits)
            w_lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), m);
            w_hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), m);
          }
          // lane r: (w_lo_r, w_hi_r) as bf16, the low half first
          _mm512_storeu_si512(panel + (b * 16 + 4 * q + jj) * kBf16PanelRows + first, block_pairs(w_lo, w_hi));
        }
      }
    }
  }
}

// y[i, 0 .. 31] for TM rows of x (bf16, [TM, 2 * pairs] with leading dimension ldx elements);
// rows >= `rows` are not stored.
template <int TM>
void panel_kernel(const uint16_t* x, int64_t ldx, const uint32_t* panel, int64_t pairs, int64_t rows, float* y,
                  int64_t ldy) {
  __m512 acc[TM][kRegs];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < kRegs; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[kRegs];
    for (int j = 0; j < kRegs; ++j)
      w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * kBf16PanelRows + 16 * j));
    for (int i = 0; i < TM; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * p, 4);
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int j = 0; j < kRegs; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
    }
  }
  for (int j = 0; j < kRegs; ++j) {
    const int64_t valid = std::clamp<int64_t>(rows - 16 * j, 0, 16);
    const __mmask16 mask = valid == 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    for (int i = 0; i < TM; ++i) _mm512_mask_storeu_ps(y + i * ldy + 16 * j, mask, acc[i][j]);
  }
}

template <int TM>
void tile_rest(const uint16_t* x, int64_t k, const uint32_t* panel, int64_t rows, float* y, int64_t ldy, int64_t tm) {
  if constexpr (TM > 0) {
    if (tm == TM) return panel_kernel<TM>(x, k, panel, k / 2, rows, y, ldy);
    tile_rest<TM - 1>(x, k, panel, rows, y, ldy, tm);
  }
}

// All T rows of x against one panel.
void tokens_times_panel(const uint16_t* x, int64_t num_tokens, const uint32_t* panel, int64_t k, int64_t rows,
                        float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kTileTokens <= num_tokens; m += kTileTokens)
    panel_kernel<kTileTokens>(x + m * k, k, panel, k / 2, rows, y + m * ldy, ldy);
  if (m < num_tokens) tile_rest<kTileTokens - 1>(x + m * k, k, panel, rows, y + m * ldy, ldy, num_tokens - m);
}

// The AMX body (isa amx_bf16): the same panel and packed x, multiplied by tiles. A B tile is
// sixteen pairs of k (one block) of sixteen weight rows: the panel as it is, 128 bytes a pair
// (kBf16PanelRows words). An A tile is sixteen x rows' 32 bf16 of one block, in the pairs'
// order (pack_x), so that A's pair j meets B's pair j. Per 32 x rows: four float32 C tiles
// (two A by two B), one tile dot product each per block, blocks in order; C row i depends only
// on A row i, so an output still depends only on its x row and weight row. The tile unit sums
// a product pair per lane as the dot instruction does, but its order and rounding are its
// own: amx_bf16 and avx512_bf16 agree to float32 rounding, not to the bit.
#define NANOSERVE_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi,fma,f16c,amx-tile,amx-bf16")))
constexpr int64_t kAmxTileRows = 16;                 // rows of every tile: x rows of A and C, pairs of B
constexpr int64_t kAmxTokens = 2 * kAmxTileRows;     // x rows per pass over the panel
constexpr int64_t kAmxGroupPanels = 4;               // panels dequantized together, each 32 rows of x meeting all
static_assert(kBf16PanelRows == 2 * kAmxTileRows, "a panel is two B tiles wide");

// GCC's tile intrinsics (12) do not tell the compiler what memory they read: ldtilecfg names
// only the configuration's first 8 bytes, tileloadd none. Stores before them (the
// configuration, the panel, packed x) are forced out first by this barrier.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

// The tile configuration of one thread, from construction to destruction (ldtilecfg is per
// thread). Tiles 0-3: C, 4-5: A, 6-7: B; each 16 rows of 64 bytes.
class AmxTiles {
 public:
  NANOSERVE_AMX_TARGET AmxTiles() {
    struct alignas(64) {
      uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int t = 0; t < 8; ++t) {
      config.colsb[t] = 64;
      config.rows[t] = kAmxTileRows;
    }
    memory_barrier();
    _tile_loadconfig(&config);
  }
  NANOSERVE_AMX_TARGET ~AmxTiles() { _tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

// One pass of the tiles: 32 rows of x (a: packed, zero rows past `tokens`) against one panel,
// into y's first `tokens` rows and `rows` columns.
NANOSERVE_AMX_TARGET inline void amx_pass(const uint16_t* a, const uint32_t* panel, int64_t k, int64_t tokens,
                                          int64_t rows, float* out, int64_t ldy) {
  const int64_t x_stride = k * 2, y_stride = ldy * 4, pair_stride = kBf16PanelRows * 4;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t b = 0; b < k / kGroup; ++b) {
    const uint32_t* block = panel + b * 16 * kBf16PanelRows;
    _tile_loadd(6, block, pair_stride);
    _tile_loadd(7, block + 16, pair_stride);
    _tile_loadd(4, a + b * kGroup, x_stride);
    _tile_loadd(5, a + kAmxTileRows * k + b * kGroup, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  if (tokens == kAmxTokens && rows == kBf16PanelRows) {
    _tile_stored(0, out, y_stride);
    _tile_stored(1, out + 16, y_stride);
    _tile_stored(2, out + kAmxTileRows * ldy, y_stride);
    _tile_stored(3, out + kAmxTileRows * ldy + 16, y_stride);
    return;
  }
  alignas(64) float part[kAmxTokens][kBf16PanelRows];  // a ragged pass lands here first
  constexpr int64_t part_stride = kBf16PanelRows * 4;
  _tile_stored(0, &part[0][0], part_stride);
  _tile_stored(1, &part[0][16], part_stride);
  _tile_stored(2, &part[kAmxTileRows][0], part_stride);
  _tile_stored(3, &part[kAmxTileRows][16], part_stride);
  for (int64_t i = 0; i < tokens; ++i) std::memcpy(out + i * ldy, part[i], rows * sizeof(float));
}

// All T rows of x (packed, padded with zero rows to a multiple of kAmxTokens) against `count`
// consecutive panels (32 weight rows each, the last `last_rows`); y [T, ldy] offset to the first
// panel's column. 32 rows of x meet every panel of the group while they sit in the core's
// caches: x (2.4 MB at 2048 tokens of 576) streams from memory once per group, not per panel.
NANOSERVE_AMX_TARGET void amx_tokens_times_panels(const uint16_t* x, int64_t num_tokens, const uint32_t* panels,
                                                  int64_t count, int64_t k, int64_t last_rows, float* y,
                                                  int64_t ldy) {
  memory_barrier();  // the panels' and x's stores are done
  const int64_t panel_words = k / 2 * kBf16PanelRows;
  for (int64_t m0 = 0; m0 < num_tokens; m0 += kAmxTokens) {
    const int64_t tokens = std::min(kAmxTokens, num_tokens - m0);
    for (int64_t j = 0; j < count; ++j)
      amx_pass(x + m0 * k, panels + j * panel_words, k, tokens, j == count - 1 ? last_rows : kBf16PanelRows,
               y + m0 * ldy + j * kBf16PanelRows, ldy);
  }
}

template <int64_t Type, bool Grouped>
void dequantize_any_panel(const uint8_t* blocks, int64_t n0, int64_t rows, int64_t k, uint32_t* panel) {
  if constexpr (Grouped) {  // Q4 only
    if (cpu_has_avx512_vbmi())
      dequantize_panel_groups<Type>(blocks, n0, rows, k / kGroup, panel);
    else
      dequantize_panel<Type, true>(blocks, n0, rows, k / kGroup, panel);
  } else {
    dequantize_panel<Type, Grouped>(blocks, n0, rows, k / kGroup, panel);
  }
}

template <int64_t Type, bool Grouped, class X>
void gguf_linear_amx(const X* x, int64_t num_tokens, const uint8_t* blocks, int64_t n, int64_t k, float* y) {
  const int64_t padded = (num_tokens + kAmxTokens - 1) / kAmxTokens * kAmxTokens;
  std::vector<uint16_t> packed(padded * k);  // the padding rows stay zero
  pack_x(x, num_tokens, k, packed.data());
  const int64_t num_panels = (n + kBf16PanelRows - 1) / kBf16PanelRows;
  const int64_t panel_words = k / 2 * kBf16PanelRows;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> panels(kAmxGroupPanels * panel_words);
    const AmxTiles tiles;
    for (int64_t p = begin; p < end; p += kAmxGroupPanels) {
      const int64_t count = std::min(kAmxGroupPanels, end - p);
      int64_t rows = kBf16PanelRows;
      for (int64_t j = 0; j < count; ++j) {
        const int64_t n0 = (p + j) * kBf16PanelRows;
        rows = std::min(kBf16PanelRows, n - n0);
        dequantize_any_panel<Type, Grouped>(blocks, n0, rows, k, panels.data() + j * panel_words);
      }
      amx_tokens_times_panels(packed.data(), num_tokens, panels.data(), count, k, rows, y + p * kBf16PanelRows, n);
    }
  });
}

template <int64_t Type, bool Grouped, class X>
void gguf_linear_panels(const X* x, int64_t num_tokens, const uint8_t* blocks, int64_t n, int64_t k, float* y) {
  std::vector<uint16_t> packed(num_tokens * k);
  pack_x(x, num_tokens, k, packed.data());
  const int64_t num_panels = (n + kBf16PanelRows - 1) / kBf16PanelRows;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> panel(k / 2 * kBf16PanelRows);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kBf16PanelRows;
      const int64_t rows = std::min(kBf16PanelRows, n - n0);
      dequantize_any_panel<Type, Grouped>(blocks, n0, rows, k, panel.data());
      tokens_times_panel(packed.data(), num_tokens, panel.data(), k, rows, y + n0, n);
    }
  });
}

}  // namespace
}  // namespace avx512_bf16_panel
#pragma GCC pop_options

// The int16 body of the panel product (AVX-512 VNNI): the decode path's arithmetic for steps of
// any size, so that an output has the same bits whatever the step (see gguf_linear_tile.h). x
// is rounded per block to 16-bit codes exactly as quantize_row does for a decode step and paired
// ([T, K / 2] 32-bit words, pair_order); a panel of kIntPanelRows weight rows holds their codes
// (Q4_0: q - 8; Q4_1: q; Q8_0: q) as int16 pairs by k, sixteen rows to a register, beside each
// block's d (and m) as floats. One vpdpwssd adds a pair's two products to each of sixteen rows'
// int32 sums: sixteen of them give a block's 32 products, summed exactly, as the decode body's
// integer sums do (an exact sum has no order); then the same float chain per output,
//   acc = fma(float(S) * d, dx, acc),  min = fma(m, dx * sum(a), min),  y = acc + min,
// blocks in order. 32 multiply-adds per instruction, as vdpbf16ps, plus three float operations
// per block and register.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")
namespace avx512_int16_panel {
namespace {

using avx512_pairs::pair_order;
using avx512_pairs::transpose16;

constexpr int64_t kIntPanelRows = 32;  // weight rows per panel: two registers of sixteen

// x rows per micro-kernel call: 2 x 6 integer sums and 2 x 6 float chains, all in registers
// (with the pairs unrolled and vpdpwssd's accumulator tied, GCC 12 keeps them there; 12 rows put
// the chains in memory, a load, fma and store each per block, and measured slower: 0.85-0.94x at
// T = 256 and the lm_head's 0.87-0.98x at 64 for 6). Measured on Zen 5 (bench.gguf_linear's
// layers, one thread, three alternating rounds) against the former loop of 6 rows, whose
// intrinsic vpdpwssd GCC 12 wrapped in two register copies each and whose chains it spilled:
// 0.85-0.94x its time at T = 16, 0.81-0.84x at 24, 0.78-0.89x at 64, 0.75-0.77x at 256. What is
// left above the bf16 body (1.15-1.25x at 64 and 256) is the arithmetic: the 12-row kernel
// without its float chains ran 1.05-1.1x the bf16 body at 256.
constexpr int kIntTileTokens = 6;

// x [T, K] float32 -> its 16-bit codes by pairs, scales and scaled sums, kIntTileTokens rows side
// by side: words [tiles, nb, 16, kIntTileTokens], scale and scaled_sum [tiles, nb, kIntTileTokens]
// (a last partial tile's missing rows zero), so a tile's pair p of block b is one run of words
// for every row and the micro-kernel addresses all of its rows from one pointer.
struct PackedX {
  std::vector<uint32_t> words;
  std::vector<float> scale, scaled_sum;
  int64_t nb;
};

PackedX pack_x(const float* x, int64_t num_tokens, int64_t k) {
  const int64_t nb = k / kGroup;
  const int64_t tiles = (num_tokens + kIntTileTokens - 1) / kIntTileTokens;
  PackedX packed{std::vector<uint32_t>(tiles * nb * 16 * kIntTileTokens),
                 std::vector<float>(tiles * nb * kIntTileTokens), std::vector<float>(tiles * nb * kIntTileTokens), nb};
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<int16_t> codes(k);
    std::vector<float> scale(nb), scaled_sum(nb);
    alignas(64) uint32_t pairs[16];
    for (int64_t t = begin; t < end; ++t) {
      quantize_row(x + t * k, nb, codes.data(), scale.data(), scaled_sum.data());
      const int64_t tile = t / kIntTileTokens, i = t % kIntTileTokens;
      for (int64_t b = 0; b < nb; ++b) {
        _mm512_store_si512(pairs, _mm512_permutexvar_epi16(pair_order(), _mm512_loadu_si512(codes.data() + b * kGroup)));
        uint32_t* out = packed.words.data() + ((tile * nb + b) * 16) * kIntTileTokens + i;
        for (int q = 0; q < 16; ++q) out[q * kIntTileTokens] = pairs[q];
        packed.scale[(tile * nb + b) * kIntTileTokens + i] = scale[b];
        packed.scaled_sum[(tile * nb + b) * kIntTileTokens + i] = scaled_sum[b];
      }
    }
  });
  return packed;
}

// One block of one weight row -> its 32 signed codes (int16, element order).
template <int64_t Type>
inline __m512i block_codes(const uint8_t* codes) {
  if constexpr (Type == Q8_0) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  } else {
    const __m512i both =
        _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i q = _mm512_and_si512(_mm512_srlv_epi16(both, shifts), _mm512_set1_epi16(0x0F));
    return Type == Q4_0 ? _mm512_sub_epi16(q, _mm512_set1_epi16(8)) : q;
  }
}

// Weight rows n0 .. n0 + rows - 1 (the rest zero) -> codes by pairs [nb, 16, kIntPanelRows]
// words, d and m [nb, kIntPanelRows] floats: each row's block paired, sixteen rows transposed.
template <int64_t Type, bool Grouped>
void codes_panel(const uint8_t* weights, int64_t n0, int64_t rows, int64_t nb, uint32_t* panel, float* d, float* m) {
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t half = 0; half < kIntPanelRows / 16; ++half) {
      __m512i words[16];
      for (int r = 0; r < 16; ++r) {
        const int64_t row = half * 16 + r;
        if (row >= rows) {
          words[r] = _mm512_setzero_si512();
          d[b * kIntPanelRows + row] = 0.0f;
          m[b * kIntPanelRows + row] = 0.0f;
          continue;
        }
        const BlockRef block = block_at<Type, Grouped>(weights, n0 + row, nb, b);
        words[r] = _mm512_permutexvar_epi16(pair_order(), block_codes<Type>(block.codes));
        d[b * kIntPanelRows + row] = block.d;
        m[b * kIntPanelRows + row] = block.m;
      }
      transpose16(words);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(panel + (b * 16 + p) * kIntPanelRows + half * 16, words[p]);
    }
  }
}

// The same panel from Q4 records in the grouped layout, by byte permutes (AVX-512 VBMI) instead of
// the transpose, as avx512_bf16_panel::dequantize_panel_groups: byte j of a row is pair j.
template <int64_t Type>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512vbmi,fma,f16c"))) void
codes_panel_groups(const uint8_t* weights, int64_t n0, int64_t rows, int64_t nb, uint32_t* panel, float* d, float* m) {
  static_assert(Type == Q4_0 || Type == Q4_1);
  constexpr int64_t kRecord = kGroupCodeBytes + (Type == Q4_1 ? 16 : 8);
  __m512i gather[4];
  for (int q = 0; q < 4; ++q) gather[q] = _mm512_load_si512(avx512_bf16_panel::kRegroupIndex.bytes[q]);
  const __mmask64 upper_rows = 0xFF00FF00FF00FF00ull;
  const __m512i low_nibble = _mm512_set1_epi32(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t half = 0; half < kIntPanelRows / 16; ++half) {
      const int64_t first = half * 16;
      __m512i codes[4];
      uint64_t d_bits[4] = {0, 0, 0, 0}, m_bits[4] = {0, 0, 0, 0};
      for (int g = 0; g < 4; ++g) {
        if (first + 4 * g >= rows) {  // rows come in whole groups of four
          codes[g] = _mm512_setzero_si512();
          continue;
        }
        const uint8_t* record = weights + (((n0 + first) / kGroupRows + g) * nb + b) * kRecord;
        codes[g] = _mm512_loadu_si512(record);
        std::memcpy(&d_bits[g], record + kGroupCodeBytes, 8);
        if constexpr (Type == Q4_1) std::memcpy(&m_bits[g], record + kGroupCodeBytes + 8, 8);
      }
      _mm512_storeu_ps(d + b * kIntPanelRows + first,
                       _mm512_cvtph_ps(_mm256_set_epi64x(d_bits[3], d_bits[2], d_bits[1], d_bits[0])));
      _mm512_storeu_ps(m + b * kIntPanelRows + first,
                       _mm512_cvtph_ps(_mm256_set_epi64x(m_bits[3], m_bits[2], m_bits[1], m_bits[0])));
      for (int q = 0; q < 4; ++q) {
        const __m512i bytes = _mm512_mask_blend_epi8(upper_rows, _mm512_permutex2var_epi8(codes[0], gather[q], codes[1]),
                                                     _mm512_permutex2var_epi8(codes[2], gather[q], codes[3]));
        for (int jj = 0; jj < 4; ++jj) {
          __m128i lane;
          switch (jj) {  // the lane index must be a constant
            case 0: lane = _mm512_extracti32x4_epi32(bytes, 0); break;
            case 1: lane = _mm512_extracti32x4_epi32(bytes, 1); break;
            case 2: lane = _mm512_extracti32x4_epi32(bytes, 2); break;
            default: lane = _mm512_extracti32x4_epi32(bytes, 3); break;
          }
          const __m512i both = _mm512_cvtepu8_epi32(lane);
          // low nibble (element j) in the low 16 bits, high nibble (element j + 16) in the high
          __m512i pair = _mm512_or_si512(_mm512_and_si512(both, low_nibble), _mm512_slli_epi32(_mm512_srli_epi32(both, 4), 16));
          if constexpr (Type == Q4_0) pair = _mm512_sub_epi16(pair, _mm512_set1_epi16(8));
          _mm512_storeu_si512(panel + (b * 16 + 4 * q + jj) * kIntPanelRows + first, pair);
        }
      }
    }
  }
}

template <int64_t Type, bool Grouped>
void any_codes_panel(const uint8_t* weights, int64_t n0, int64_t rows, int64_t nb, uint32_t* panel, float* d, float* m) {
  if constexpr (Grouped) {
    if (cpu_has_avx512_vbmi()) return codes_panel_groups<Type>(weights, n0, rows, nb, panel, d, m);
  }
  codes_panel<Type, Grouped>(weights, n0, rows, nb, panel, d, m);
}

// acc + the pairwise products of a and b (vpdpwssd), the accumulator tied to the result: GCC 12
// compiles the intrinsic with two register copies around each instruction.
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
#ifdef SIMDE_VERSION  // scripts/avx512_emulated.sh: SIMDe's lanes, no register to tie
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#endif
}

// y[i, 0 .. 31] for the first TM rows of x's tile `tile` against one panel; columns >= `rows` are
// not stored. A block's sixteen pairs are unrolled into 2 x TM integer sums; the float chains
// then take one fma per block, in block order.
template <int TM, bool Min>
void panel_kernel(const PackedX& x, int64_t tile, const uint32_t* panel, const float* d, const float* m, int64_t rows,
                  float* y, int64_t ldy) {
  constexpr int64_t kT = kIntTileTokens;
  __m512 acc[TM][2];
  for (int i = 0; i < TM; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const uint32_t* xw = x.words.data() + tile * x.nb * 16 * kT;
  const float* xs = x.scale.data() + tile * x.nb * kT;
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint32_t* wb = panel + b * 16 * kIntPanelRows;
    const uint32_t* xb = xw + b * 16 * kT;
    __m512i sums[TM][2];
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      const __m512i w0 = _mm512_loadu_si512(wb + p * kIntPanelRows), w1 = _mm512_loadu_si512(wb + p * kIntPanelRows + 16);
#pragma GCC unroll 16
      for (int i = 0; i < TM; ++i) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int32_t>(xb[p * kT + i]));
        if (p == 0) {
          sums[i][0] = _mm512_madd_epi16(xv, w0);  // the same pairwise products, from zero
          sums[i][1] = _mm512_madd_epi16(xv, w1);
        } else {
          sums[i][0] = dpwssd(sums[i][0], xv, w0);
          sums[i][1] = dpwssd(sums[i][1], xv, w1);
        }
      }
    }
    const __m512 d0 = _mm512_loadu_ps(d + b * kIntPanelRows), d1 = _mm512_loadu_ps(d + b * kIntPanelRows + 16);
    for (int i = 0; i < TM; ++i) {
      const __m512 dx = _mm512_set1_ps(xs[b * kT + i]);
      acc[i][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums[i][0]), d0), dx, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums[i][1]), d1), dx, acc[i][1]);
    }
  }
  __m512 min_acc[TM][2];  // Q4_1's minimum: its chains after the products' (independent), fewer live registers
  for (int i = 0; i < TM; ++i) min_acc[i][0] = min_acc[i][1] = _mm512_setzero_ps();
  if constexpr (Min) {
    const float* xss = x.scaled_sum.data() + tile * x.nb * kT;
    for (int64_t b = 0; b < x.nb; ++b) {
      const __m512 m0 = _mm512_loadu_ps(m + b * kIntPanelRows), m1 = _mm512_loadu_ps(m + b * kIntPanelRows + 16);
      for (int i = 0; i < TM; ++i) {
        const __m512 sx = _mm512_set1_ps(xss[b * kT + i]);
        min_acc[i][0] = _mm512_fmadd_ps(m0, sx, min_acc[i][0]);
        min_acc[i][1] = _mm512_fmadd_ps(m1, sx, min_acc[i][1]);
      }
    }
  }
  for (int j = 0; j < 2; ++j) {
    const int64_t valid = std::clamp<int64_t>(rows - 16 * j, 0, 16);
    const __mmask16 mask = valid == 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    for (int i = 0; i < TM; ++i) {
      const __m512 out = Min ? _mm512_add_ps(acc[i][j], min_acc[i][j]) : acc[i][j];
      _mm512_mask_storeu_ps(y + i * ldy + 16 * j, mask, out);
    }
  }
}

template <int TM, bool Min>
void tile_rest(const PackedX& x, int64_t tile, const uint32_t* panel, const float* d, const float* m, int64_t rows,
               float* y, int64_t ldy, int64_t tm) {
  if constexpr (TM > 0) {
    if (tm == TM) return panel_kernel<TM, Min>(x, tile, panel, d, m, rows, y, ldy);
    tile_rest<TM - 1, Min>(x, tile, panel, d, m, rows, y, ldy, tm);
  }
}

// All T rows of x against one panel, a tile of kIntTileTokens rows at a time.
template <bool Min>
void tokens_times_panel(const PackedX& x, int64_t num_tokens, const uint32_t* panel, const float* d, const float* m,
                        int64_t rows, float* y, int64_t ldy) {
  constexpr int kTile = kIntTileTokens;
  int64_t t = 0;
  for (; t + kTile <= num_tokens; t += kTile) panel_kernel<kTile, Min>(x, t / kTile, panel, d, m, rows, y + t * ldy, ldy);
  if (t < num_tokens) tile_rest<kTile - 1, Min>(x, t / kTile, panel, d, m, rows, y + t * ldy, ldy, num_tokens - t);
}

template <int64_t Type, bool Grouped>
void gguf_linear_int16(const float* x, int64_t num_tokens, const uint8_t* blocks, int64_t n, int64_t k, float* y) {
  const PackedX packed = pack_x(x, num_tokens, k);
  const int64_t nb = k / kGroup;
  const int64_t num_panels = (n + kIntPanelRows - 1) / kIntPanelRows;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> panel(nb * 16 * kIntPanelRows);
    std::vector<float> d(nb * kIntPanelRows), m(nb * kIntPanelRows);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kIntPanelRows;
      const int64_t rows = std::min(kIntPanelRows, n - n0);
      any_codes_panel<Type, Grouped>(blocks, n0, rows, nb, panel.data(), d.data(), m.data());
      tokens_times_panel<Type == Q4_1>(packed, num_tokens, panel.data(), d.data(), m.data(), rows, y + n0, n);
    }
  });
}

}  // namespace
}  // namespace avx512_int16_panel
#pragma GCC pop_options

namespace {

template <int64_t Type, bool Grouped>
void gguf_linear_panels(const float* x, int64_t num_tokens, const uint8_t* blocks, int64_t n, int64_t k, float* y,
                        bool avx512) {
  const int64_t num_blocks = k / kGroup;
  const int64_t num_panels = (n + kPanelRows - 1) / kPanelRows;
  std::vector<float> pairs;
  if (avx512) {
    pairs.resize(num_tokens / 2 * 2 * k);
    for (int64_t i = 0; i < num_tokens / 2; ++i)
      avx512_panel::pack_pair(x + 2 * i * k, x + (2 * i + 1) * k, k, pairs.data() + i * 2 * k);
  }
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kPanelRows * k);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanelRows;
      const int64_t rows = std::min(kPanelRows, n - n0);
      for (int64_t r = 0; r < rows; ++r)
        avx512 ? avx512_panel::dequantize_row16<Type, Grouped>(blocks, n0 + r, num_blocks, panel.data() + r * k)
               : dequantize_row<Type, Grouped>(blocks, n0 + r, num_blocks, panel.data() + r * k);
      if (avx512)
        avx512_panel::tokens_times_panel(x, pairs.data(), num_tokens, panel.data(), k, rows, y + n0, n);
      else
        tokens_times_panel(x, num_tokens, panel.data(), k, rows, y + n0, n);
    }
  });
}

}  // namespace

namespace avx2 {
namespace {
#define NANOSERVE_AVX512 0
#include "gguf_linear_tile.h"
#undef NANOSERVE_AVX512
}  // namespace
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")
namespace avx512 {
namespace {
#define NANOSERVE_AVX512 1
#include "gguf_linear_tile.h"
#undef NANOSERVE_AVX512
}  // namespace
}  // namespace avx512
#pragma GCC pop_options

namespace {

int64_t best_isa() { return cpu_has_avx512() ? kAvx512 : kAvx2; }

// The Q4 weights of a GGUF tensor [N, K / 32 * block bytes] in the grouped layout [N / 4, K / 32 * record bytes].
at::Tensor gguf_group_rows(const at::Tensor& blocks, int64_t quant_type, int64_t in_features) {
  TORCH_CHECK(quant_type == Q4_0 || quant_type == Q4_1, "gguf_group_rows: Q4_0 or Q4_1 only, got type id ", quant_type);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2,
              "gguf_group_rows: blocks must be 2-D uint8 on the CPU");
  TORCH_CHECK(in_features % kGroup == 0, "gguf_group_rows: in_features must be a multiple of 32");
  const int64_t n = blocks.size(0), nb = in_features / kGroup, bytes = block_bytes(quant_type);
  TORCH_CHECK(blocks.size(1) == nb * bytes, "gguf_group_rows: blocks of ", blocks.size(1),
              " bytes per row do not hold ", in_features, " weights");
  TORCH_CHECK(n % kGroupRows == 0, "gguf_group_rows: rows must be a multiple of 4, got ", n);
  const int64_t header = quant_type == Q4_1 ? 4 : 2, record = grouped_bytes(quant_type);
  const at::Tensor bc = blocks.contiguous();
  at::Tensor out = at::empty({n / kGroupRows, nb * record}, blocks.options());
  const uint8_t* src = bc.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kGroupRows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* rec = dst + (g * nb + b) * record;
        for (int64_t r = 0; r < kGroupRows; ++r) {
          const uint8_t* block = src + ((g * kGroupRows + r) * nb + b) * bytes;
          std::memcpy(rec + 16 * r, block + header, 16);
          std::memcpy(rec + kGroupCodeBytes + 2 * r, block, 2);                              // d
          if (quant_type == Q4_1) std::memcpy(rec + kGroupCodeBytes + 8 + 2 * r, block + 2, 2);  // m
        }
      }
  });
  return out;
}

template <int64_t Type, bool Grouped, class X>
void bf16_panels_of(const X* x, int64_t num_tokens, const uint8_t* blocks, int64_t n, int64_t k, float* y, bool amx) {
  namespace bf16 = avx512_bf16_panel;
  amx ? bf16::gguf_linear_amx<Type, Grouped>(x, num_tokens, blocks, n, k, y)
      : bf16::gguf_linear_panels<Type, Grouped>(x, num_tokens, blocks, n, k, y);
}

template <class X>
void bf16_panels(const X* x, int64_t num_tokens, const uint8_t* blocks, int64_t quant_type, int64_t layout, int64_t n,
                 int64_t k, float* y, bool amx) {
  const bool grouped = layout == kGroups;
  switch (quant_type) {
    case Q4_0:
      grouped ? bf16_panels_of<Q4_0, true>(x, num_tokens, blocks, n, k, y, amx)
              : bf16_panels_of<Q4_0, false>(x, num_tokens, blocks, n, k, y, amx);
      break;
    case Q4_1:
      grouped ? bf16_panels_of<Q4_1, true>(x, num_tokens, blocks, n, k, y, amx)
              : bf16_panels_of<Q4_1, false>(x, num_tokens, blocks, n, k, y, amx);
      break;
    default: bf16_panels_of<Q8_0, false>(x, num_tokens, blocks, n, k, y, amx); break;
  }
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t quant_type, int64_t in_features,
                       int64_t isa, int64_t layout) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "gguf_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gguf_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, "gguf_linear: blocks must be 2-D uint8");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features, "gguf_linear: x must be [T, ", in_features, "]");
  TORCH_CHECK(in_features % kGroup == 0, "gguf_linear: in_features must be a multiple of 32");
  TORCH_CHECK(isa >= kBest && isa <= kInt16Avx2,
              "gguf_linear: isa must be 0 (best), 1 (avx2), 2 (avx512), 3 (avx512_bf16), 4 (amx_bf16), 5 (int16) or ",
              "6 (int16_avx2), got ", isa);
  TORCH_CHECK(isa != kAvx512 || cpu_has_avx512(),
              "gguf_linear: isa avx512 asked for on a CPU without AVX-512 F/BW/DQ/VL");
  TORCH_CHECK(isa != kAvx512Bf16 || cpu_has_avx512_bf16(),
              "gguf_linear: isa avx512_bf16 asked for on a CPU without AVX-512 BF16");
  TORCH_CHECK(isa != kAmxBf16 || cpu_has_amx_bf16(), "gguf_linear: isa amx_bf16 asked for on a CPU without AMX BF16 ",
              "tiles, or where Linux refused their state");
  TORCH_CHECK(layout == kRows || layout == kGroups, "gguf_linear: layout must be 0 (rows) or 1 (groups), got ", layout);
  const int64_t nb = in_features / kGroup;
  int64_t n = blocks.size(0);
  if (layout == kGroups) {
    TORCH_CHECK(quant_type == Q4_0 || quant_type == Q4_1, "gguf_linear: the grouped layout holds Q4_0 or Q4_1 only");
    TORCH_CHECK(blocks.size(1) == nb * grouped_bytes(quant_type), "gguf_linear: grouped records of ",
                blocks.size(1), " bytes per group do not hold ", in_features, " weights");
    n *= kGroupRows;
  } else {
    TORCH_CHECK(blocks.size(1) == nb * block_bytes(quant_type), "gguf_linear: blocks of ", blocks.size(1),
                " bytes per row do not hold ", in_features, " weights");
  }
  const int64_t num_tokens = x.size(0);
  const int64_t chosen = isa == kBest ? best_isa() : isa;
  const at::Tensor bc = blocks.contiguous();
  at::Tensor y = at::empty({num_tokens, n}, x.options().dtype(at::kFloat));
  if (num_tokens == 0 || n == 0) return y;
  const uint8_t* bp = bc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const bool int16 = chosen == kInt16 || chosen == kInt16Avx2;
  const bool avx512 = int16 ? chosen == kInt16 && cpu_has_avx512() : chosen != kAvx2;
  if (num_tokens > kFewMaxTokens && (chosen == kAvx512Bf16 || chosen == kAmxBf16)) {
    const bool amx = chosen == kAmxBf16;
    // float32 x is rounded to bf16 (to nearest even, as torch casts) as it is packed
    const at::Tensor xc = x.contiguous();
    if (x.scalar_type() == at::kBFloat16)
      bf16_panels(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), num_tokens, bp, quant_type, layout,
                  n, in_features, yp, amx);
    else
      bf16_panels(xc.data_ptr<float>(), num_tokens, bp, quant_type, layout, n, in_features, yp, amx);
    return y;
  }
  const at::Tensor xc = x.to(at::kFloat).contiguous();  // bf16 widened exactly
  const float* xp = xc.data_ptr<float>();
  if (num_tokens > kFewMaxTokens && chosen == kInt16 && cpu_has_avx512_vnni()) {
    namespace int16_panel = avx512_int16_panel;
    const bool grouped = layout == kGroups;
    switch (quant_type) {
      case Q4_0:
        grouped ? int16_panel::gguf_linear_int16<Q4_0, true>(xp, num_tokens, bp, n, in_features, yp)
                : int16_panel::gguf_linear_int16<Q4_0, false>(xp, num_tokens, bp, n, in_features, yp);
        break;
      case Q4_1:
        grouped ? int16_panel::gguf_linear_int16<Q4_1, true>(xp, num_tokens, bp, n, in_features, yp)
                : int16_panel::gguf_linear_int16<Q4_1, false>(xp, num_tokens, bp, n, in_features, yp);
        break;
      default: int16_panel::gguf_linear_int16<Q8_0, false>(xp, num_tokens, bp, n, in_features, yp); break;
    }
    return y;
  }
  if (num_tokens > kFewMaxTokens && !int16) {
    const bool grouped = layout == kGroups;
    switch (quant_type) {
      case Q4_0:
        grouped ? gguf_linear_panels<Q4_0, true>(xp, num_tokens, bp, n, in_features, yp, avx512)
                : gguf_linear_panels<Q4_0, false>(xp, num_tokens, bp, n, in_features, yp, avx512);
        break;
      case Q4_1:
        grouped ? gguf_linear_panels<Q4_1, true>(xp, num_tokens, bp, n, in_features, yp, avx512)
                : gguf_linear_panels<Q4_1, false>(xp, num_tokens, bp, n, in_features, yp, avx512);
        break;
      default: gguf_linear_panels<Q8_0, false>(xp, num_tokens, bp, n, in_features, yp, avx512); break;
    }
    return y;
  }
  std::vector<int16_t> codes(num_tokens * in_features);
  std::vector<float> scale(num_tokens * nb), scaled_sum(num_tokens * nb);
  for (int64_t t = 0; t < num_tokens; ++t)
    quantize_row(xp + t * in_features, nb, codes.data() + t * in_features, scale.data() + t * nb,
                 scaled_sum.data() + t * nb);
  // One row too: the AVX-512 tiles (sixteen weight rows, a tree of folds), once their blocks' scales
  // came from the by-block table, measured faster than the AVX2 ones (four rows, horizontal adds) on
  // Zen 4: 2.8-3.0 against 3.5-4.4 ms for the default model's layers, 1.0 against 0.9 for its lm_head
  // (bench.gguf_linear --tokens 1 --repeats 10, 3 rounds, a shared machine); the same bits.
  const bool tiles_avx512 = avx512;
  // the AVX-512 tiles take 8 rows a call (each weight block read once), the AVX2 ones 4
  const int64_t per_call = tiles_avx512 ? 8 : 4;
  std::vector<float> scale_by_block(nb * kActLanes), scaled_sum_by_block(nb * kActLanes);
  for (int64_t t = 0; t < num_tokens; t += per_call) {  // more rows (int16 without the panels): 8 or 4 at a time
    const int64_t tokens = std::min(per_call, num_tokens - t);
    std::fill(scale_by_block.begin(), scale_by_block.end(), 0.0f);
    std::fill(scaled_sum_by_block.begin(), scaled_sum_by_block.end(), 0.0f);
    for (int64_t i = 0; i < tokens; ++i)
      for (int64_t b = 0; b < nb; ++b) {
        scale_by_block[b * kActLanes + i] = scale[(t + i) * nb + b];
        scaled_sum_by_block[b * kActLanes + i] = scaled_sum[(t + i) * nb + b];
      }
    const ActBlocks acts{codes.data() + t * in_features, scale.data() + t * nb, scaled_sum.data() + t * nb,
                         in_features, nb, scale_by_block.data(), scaled_sum_by_block.data()};
    if (tiles_avx512)
      avx512::gguf_linear_dispatch(acts, tokens, bp, quant_type, layout, n, yp + t * n);
    else
      avx2::gguf_linear_dispatch(acts, tokens, bp, quant_type, layout, n, yp + t * n);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(nanoserve, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int quant_type, int in_features, int isa=0, int layout=0) -> Tensor");
  m.def("gguf_group_rows(Tensor blocks, int quant_type, int in_features) -> Tensor");
  m.def("gguf_linear_best_isa() -> int", &best_isa);
  m.def("gguf_linear_has_bf16_dot() -> bool", [] { return cpu_has_avx512_bf16(); });
  m.def("gguf_linear_has_amx_bf16() -> bool", [] { return cpu_has_amx_bf16(); });
  m.def("gguf_linear_has_int16_panels() -> bool", [] { return cpu_has_avx512_vnni(); });
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_group_rows", &gguf_group_rows);
}
