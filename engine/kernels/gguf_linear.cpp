// y = x @ w.T with w kept in GGUF blocks (Q4_0, Q4_1, Q8_0), for the CPU with AVX2, FMA and F16C.
//
// Block layouts (ggml's block_q4_0 / block_q4_1 / block_q8_0, 32 weights each, along a row):
//   Q4_0: d fp16 | 16 bytes of nibbles            w = d * (q - 8)
//   Q4_1: d fp16 | m fp16 | 16 bytes of nibbles   w = d * q + m
//   Q8_0: d fp16 | 32 int8                        w = d * q
// Byte j of a 4-bit block holds element j in its low nibble and element j + 16 in its high one.
//
// Each worker dequantizes a panel of PANEL_ROWS weight rows to float32 (gguf's values exactly:
// a product, then a sum, never fused), then multiplies every row of x against the panel.
// Every output element is the same sequence of float operations whatever the number of rows
// in x, the panel it falls in, or the thread that computes it: eight partial sums, lane l
// taking k = l mod 8 in order, fused multiply-adds, then one fixed pairwise sum of the eight.
// So a sequence's logits do not depend on what it is batched with (batch invariance).
#include <immintrin.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;     // weights per block
constexpr int64_t kPanelRows = 12; // weight rows dequantized at a time (a multiple of kTileN)
constexpr int64_t kTileM = 4;      // x rows per micro-kernel call
constexpr int64_t kTileN = 3;      // weight rows per micro-kernel call
constexpr int64_t kFusedMaxTokens = 4;  // up to this many x rows, weights are dequantized a block at a time
constexpr int kFusedRows = 4;           // weight rows at a time on that path

enum QuantType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids

int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: TORCH_CHECK(false, "gguf_linear: unsupported quant type id ", type);
  }
}

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 32 weights of one block as four vectors of 8 floats (elements 8j..8j+7 in w[j]).
template <int64_t Type>
inline void dequantize_block(const uint8_t* block, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(fp16_at(block));
  if constexpr (Type == Q8_0) {
    for (int j = 0; j < 4; ++j) {
      __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * j));
      w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
    }
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (Type == Q4_1 ? 4 : 2)));
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(packed, low_mask);                      // elements 0..15
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_mask);  // elements 16..31
    const __m128i codes[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    if constexpr (Type == Q4_0) {
      const __m256i eight = _mm256_set1_epi32(8);
      for (int j = 0; j < 4; ++j)
        w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(codes[j]), eight)));
    } else {
      const __m256 m = _mm256_set1_ps(fp16_at(block + 2));
      for (int j = 0; j < 4; ++j)
        w[j] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes[j]))), m);
    }
  }
}

// One row of K / 32 blocks -> K floats.
template <int64_t Type>
void dequantize_row(const uint8_t* blocks, int64_t num_blocks, float* out) {
  constexpr int64_t bytes = Type == Q4_0 ? 18 : Type == Q4_1 ? 20 : 34;
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m256 w[4];
    dequantize_block<Type>(blocks + b * bytes, w);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + b * kGroup + 8 * j, w[j]);
  }
}

// The fixed pairwise sum of a vector's eight lanes: ((0+4)+(2+6)) + ((1+5)+(3+7)).
inline float sum_lanes(__m256 v) {
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
    for (int j = 0; j < TN; ++j) y[i * ldy + j] = sum_lanes(acc[i][j]);
}

template <int TM>
void rows_times_panel(const float* x, int64_t ldx, const float* panel, int64_t k, int64_t rows, float* y, int64_t ldy) {
  int64_t j = 0;
  for (; j + kTileN <= rows; j += kTileN) micro_kernel<TM, kTileN>(x, ldx, panel + j * k, k, k, y + j, ldy);
  for (; j < rows; ++j) micro_kernel<TM, 1>(x, ldx, panel + j * k, k, k, y + j, ldy);
}

