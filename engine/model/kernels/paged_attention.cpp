// Decode attention over the paged KV cache, for the CPU: an AVX2 + FMA body and an AVX-512 one,
// chosen at run time (isa 0 = best, 1 = avx2, 2 = avx512).
//
// One query token per sequence. q: [B, H, D] float32; key_cache, value_cache: [num_blocks,
// block_size, Hkv, D], float32, float16 or bfloat16 (both alike; a 16-bit element is widened to
// float32 as it is loaded, exactly, so the result is the float32 one on the cache's values and
// only half the bytes are read); block_tables: [B, max_blocks] int32 (logical block -> physical
// block); context_lens: [B] int32 (keys per sequence, the new token's included, already
// written through the slot mapping). Returns [B, H * D]. D a multiple of 8; fast paths
// (D known at compile time) for D = 64 and 128.
//
// The G = H / Hkv query heads of a group share their KV head (grouped-query attention).
// Per (sequence, KV head), the unit of parallel work, the whole group at once (up to 4
// heads per pass with AVX-512, 3 with AVX2; a larger group takes several passes):
//   0. fetch_lines: one load per cache line of the sequence's K and V rows (every KV head's,
//      at the sequence's first item in a worker), nothing computed, so that many misses are in
//      flight at once; the passes below then read L1/L2 (measured: about 2x faster at batch 64
//      with the K/V cold, about 20% slower with them hot);
//   1. scores s_h,t = (scale q_h) . k_t: each key row loaded once and dotted with every
//      query of the pass, four keys at a time, read block by block through the table (no
//      gather of whole blocks, no padding to the longest context, no mask);
//   2. p_h,t = exp(s_h,t - max_t s_h,t) by a vectorized exp (exp_nonpositive, below), the
//      score rows padded with -inf to 16 so that every loop is whole vectors;
//   3. out_h = sum_t p_h,t v_t / sum_t p_h,t: each value row loaded once and accumulated
//      into every head's output, the outputs held in registers (pieces of 64 floats with
//      AVX-512, 32 with AVX2).
// Each body defines its vector primitives (score_tile, softmax_row, values_of); the passes
// around them (scores_of, attend_heads, attend) are paged_attention_body.h, included in both.
// The two bodies sum in different orders (their bits may differ), both within float32
// rounding of softmax(q k^T scale) v. Attention follows Vaswani et al. 2017; the paged
// layout follows vLLM (Kwon et al. 2023).
//
// exp: x = n ln2 + r, n = round(x / ln2), |r| <= ln2 / 2 (ln2 in two parts, the second
// correcting the first); exp(r) = 1 + r (c1 + c2 r + ... + c6 r^5), a polynomial fitted
// for this file (weighted least squares iterated towards minimax on the relative error:
// 2e-9 in exact arithmetic); then times 2^n. Measured against float64 exp over [-87.3, 0]
// (1M points): at most 8.5e-8 relative (under an ulp) in both bodies. exp(0) = 1 exactly;
// results below 2^-126 (x < -87.34, subnormal) are returned as 0: a softmax weight under
// 1e-38 against the maximum's 1.
#include <immintrin.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "kv_cache_types.h"

