// Rotary embedding of Q and K and the write of K and V into the paged cache, in one pass,
// float32 (the cache float32, float16 or bfloat16), for the CPU with AVX2.
//
// rope_and_write_kv(qkv [T, (H + 2 Hkv) D], cos, sin_signed [T, D] (or [T, 1, D]),
// key_cache, value_cache [num_blocks, block_size, Hkv, D], slot_mapping [T] int64, H, Hkv)
// -> (q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]), views of qkv:
// - rotates the H query heads and the Hkv key heads of every row of qkv in place, in the
//   "rotate half" layout of models/rope.py (dims i and i + D/2 form a pair):
//   x' = x * cos + swap(x) * sin_signed, swap(x) = (x[D/2:], x[:D/2]), with cos and
//   sin_signed the rows RotaryEmbedding.lookup gives ([cos, cos] and [-sin, sin]);
// - copies the rotated K heads and the V heads of token t to slot slot_mapping[t] of the
//   caches (slot = block_id * block_size + offset: the cache viewed as [slots, Hkv, D]).
// Replaces apply_rope's four ops and write_kv's two index_copy_ calls per layer.
//
// Exactness: the same float32 operations as apply_rope, whose addcmul torch computes as
// fma(swap(x), sin_signed, x * cos) (x * cos rounded, then one fused multiply-add), so q,
// k and the cache contents equal the torch path's bit for bit (a 16-bit cache: k and v rounded as
// torch's cast rounds them). Every slot is checked against the cache's size before anything is
// written.
#include <immintrin.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "kv_cache_types.h"

namespace {

// Rotates one head x [D] in place; cos and sin_signed are this token's rows [D].
inline void rotate_half(float* x, const float* cos, const float* sin_signed, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    const __m256 first =
        _mm256_fmadd_ps(x2, _mm256_loadu_ps(sin_signed + i), _mm256_mul_ps(x1, _mm256_loadu_ps(cos + i)));
    const __m256 second =
        _mm256_fmadd_ps(x1, _mm256_loadu_ps(sin_signed + half + i), _mm256_mul_ps(x2, _mm256_loadu_ps(cos + half + i)));
    _mm256_storeu_ps(x + i, first);
    _mm256_storeu_ps(x + half + i, second);
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = std::fma(x2, sin_signed[i], x1 * cos[i]);
    x[half + i] = std::fma(x1, sin_signed[half + i], x2 * cos[half + i]);
  }
}

// n floats into a cache row: copied, or rounded to the cache's 16-bit type as torch's cast rounds
// (to nearest, ties to even), so the cache holds what write_kv's index_copy_ of k.to(dtype) holds.
inline void store_row(const float* x, int64_t n, float* out) { std::memcpy(out, x, n * sizeof(float)); }
template <typename Half16>
inline void store_row(const float* x, int64_t n, Half16* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<Half16>(x[i]);
}

// Tokens per thread at least: a decode step of a few sequences stays on the calling thread.
constexpr int64_t kGrainTokens = 32;

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_and_write_kv(const at::Tensor& qkv, const at::Tensor& cos,
                                                                 const at::Tensor& sin_signed,
                                                                 const at::Tensor& key_cache,
                                                                 const at::Tensor& value_cache,
                                                                 const at::Tensor& slot_mapping, int64_t num_heads,
                                                                 int64_t num_kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin_signed.scalar_type() == at::kFloat,
              "rope_and_write_kv: qkv, cos and sin_signed must be float32");
  check_kv_cache_types(key_cache, value_cache, "rope_and_write_kv");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "rope_and_write_kv: slot_mapping must be int64");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.size(2) == num_kv_heads,
              "rope_and_write_kv: caches [num_blocks, block_size, num_kv_heads, head_dim], both alike");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "rope_and_write_kv: contiguous caches");
  const int64_t head_dim = key_cache.size(3);
  TORCH_CHECK(head_dim % 2 == 0, "rope_and_write_kv: head_dim must be even");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "rope_and_write_kv: qkv contiguous [T, (num_heads + 2 * num_kv_heads) * head_dim]");
  const int64_t num_tokens = qkv.size(0);
  TORCH_CHECK(cos.size(0) == num_tokens && cos.numel() == num_tokens * head_dim && cos.is_contiguous() &&
                  sin_signed.sizes() == cos.sizes() && sin_signed.is_contiguous(),
              "rope_and_write_kv: cos and sin_signed contiguous [T, head_dim] or [T, 1, head_dim]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens,
              "rope_and_write_kv: slot_mapping [T]");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < num_slots, "rope_and_write_kv: slot ", slot_ptr[t], " of token ", t,
                " outside the cache's ", num_slots, " slots");

  const int64_t row_size = qkv.size(1), kv_size = num_kv_heads * head_dim;
  float* qkv_ptr = qkv.data_ptr<float>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin_signed.data_ptr<float>();
  dispatch_kv_cache_type(key_cache, [&](auto kv) {
    using KV = decltype(kv);
    KV* k_cache = key_cache.data_ptr<KV>();
    KV* v_cache = value_cache.data_ptr<KV>();
    at::parallel_for(0, num_tokens, kGrainTokens, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        float* row = qkv_ptr + t * row_size;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h)
          rotate_half(row + h * head_dim, cos_ptr + t * head_dim, sin_ptr + t * head_dim, head_dim);
        const float* k = row + num_heads * head_dim;
        store_row(k, kv_size, k_cache + slot_ptr[t] * kv_size);
        store_row(k + kv_size, kv_size, v_cache + slot_ptr[t] * kv_size);
      }
    });
  });
  // the views are made here: made in Python they took as long as the rest of the op at T = 1
  const std::vector<at::Tensor> parts = qkv.view({num_tokens, num_heads + 2 * num_kv_heads, head_dim})
                                            .split_with_sizes({num_heads, num_kv_heads, num_kv_heads}, 1);
  return {parts[0], parts[1], parts[2]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, m) {
  m.def(
      "rope_and_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin_signed, Tensor(b!) key_cache, "
      "Tensor(c!) value_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) "
      "-> (Tensor(a), Tensor(a), Tensor(a))");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, m) {
  m.impl("rope_and_write_kv", &rope_and_write_kv);
}