// The few-token path: TM rows of x against TN weight rows, one block at a time dequantized
// into a stack buffer (L1), never a whole panel. TN independent accumulator chains per x
// row hide the latency of the fused multiply-adds. The same float operations, in the same
// order per output element, as dequantize_row followed by micro_kernel<TM, 1>.
template <int64_t Type, int TM, int TN>
void rows_times_blocks(const float* x, int64_t k, const uint8_t* rows, int64_t row_bytes, float* y, int64_t ldy) {
  constexpr int64_t bytes = Type == Q4_0 ? 18 : Type == Q4_1 ? 20 : 34;
  __m256 acc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int r = 0; r < TN; ++r) acc[i][r] = _mm256_setzero_ps();
  alignas(32) float w[TN][kGroup];
  for (int64_t b = 0; b < k / kGroup; ++b) {
    for (int r = 0; r < TN; ++r) {
      // the next rows' bytes at this offset, ahead of need: DRAM streams too slowly on its own here
      _mm_prefetch(reinterpret_cast<const char*>(rows + (r + TN) * row_bytes + b * bytes), _MM_HINT_T0);
      __m256 v[4];
      dequantize_block<Type>(rows + r * row_bytes + b * bytes, v);
      for (int j = 0; j < 4; ++j) _mm256_store_ps(w[r] + 8 * j, v[j]);
    }
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < TM; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + i * k + b * kGroup + 8 * j);
        for (int r = 0; r < TN; ++r) acc[i][r] = _mm256_fmadd_ps(xv, _mm256_load_ps(w[r] + 8 * j), acc[i][r]);
      }
  }
  for (int i = 0; i < TM; ++i)
    for (int r = 0; r < TN; ++r) y[i * ldy + r] = sum_lanes(acc[i][r]);
}

template <int64_t Type, int TM>
void few_tokens(const float* x, int64_t k, const uint8_t* blocks, int64_t row_bytes, int64_t begin, int64_t end,
                float* y, int64_t ldy) {
  int64_t r = begin;
  for (; r + kFusedRows <= end; r += kFusedRows)
    rows_times_blocks<Type, TM, kFusedRows>(x, k, blocks + r * row_bytes, row_bytes, y + r, ldy);
  for (; r < end; ++r) rows_times_blocks<Type, TM, 1>(x, k, blocks + r * row_bytes, row_bytes, y + r, ldy);
}

template <int64_t Type>
void gguf_linear_impl(const float* x, int64_t num_tokens, const uint8_t* blocks, int64_t n, int64_t k, float* y) {
  const int64_t num_blocks = k / kGroup;
  const int64_t row_bytes = num_blocks * block_bytes(Type);
  const int64_t num_panels = (n + kPanelRows - 1) / kPanelRows;
  if (num_tokens <= kFusedMaxTokens) {
    at::parallel_for(0, n, kPanelRows, [&](int64_t begin, int64_t end) {
      switch (num_tokens) {
        case 1: few_tokens<Type, 1>(x, k, blocks, row_bytes, begin, end, y, n); break;
        case 2: few_tokens<Type, 2>(x, k, blocks, row_bytes, begin, end, y, n); break;
        case 3: few_tokens<Type, 3>(x, k, blocks, row_bytes, begin, end, y, n); break;
        default: few_tokens<Type, 4>(x, k, blocks, row_bytes, begin, end, y, n); break;
      }
    });
    return;
  }
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kPanelRows * k);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanelRows;
      const int64_t rows = std::min(kPanelRows, n - n0);
      for (int64_t r = 0; r < rows; ++r)
        dequantize_row<Type>(blocks + (n0 + r) * row_bytes, num_blocks, panel.data() + r * k);
      int64_t m = 0;
      for (; m + kTileM <= num_tokens; m += kTileM)
        rows_times_panel<kTileM>(x + m * k, k, panel.data(), k, rows, y + m * n + n0, n);
      for (; m < num_tokens; ++m) rows_times_panel<1>(x + m * k, k, panel.data(), k, rows, y + m * n + n0, n);
    }
  });
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t quant_type, int64_t in_features) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "gguf_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, "gguf_linear: blocks must be 2-D uint8");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features, "gguf_linear: x must be [T, ", in_features, "]");
  TORCH_CHECK(in_features % kGroup == 0, "gguf_linear: in_features must be a multiple of 32");
  const int64_t n = blocks.size(0);
  TORCH_CHECK(blocks.size(1) == in_features / kGroup * block_bytes(quant_type),
              "gguf_linear: blocks of ", blocks.size(1), " bytes per row do not hold ", in_features, " weights");
  at::Tensor xc = x.contiguous();
  at::Tensor bc = blocks.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* bp = bc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (quant_type) {
    case Q4_0: gguf_linear_impl<Q4_0>(xp, x.size(0), bp, n, in_features, yp); break;
    case Q4_1: gguf_linear_impl<Q4_1>(xp, x.size(0), bp, n, in_features, yp); break;
    case Q8_0: gguf_linear_impl<Q8_0>(xp, x.size(0), bp, n, in_features, yp); break;
    default: TORCH_CHECK(false, "gguf_linear: unsupported quant type id ", quant_type);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(nanoserve, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int quant_type, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
}