namespace {

constexpr int64_t kBest = 0, kAvx2 = 1, kAvx512 = 2;  // the op's isa argument
constexpr int64_t kRowPad = 16;   // score rows (and AVX-512 query rows) padded to a multiple of this
constexpr int kTileKeys = 4;      // keys per score tile
constexpr int64_t kLineBytes = 64;  // a cache line

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f;           // ln2's first 16 bits
constexpr float kLn2Lo = 1.42860682028622e-06f;        // ln2 - kLn2Hi
constexpr float kExpMin = -87.33654475055310898657f;  // ln(2^-126): below it exp is subnormal, returned as 0
// exp(r) = 1 + r (kExpC[0] + r (kExpC[1] + ... )), |r| <= ln2 / 2
constexpr float kExpC[6] = {1.0f, 0.4999999403953552f, 0.16666431725025177f,
                            0.04166800156235695f, 0.00837415549904108f, 0.0013843652559444308f};

constexpr int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Where one (sequence, KV head)'s keys and values lie, and what to compute. KV: the cache's
// element type (float, at::Half or at::BFloat16); strides count elements.
template <typename KV>
struct WorkItem {
  const KV* keys;           // key_cache + kv_head * D: add block id * block_stride + offset * token_stride
  const KV* values;         // the same in value_cache
  const int32_t* table;     // the sequence's block table
  int64_t context_len, block_size, token_stride, block_stride;
  const float* queries;     // q of the group's first head: [G, D]
  float* out;               // out of the group's first head: [G, D]
  int64_t group, head_dim;
  float scale;
};

// 16 bytes at p folded into `kept`: the line is loaded (p starts a line of a row of at least 8 elements).
template <typename KV>
inline __m128i touch(__m128i kept, const KV* p) {
  return _mm_max_epu8(kept, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Loads one vector from every cache line of the item's keys and values, doing nothing with them
// but keeping them: a few instructions per line, so the out-of-order window holds many misses
// at once, where the score pass (about 30 instructions per key row) holds few. With the K/V
// cold (a model's other layers ran since), this first pass makes a batch-64 call about 2x
// faster on Zen 5; prefetch instructions (1 or 2 blocks ahead) gained nothing, and 16-lane
// masked loads here lost the gain. The op calls it once per sequence and worker, over the
// whole token rows from the worker's first KV head of the sequence on (w.head_dim set to the
// rest of the row): each block is then one contiguous sweep, and the other KV heads' items
// find their rows in L2 (batch 64, 2 threads, K/V cold: 10-30% faster per call at 64-256
// keys, 6-9% at 512-1024, against one sweep per item over its own head's 256-byte pieces).
template <typename KV>
void fetch_lines(const WorkItem<KV>& w) {
  constexpr int64_t kLine = kLineBytes / sizeof(KV);  // elements per cache line
  __m128i kept_keys = _mm_setzero_si128(), kept_values = _mm_setzero_si128();
  for (int64_t blk = 0, t0 = 0; t0 < w.context_len; ++blk, t0 += w.block_size) {
    const KV* keys = w.keys + w.table[blk] * w.block_stride;
    const KV* values = w.values + w.table[blk] * w.block_stride;
    const int64_t n = std::min(w.block_size, w.context_len - t0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t f = 0; f < w.head_dim; f += kLine) {
        kept_keys = touch(kept_keys, keys + i * w.token_stride + f);
        kept_values = touch(kept_values, values + i * w.token_stride + f);
      }
  }
  asm volatile("" : : "x"(kept_keys), "x"(kept_values));  // the loads stay
}

// The query heads of one pass: [first, first + count) of the group.
struct HeadRange {
  int64_t first, count;
};

// G heads in passes of at most max_heads, as even as they come (7 over 4 -> 4 + 3, 4 over 3 -> 2 + 2).
std::vector<HeadRange> head_passes(int64_t group, int64_t max_heads) {
  const int64_t passes = (group + max_heads - 1) / max_heads;
  std::vector<HeadRange> out;
  for (int64_t i = 0, first = 0; i < passes; ++i) {
    const int64_t count = group / passes + (i < group % passes ? 1 : 0);
    out.push_back({first, count});
    first += count;
  }
  return out;
}

}  // namespace

namespace avx2_body {
namespace {

constexpr int kMaxHeads = 3;  // 3 x 4 score accumulators + a key: 13 of 16 registers
constexpr int64_t kPiece = 32;  // output floats per value pass: 4 vectors x 3 heads in registers
constexpr int64_t kQueryPad = 8;  // head_dim is a multiple of 8: no padding

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The lane sums of a[0..3] as one vector [sum a0, sum a1, sum a2, sum a3].
inline __m128 sum4x8(const __m256 a[4]) {
  const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
  const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
  const __m256 lo = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(s01), _mm256_castps_pd(s23)));
  const __m256 hi = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(s01), _mm256_castps_pd(s23)));
  const __m256 s = _mm256_add_ps(lo, hi);  // per 128-bit half: [a0, a1, a2, a3] partial
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// exp(x) for x <= 0 (-inf included), 8 lanes; see the file's comment.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpC[5]);
  for (int i = 4; i >= 0; --i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC[i]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n, n in -126..0: (n + 127) in the exponent field
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// Eight cache elements as floats (exact: a half or a bfloat16 widens without rounding).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::BFloat16* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}

// s[h * s_stride + j] = q_h . k_j for kHeads queries (rows dq apart) and kKeys keys (rows `stride` apart).
// kD: head_dim when known at compile time, else 0 and d at run time.
template <int kD, int kHeads, int kKeys, typename KV>
inline void score_tile(const float* q, int64_t dq, int64_t d, const KV* key, int64_t stride, float* s,
                       int64_t s_stride) {
  const int64_t dim = kD ? kD : d;
  __m256 acc[kHeads][kKeys];
  for (int h = 0; h < kHeads; ++h)
    for (int j = 0; j < kKeys; ++j) acc[h][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; i += 8)
    for (int j = 0; j < kKeys; ++j) {
      const __m256 k = load8(key + j * stride + i);
      for (int h = 0; h < kHeads; ++h) acc[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dq + i), k, acc[h][j]);
    }
  for (int h = 0; h < kHeads; ++h) {
    if constexpr (kKeys == 4) {
      _mm_storeu_ps(s + h * s_stride, sum4x8(acc[h]));
    } else {
      for (int j = 0; j < kKeys; ++j) s[h * s_stride + j] = sum8(acc[h][j]);
    }
  }
}

// s[0..lp) <- exp(s - max s) (the tail past the context is -inf, so 0); returns their sum.
float softmax_row(float* s, int64_t lp) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < lp; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
  const __m256 max_score = _mm256_set1_ps(max8(m));
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < lp; t += 8) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), max_score));
    _mm256_storeu_ps(s + t, p);
    total = _mm256_add_ps(total, p);
  }
  return sum8(total);
}

