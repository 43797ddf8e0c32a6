// The KV cache element types the kernels read and write: float32, float16, bfloat16 (the
// `--kv-cache-dtype` choices). One check and one dispatch, shared by paged_attention.cpp and
// rope_kv.cpp.
#pragma once

#include <ATen/ATen.h>

namespace {

// Raises unless both caches hold one of the three types, the same one. `op` names the caller.
inline void check_kv_cache_types(const at::Tensor& key_cache, const at::Tensor& value_cache, const char* op) {
  const at::ScalarType kv_type = key_cache.scalar_type();
  TORCH_CHECK((kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16) &&
                  value_cache.scalar_type() == kv_type,
              op, ": key_cache and value_cache must both be float32, float16 or bfloat16");
}

// fn(KV{}) with KV the cache's element type (float, at::Half or at::BFloat16), for caches that
// passed check_kv_cache_types.
template <class Fn>
void dispatch_kv_cache_type(const at::Tensor& key_cache, Fn&& fn) {
  switch (key_cache.scalar_type()) {
    case at::kHalf: fn(at::Half{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    default: fn(float{}); break;
  }
}

}  // namespace
