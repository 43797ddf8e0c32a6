// The instruction-set-independent half of paged_attention.cpp's bodies: included once at the end
// of each body's namespace (avx2_body, avx512_body), after the body has defined
//   kMaxHeads, kQueryPad          query heads per pass; query rows padded to a multiple of this
//   score_tile<kD, kHeads, kKeys> kHeads queries . kKeys keys
//   softmax_row(s, lp)            exp(s - max s) in place, returning the sum
//   values_of<kHeads>(w, p, lp, inv, o)  o_h = inv_h sum_t p_h,t v_t
// Expects from the includer: WorkItem, HeadRange, head_passes, round_up, kRowPad, kTileKeys.

// Scores of kHeads queries against every key of the item, rows of s lp apart.
template <int kD, int kHeads, typename KV>
void scores_of(const WorkItem<KV>& w, const float* q, int64_t dq, float* s, int64_t lp) {
  for (int64_t blk = 0, t0 = 0; t0 < w.context_len; ++blk, t0 += w.block_size) {
    const KV* base = w.keys + w.table[blk] * w.block_stride;
    const int64_t n = std::min(w.block_size, w.context_len - t0);
    int64_t i = 0;
    for (; i + kTileKeys <= n; i += kTileKeys)
      score_tile<kD, kHeads, kTileKeys>(q, dq, w.head_dim, base + i * w.token_stride, w.token_stride, s + t0 + i, lp);
    for (; i < n; ++i) score_tile<kD, kHeads, 1>(q, dq, w.head_dim, base + i * w.token_stride, 0, s + t0 + i, lp);
  }
}

// kHeads heads of the item: scores (head_dim 64 and 128 known at compile time), softmax, values.
template <int kHeads, typename KV>
void attend_heads(const WorkItem<KV>& w, const float* q, int64_t dq, float* s, int64_t lp, float* o) {
  if (w.head_dim == 64) {
    scores_of<64, kHeads>(w, q, dq, s, lp);
  } else if (w.head_dim == 128) {
    scores_of<128, kHeads>(w, q, dq, s, lp);
  } else {
    scores_of<0, kHeads>(w, q, dq, s, lp);
  }
  float inv[kHeads];
  for (int h = 0; h < kHeads; ++h) {
    std::fill(s + h * lp + w.context_len, s + (h + 1) * lp, -std::numeric_limits<float>::infinity());
    inv[h] = 1.0f / softmax_row(s + h * lp, lp);
  }
  values_of<kHeads>(w, s, lp, inv, o);
}

// The item's G heads; buffer: scratch, grown as needed.
template <typename KV>
void attend(const WorkItem<KV>& w, std::vector<float>& buffer) {
  const int64_t d = w.head_dim, dq = round_up(d, kQueryPad), lp = round_up(w.context_len, kRowPad);
  buffer.resize(w.group * (dq + lp));
  float* q = buffer.data();     // [G, dq], scaled, zero past d
  float* s = q + w.group * dq;  // [G, lp]
  for (int64_t h = 0; h < w.group; ++h)
    for (int64_t i = 0; i < dq; ++i) q[h * dq + i] = i < d ? w.scale * w.queries[h * d + i] : 0.0f;
  for (const HeadRange& r : head_passes(w.group, kMaxHeads)) {
    const float* qr = q + r.first * dq;
    float* sr = s + r.first * lp;
    float* o = w.out + r.first * d;
    switch (r.count) {
      case 1: attend_heads<1>(w, qr, dq, sr, lp, o); break;
      case 2: attend_heads<2>(w, qr, dq, sr, lp, o); break;
      case 3: attend_heads<3>(w, qr, dq, sr, lp, o); break;
      default: attend_heads<kMaxHeads>(w, qr, dq, sr, lp, o); break;
    }
  }
}