// o_h[col, col + 8 kVecs) = inv_h sum_t p_h,t v_t[...] for kHeads heads (p rows lp apart, o rows d apart).
template <int kHeads, int kVecs, typename KV>
void values_piece(const WorkItem<KV>& w, const float* p, int64_t lp, int64_t col, const float* inv, float* o) {
  __m256 acc[kHeads][kVecs];
  for (int h = 0; h < kHeads; ++h)
    for (int u = 0; u < kVecs; ++u) acc[h][u] = _mm256_setzero_ps();
  for (int64_t blk = 0, t0 = 0; t0 < w.context_len; ++blk, t0 += w.block_size) {
    const KV* base = w.values + w.table[blk] * w.block_stride + col;
    const int64_t n = std::min(w.block_size, w.context_len - t0);
    for (int64_t i = 0; i < n; ++i) {
      const KV* row = base + i * w.token_stride;
      for (int h = 0; h < kHeads; ++h) {
        const __m256 ph = _mm256_broadcast_ss(p + h * lp + t0 + i);
        for (int u = 0; u < kVecs; ++u) acc[h][u] = _mm256_fmadd_ps(ph, load8(row + 8 * u), acc[h][u]);
      }
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int u = 0; u < kVecs; ++u)
      _mm256_storeu_ps(o + h * w.head_dim + col + 8 * u, _mm256_mul_ps(acc[h][u], _mm256_set1_ps(inv[h])));
}

// o_h = inv_h sum_t p_h,t v_t for kHeads heads, kPiece output floats per pass.
template <int kHeads, typename KV>
void values_of(const WorkItem<KV>& w, const float* p, int64_t lp, const float* inv, float* o) {
  for (int64_t col = 0; col < w.head_dim; col += kPiece) {
    switch (std::min<int64_t>(kPiece, w.head_dim - col) / 8) {
      case 1: values_piece<kHeads, 1>(w, p, lp, col, inv, o); break;
      case 2: values_piece<kHeads, 2>(w, p, lp, col, inv, o); break;
      case 3: values_piece<kHeads, 3>(w, p, lp, col, inv, o); break;
      default: values_piece<kHeads, 4>(w, p, lp, col, inv, o); break;
    }
  }
}

#include "paged_attention_body.h"

}  // namespace
}  // namespace avx2_body

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")
namespace avx512_body {
namespace {

constexpr int kMaxHeads = 4;    // 4 x 4 score accumulators + 4 keys + 4 query vectors: 24 of 32 registers
constexpr int64_t kPiece = 64;  // output floats per value pass: 4 vectors x 4 heads in registers
constexpr int64_t kQueryPad = kRowPad;  // query rows zero-padded to whole 16-lane vectors

// The lane sums of a[0..3] as one vector [sum a0, sum a1, sum a2, sum a3].
inline __m128 sum4x16(const __m512 a[4]) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23)));
  const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23)));
  const __m512 s = _mm512_add_ps(lo, hi);  // per 128-bit quarter: [a0, a1, a2, a3] partial
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// exp(x) for x <= 0 (-inf included), 16 lanes; see the file's comment.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpC[5]);
  for (int i = 4; i >= 0; --i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC[i]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);  // p 2^n
}

