// Decode attention over the paged KV cache, float32, for the CPU with AVX2 and FMA.
//
// One query token per sequence. q: [B, H, D]; key_cache, value_cache: [num_blocks,
// block_size, Hkv, D]; block_tables: [B, max_blocks] int32 (logical block -> physical
// block); context_lens: [B] int32 (keys per sequence, the new token's included, already
// written through the slot mapping). Returns [B, H * D].
//
// The H / Hkv query heads of a group share their KV head (grouped-query attention). Per
// (sequence, KV head): scores s_t = scale * q . k_t for every cached position t, read
// block by block through the table (no gather of whole blocks, no padding to the longest
// context, no mask); softmax with the maximum subtracted (std::exp, float32); then
// out = sum_t p_t v_t / sum_t p_t. Attention follows Vaswani et al. 2017; the paged layout
// follows vLLM (Kwon et al. 2023).
#include <immintrin.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// s[t] = scale * q . k_t for the keys of one KV head; four keys at a time (four independent chains).
template <typename KeyAt>
void scores_of(const float* query, int64_t head_dim, int64_t context_len, float scale, KeyAt key_at, float* s) {
  int64_t t = 0;
  for (; t + 4 <= context_len; t += 4) {
    const float* keys[4] = {key_at(t), key_at(t + 1), key_at(t + 2), key_at(t + 3)};
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < head_dim; i += 8) {
      const __m256 qv = _mm256_loadu_ps(query + i);
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[j] + i), acc[j]);
    }
    for (int j = 0; j < 4; ++j) s[t + j] = scale * sum_lanes(acc[j]);
  }
  for (; t < context_len; ++t) {
    const float* key = key_at(t);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < head_dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(query + i), _mm256_loadu_ps(key + i), acc);
    s[t] = scale * sum_lanes(acc);
  }
}

// o = sum_t p[t] v_t, the output held in registers: DV vectors of 8 (head_dim = 8 DV).
template <int DV, typename ValueAt>
void weighted_values(const float* p, int64_t context_len, ValueAt value_at, float* o) {
  __m256 acc[DV];
  for (int i = 0; i < DV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t t = 0; t < context_len; ++t) {
    const float* value = value_at(t);
    const __m256 pv = _mm256_set1_ps(p[t]);
    for (int i = 0; i < DV; ++i) acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(value + 8 * i), acc[i]);
  }
  for (int i = 0; i < DV; ++i) _mm256_storeu_ps(o + 8 * i, acc[i]);
}

// The same for any head_dim (a multiple of 8), the output through memory.
template <typename ValueAt>
void weighted_values_any(const float* p, int64_t context_len, ValueAt value_at, float* o, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim; ++i) o[i] = 0.0f;
  for (int64_t t = 0; t < context_len; ++t) {
    const float* value = value_at(t);
    const __m256 pv = _mm256_set1_ps(p[t]);
    for (int64_t i = 0; i < head_dim; i += 8)
      _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(value + i), _mm256_loadu_ps(o + i)));
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "paged_decode_attention: q [B, H, D], caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and context_lens must be int32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_decode_attention: contiguous caches");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && head_dim % 8 == 0, "paged_decode_attention: head_dim ", head_dim,
              " must match the cache and be a multiple of 8");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_decode_attention: ", num_heads, " heads over ", num_kv_heads,
              " KV heads");
  TORCH_CHECK(block_tables.size(0) == num_seqs && context_lens.size(0) == num_seqs,
              "paged_decode_attention: one block table and one context length per sequence");
  const int64_t group = num_heads / num_kv_heads;
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
  const float* q_ptr = qc.data_ptr<float>();
  const float* k_ptr = key_cache.data_ptr<float>();
  const float* v_ptr = value_cache.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t token_stride = num_kv_heads * head_dim;  // floats between positions of one block
  const int64_t block_stride = block_size * token_stride;

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, kv_head = work % num_kv_heads;
      const int64_t context_len = len_ptr[b];
      const int32_t* table = table_ptr + b * max_blocks;
      scores.resize(group * context_len);
      for (int64_t g = 0; g < group; ++g) {
        const float* query = q_ptr + (b * num_heads + kv_head * group + g) * head_dim;
        float* s = scores.data() + g * context_len;
        const int64_t head_offset = kv_head * head_dim;
        auto key_at = [&](int64_t t) {
          return k_ptr + table[t / block_size] * block_stride + (t % block_size) * token_stride + head_offset;
        };
        auto value_at = [&](int64_t t) {
          return v_ptr + table[t / block_size] * block_stride + (t % block_size) * token_stride + head_offset;
        };
        scores_of(query, head_dim, context_len, static_cast<float>(scale), key_at, s);
        float max_score = s[0];
        for (int64_t t = 1; t < context_len; ++t) max_score = std::max(max_score, s[t]);
        float total = 0.0f;
        for (int64_t t = 0; t < context_len; ++t) {
          s[t] = std::exp(s[t] - max_score);
          total += s[t];
        }
        float* o = out_ptr + b * num_heads * head_dim + (kv_head * group + g) * head_dim;
        if (head_dim == 64) {
          weighted_values<8>(s, context_len, value_at, o);
        } else if (head_dim == 128) {
          weighted_values<16>(s, context_len, value_at, o);
        } else {
          weighted_values_any(s, context_len, value_at, o, head_dim);
        }
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < head_dim; ++i) o[i] *= inv;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
