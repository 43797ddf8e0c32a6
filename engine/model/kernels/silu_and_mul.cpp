// SwiGLU's gating (Shazeer 2020) in one pass, float32, for the CPU with AVX2 and FMA.
//
// silu_and_mul(gate_up [T, 2I]) -> [T, I]: out = silu(gate) * up, gate = gate_up[:, :I],
// up = gate_up[:, I:], silu(x) = x / (1 + exp(-x)), one read of gate_up and one write
// instead of torch's silu, its temporary and the in-place multiply.
//
// Exactness: the same operations as torch's float32 path, x / (1 + e) then * up, each
// rounded once; only e = exp(-x) is computed here (exp_neg below, within an ulp of the
// exact exponential, as torch's own vectorized exp), so the output is within a few ulp of
// F.silu(gate) * up. exp(-x) overflows to +inf for x < -88.72 (silu = -0, as torch's).
#include <immintrin.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// e = exp(-g) for 8 lanes. x = -g = n ln2 + r with n = round(x / ln2), |r| <= ln2 / 2;
// exp(r) by a degree-6 polynomial fitted (for this file) to exp's relative error on that
// interval: under 2e-8 with its float32 coefficients, a third of an ulp; Horner with FMA.
// Then times 2^n, made in the exponent bits as 2^(n - 1) against coefficients doubled
// (each Horner step exactly twice the undoubled one), so n = 128 needs no special case.
// ln2 is split in two (hi has 15 significant bits: n * hi is exact for |n| <= 128), so
// that r keeps its low bits.
// g is clamped to [-89, 86.5]: below -88.72 the product overflows to +inf by itself
// (silu(g) = -0, as torch's); above 86.5 e stays exp(-86.5) ~ 2.7e-38, which vanishes
// in 1 + e as the exact value does (any e under 2^-24).
inline __m256 exp_neg(__m256 g) {
  g = _mm256_min_ps(_mm256_max_ps(g, _mm256_set1_ps(-89.0f)), _mm256_set1_ps(86.5f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(g, _mm256_set1_ps(-1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmsub_ps(n, _mm256_set1_ps(0.693145751953125f), g);   // -g - n ln2_hi
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);  // - n ln2_lo (ln2 - hi)
  __m256 p = _mm256_set1_ps(0.002767368219792843f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.016749631613492966f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.08333645015954971f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.33332839608192444f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.9999998211860657f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.0f));
  // 2^(n - 1), n in -125..128: (n - 1 + 127) in the exponent field
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// silu(g) * u = (g / (1 + e)) * u, e = exp(-g): torch's operations and roundings, but for e.
inline __m256 silu_mul_ps(__m256 gate, __m256 up) {
  const __m256 e = exp_neg(gate);
  return _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), up);
}

// Columns per unit of parallel work, and units per thread at least: one unit is
// kChunk values, so steps below kGrain * kChunk values (one decode row of a small
// model) stay on the calling thread.
constexpr int64_t kChunk = 512;
constexpr int64_t kGrain = 16;

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "silu_and_mul: float32 only");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up [T, 2I]");
  const at::Tensor x = gate_up.contiguous();
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t chunks_per_row = (inter + kChunk - 1) / kChunk;
  at::parallel_for(0, rows * chunks_per_row, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t row = unit / chunks_per_row;
      const int64_t col_begin = (unit % chunks_per_row) * kChunk;
      const int64_t col_end = std::min(col_begin + kChunk, inter);
      const float* gate = x_ptr + row * 2 * inter;
      const float* up = gate + inter;
      float* o = o_ptr + row * inter;
      int64_t i = col_begin;
      for (; i + 8 <= col_end; i += 8)
        _mm256_storeu_ps(o + i, silu_mul_ps(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
      if (i < col_end) {  // the last < 8 columns through the same vector code, padded
        alignas(32) float g[8] = {0}, u[8] = {0}, r[8];
        std::copy(gate + i, gate + col_end, g);
        std::copy(up + i, up + col_end, u);
        _mm256_store_ps(r, silu_mul_ps(_mm256_load_ps(g), _mm256_load_ps(u)));
        std::copy(r, r + (col_end - i), o + i);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, m) {
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
}