// Sixteen cache elements as floats (exact), those outside `m` zero.
inline __m512 load16(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(__mmask16 m, const at::Half* p) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 load16(__mmask16 m, const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::BFloat16* p) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

// s[h * s_stride + j] = q_h . k_j for kHeads queries (rows dq apart, zero-padded to 16) and kKeys keys
// (rows `stride` apart). kD: head_dim when known at compile time, else 0 and d at run time (the last
// vector of a key then masked to d mod 16 where that is 8).
template <int kD, int kHeads, int kKeys, typename KV>
inline void score_tile(const float* q, int64_t dq, int64_t d, const KV* key, int64_t stride, float* s,
                       int64_t s_stride) {
  const int64_t dim = kD ? kD : d;
  __m512 acc[kHeads][kKeys];
  for (int h = 0; h < kHeads; ++h)
    for (int j = 0; j < kKeys; ++j) acc[h][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = (kD || i + 16 <= dim) ? 0xFFFF : 0x00FF;
    for (int j = 0; j < kKeys; ++j) {
      const __m512 k = kD ? load16(key + j * stride + i) : load16(m, key + j * stride + i);
      for (int h = 0; h < kHeads; ++h) acc[h][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * dq + i), k, acc[h][j]);
    }
  }
  for (int h = 0; h < kHeads; ++h) {
    if constexpr (kKeys == 4) {
      _mm_storeu_ps(s + h * s_stride, sum4x16(acc[h]));
    } else {
      for (int j = 0; j < kKeys; ++j) s[h * s_stride + j] = _mm512_reduce_add_ps(acc[h][j]);
    }
  }
}

// s[0..lp) <- exp(s - max s) (the tail past the context is -inf, so 0); returns their sum.
float softmax_row(float* s, int64_t lp) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < lp; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < lp; t += 16) {
    const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), max_score));
    _mm512_storeu_ps(s + t, p);
    total = _mm512_add_ps(total, p);
  }
  return _mm512_reduce_add_ps(total);
}

// o_h[col, col + 16 kVecs) = inv_h sum_t p_h,t v_t[...] for kHeads heads (p rows lp apart, o rows d
// apart); the last vector masked by `last` (d mod 16 = 8).
template <int kHeads, int kVecs, typename KV>
void values_piece(const WorkItem<KV>& w, const float* p, int64_t lp, int64_t col, __mmask16 last, const float* inv,
                  float* o) {
  __m512 acc[kHeads][kVecs];
  for (int h = 0; h < kHeads; ++h)
    for (int u = 0; u < kVecs; ++u) acc[h][u] = _mm512_setzero_ps();
  for (int64_t blk = 0, t0 = 0; t0 < w.context_len; ++blk, t0 += w.block_size) {
    const KV* base = w.values + w.table[blk] * w.block_stride + col;
    const int64_t n = std::min(w.block_size, w.context_len - t0);
    for (int64_t i = 0; i < n; ++i) {
      const KV* row = base + i * w.token_stride;
      __m512 v[kVecs];
      for (int u = 0; u < kVecs; ++u)
        v[u] = load16(u + 1 < kVecs ? __mmask16(0xFFFF) : last, row + 16 * u);
      for (int h = 0; h < kHeads; ++h) {
        const __m512 ph = _mm512_set1_ps(p[h * lp + t0 + i]);
        for (int u = 0; u < kVecs; ++u) acc[h][u] = _mm512_fmadd_ps(ph, v[u], acc[h][u]);
      }
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int u = 0; u < kVecs; ++u)
      _mm512_mask_storeu_ps(o + h * w.head_dim + col + 16 * u, u + 1 < kVecs ? __mmask16(0xFFFF) : last,
                            _mm512_mul_ps(acc[h][u], _mm512_set1_ps(inv[h])));
}

// o_h = inv_h sum_t p_h,t v_t for kHeads heads, kPiece output floats per pass.
template <int kHeads, typename KV>
void values_of(const WorkItem<KV>& w, const float* p, int64_t lp, const float* inv, float* o) {
  for (int64_t col = 0; col < w.head_dim; col += kPiece) {
    const int64_t width = std::min(kPiece, w.head_dim - col);  // a multiple of 8
    const __mmask16 last = width % 16 ? 0x00FF : 0xFFFF;
    switch ((width + 15) / 16) {
      case 1: values_piece<kHeads, 1>(w, p, lp, col, last, inv, o); break;
      case 2: values_piece<kHeads, 2>(w, p, lp, col, last, inv, o); break;
      case 3: values_piece<kHeads, 3>(w, p, lp, col, last, inv, o); break;
      default: values_piece<kHeads, 4>(w, p, lp, col, last, inv, o); break;
    }
  }
}

#include "paged_attention_body.h"

}  // namespace
}  // namespace avx512_body
#pragma GCC pop_options

namespace {

// Whether isa (0 best, 1 avx2, 2 avx512) means the AVX-512 body; raises on another value or
// avx512 on a CPU without it. `op` names the caller in the message.
bool use_avx512(int64_t isa, const char* op) {
  TORCH_CHECK(isa == kBest || isa == kAvx2 || isa == kAvx512, op,
              ": isa must be 0 (best), 1 (avx2) or 2 (avx512), got ", isa);
  TORCH_CHECK(isa != kAvx512 || cpu_has_avx512(), op, ": isa avx512 asked for on a CPU without AVX-512 F/BW/DQ/VL");
  return isa == kAvx512 || (isa == kBest && cpu_has_avx512());
}

// The op's work for a cache of element type KV: every (sequence, KV head) item, in parallel.
template <typename KV>
void attend_all(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const int32_t* tables,
                const int32_t* lens, int64_t max_blocks, float scale, bool avx512, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const float* q_ptr = q.data_ptr<float>();
  const KV* k_ptr = key_cache.data_ptr<KV>();
  const KV* v_ptr = value_cache.data_ptr<KV>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t token_stride = num_kv_heads * head_dim;  // elements between positions of one block
  const int64_t block_stride = block_size * token_stride;

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, kv_head = work % num_kv_heads;
      const int64_t first_head = b * num_heads + kv_head * group;
      const WorkItem<KV> item{k_ptr + kv_head * head_dim, v_ptr + kv_head * head_dim, tables + b * max_blocks,
                              lens[b], block_size, token_stride, block_stride, q_ptr + first_head * head_dim,
                              out_ptr + first_head * head_dim, group, head_dim, scale};
      if (kv_head == 0 || work == begin) {  // this and the sequence's later KV heads' rows, one sweep per block
        WorkItem<KV> rows = item;
        rows.head_dim = token_stride - kv_head * head_dim;
        fetch_lines(rows);
      }
      avx512 ? avx512_body::attend(item, buffer) : avx2_body::attend(item, buffer);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t isa) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode_attention: q must be float32");
  check_kv_cache_types(key_cache, value_cache, "paged_decode_attention");
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "paged_decode_attention: q [B, H, D], caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and context_lens must be int32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_decode_attention: contiguous caches");
  const bool avx512 = use_avx512(isa, "paged_decode_attention");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && head_dim % 8 == 0, "paged_decode_attention: head_dim ", head_dim,
              " must match the cache and be a multiple of 8");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_decode_attention: ", num_heads, " heads over ", num_kv_heads,
              " KV heads");
  TORCH_CHECK(block_tables.size(0) == num_seqs && context_lens.size(0) == num_seqs,
              "paged_decode_attention: one block table and one context length per sequence");
  const int64_t max_blocks = block_tables.size(1);
  at::Tensor qc = q.contiguous();
  at::Tensor tables = block_tables.contiguous();
  at::Tensor lens = context_lens.contiguous();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(len_ptr[b] >= 1 && len_ptr[b] <= max_blocks * block_size, "paged_decode_attention: context length ",
                len_ptr[b], " of sequence ", b, " outside 1..", max_blocks * block_size);
    for (int64_t i = 0; i < (len_ptr[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table_ptr[b * max_blocks + i] >= 0 && table_ptr[b * max_blocks + i] < num_blocks,
                  "paged_decode_attention: block id ", table_ptr[b * max_blocks + i], " outside the cache");
  }
  at::Tensor out = at::empty({num_seqs, num_heads * head_dim}, q.options());
  const float s = static_cast<float>(scale);
  dispatch_kv_cache_type(key_cache, [&](auto kv) {
    attend_all<decltype(kv)>(qc, key_cache, value_cache, table_ptr, len_ptr, max_blocks, s, avx512, out);
  });
  return out;
}

// exp(x) elementwise by the kernel's vectorized exp, for testing it: x float32, every value <= 0 (-inf too).
// It runs softmax_row on x with a 0 appended as the row's maximum, so each x is exponentiated as it is.
at::Tensor paged_attention_exp(const at::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "paged_attention_exp: float32 only");
  const bool avx512 = use_avx512(isa, "paged_attention_exp");
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t n = xc.numel();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(xp[i] <= 0.0f, "paged_attention_exp: x must be <= 0, got ", xp[i]);
  std::vector<float> row(round_up(n + 1, kRowPad), -std::numeric_limits<float>::infinity());
  std::copy(xp, xp + n, row.begin());
  row[n] = 0.0f;
  const int64_t lp = static_cast<int64_t>(row.size());
  avx512 ? avx512_body::softmax_row(row.data(), lp) : avx2_body::softmax_row(row.data(), lp);
  at::Tensor out = at::empty_like(xc);
  std::copy(row.begin(), row.begin() + n, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int isa=0) -> Tensor");
  m.def("paged_attention_exp(Tensor x, int isa=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_attention_exp", &paged_attention_exp);
}
