// paged_prefill: causal attention for many query tokens per sequence (whole prompts,
// chunks after a cached prefix) straight from the paged pool, as paged_decode does for
// one. A sequence's query tokens are the last query_len of its context_len positions,
// and their K/V are already in the pool. Each task is one (sequence, kv head, run of
// up to kMaxRows / group query positions): its rows are every query head of the group
// at each position (grouped-query attention: K/V read once for all of them), and its
// queries and outputs stay in float32 scratch (in L2). Keys are walked once, in tiles of
// kTileK tokens through the block table, copied into scratch (K transposed, so a vector
// holds kTileK keys' scores); scores, an online softmax (running max and sum, flash-
// attention style, with an inline polynomial exp) and the weighted values are computed
// in registers, kRows rows at a time. Rows that see no key of a tile (causal, sliding
// window) skip it; the mask is applied only where a tile crosses a row's limits. Output
// rows are written at the queries' own token rows of `out`.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace baton {
namespace {

// One register's floats: a zmm with AVX-512, else a ymm. Wider generic vectors than the
// registers are split in two and the register blocks below no longer fit in 16 ymm: on an
// AVX2 host the 16-lane build ran a 2000-token prefill 8x slower than torch's path.
#if defined(__AVX512F__)
#define BATON_VECTOR_BYTES 64
#else
#define BATON_VECTOR_BYTES 32
#endif
using vf = float __attribute__((vector_size(BATON_VECTOR_BYTES)));
using vi = int32_t __attribute__((vector_size(BATON_VECTOR_BYTES)));  // a comparison's lanes
constexpr int64_t kLanes = BATON_VECTOR_BYTES / sizeof(float);
constexpr bool kWide = kLanes == 16;  // 32 vector registers (AVX-512), else 16
constexpr int64_t kKeyVecs = 2;
constexpr int64_t kTileK = kKeyVecs * kLanes;
constexpr int64_t kMaxRows = 384;  // query rows of one task: its queries and outputs stay in L2

inline vf load_vf(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(vf));
  return v;
}
inline void store_vf(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(vf)); }
inline vf splat(float x) { return vf{} + x; }

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// e^x, 16 lanes inline (no library call): x = n ln2 + r with |r| <= ln2 / 2, e^r by
// Cephes' degree-6 polynomial (about 1 ulp), 2^n built in the exponent bits. Lanes
// below -87 (e^x under float's normal range, masked scores at -inf among them) give 0.
inline vf exp_vf(vf x) {
  const vi tiny = x < -87.f;
  x = x > 88.f ? splat(88.f) : x;
  x = tiny ? splat(0.f) : x;
  const vf t = x * 1.44269504088896341f;
  const vi n = __builtin_convertvector(t + (t >= 0.f ? splat(0.5f) : splat(-0.5f)), vi);
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const vi bits = (n + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof(vf));
  return tiny ? splat(0.f) : p * scale;
}

// Rows per register block: their output accumulators (kRows x kDim floats) stay in registers.
// Per register block, kRows x kKeyVecs score vectors and then kRows x (kDim / kLanes)
// output vectors stay in registers, with room for the operands beside them.
constexpr int64_t kRowsFor(int64_t dim) {
  if (kWide) return dim >= 128 ? 2 : dim >= 64 ? 6 : 8;
  return dim >= 64 ? 1 : dim >= 32 ? 3 : 6;
}

// Query positions per task: every query head of the group at each.
inline int64_t TileQ(int64_t group) { return std::max<int64_t>(1, kMaxRows / group); }

struct PrefillTask {
  int64_t seq, head, first;  // first query (0-based within the sequence's queries)
};

template <typename T, int64_t kDim>
void prefill_tile(const T* q, int64_t q_tok_stride, int64_t q_head_stride, const T* kv_head,
                  int64_t block_stride, int64_t kv_stride, const int64_t* table,
                  int64_t block_size, int64_t context_len, int64_t query_len, int64_t first,
                  int64_t group, int64_t window, float scale, T* out, int64_t out_tok_stride,
                  float* scratch) {
  constexpr int64_t kVecs = kDim / kLanes;
  constexpr int64_t kRows = kRowsFor(kDim);
  const int64_t count = std::min(TileQ(group), query_len - first);
  const int64_t rows = count * group;
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;
  float* qf = scratch;                          // [padded, kDim] scaled queries
  float* acc = qf + padded * kDim;              // [padded, kDim] unnormalised outputs
  float* kt = acc + padded * kDim;              // [kDim, kTileK] keys, transposed
  float* vt = kt + kDim * kTileK;               // [kTileK, kDim] values
  float* row_max = vt + kTileK * kDim;          // [padded]
  float* row_sum = row_max + padded;            // [padded]
  float* probs = row_sum + padded;              // [kRows, kTileK]
  int64_t* row_pos = reinterpret_cast<int64_t*>(probs + kRows * kTileK);  // [padded]
  const int64_t pos0 = context_len - query_len + first;  // the first query's position
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t i = r / group, g = r % group;
    float* dst = qf + r * kDim;
    if (r < rows) {
      const T* src = q + i * q_tok_stride + g * q_head_stride;
      for (int64_t d = 0; d < kDim; ++d) dst[d] = to_float(src[d]) * scale;
    } else {
      std::fill(dst, dst + kDim, 0.f);
    }
    row_pos[r] = pos0 + std::min(i, count - 1);  // padding rows copy the last position
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
  }
  std::fill(acc, acc + padded * kDim, 0.f);
  const int64_t last = pos0 + count - 1;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  for (int64_t t0 = lo; t0 <= last; t0 += kTileK) {
    const int64_t n = std::min(kTileK, last + 1 - t0);
    for (int64_t j = 0; j < kTileK; ++j) {
      if (j < n) {
        const int64_t t = t0 + j;
        const T* k = kv_head + table[t / block_size] * block_stride + (t % block_size) * kDim;
        const T* v = k + kv_stride;
        for (int64_t d = 0; d < kDim; ++d) kt[d * kTileK + j] = to_float(k[d]);
        for (int64_t d = 0; d < kDim; ++d) vt[j * kDim + d] = to_float(v[d]);
      } else {
        for (int64_t d = 0; d < kDim; ++d) kt[d * kTileK + j] = 0.f;
        std::fill(vt + j * kDim, vt + (j + 1) * kDim, 0.f);
      }
    }
    vf key_pos[kKeyVecs];
    for (int64_t j = 0; j < kTileK; ++j) key_pos[j / kLanes][j % kLanes] = static_cast<float>(t0 + j);
    // Positions as floats are exact below 2^24 tokens. Only rows that see a key of this
    // tile take part: from the first at or after t0 (causal) to the last whose window
    // reaches t0 + n - 1.
    const int64_t key_last = t0 + n - 1;
    const int64_t r_begin = std::max<int64_t>(0, t0 - pos0) * group / kRows * kRows;
    int64_t r_end = padded;
    if (window > 0) {
      const int64_t positions = std::max<int64_t>(0, key_last + window - pos0);
      r_end = std::min(padded, (positions * group + kRows - 1) / kRows * kRows);
    }
    for (int64_t r = r_begin; r < r_end; r += kRows) {
      const int64_t first_pos = row_pos[r], last_pos = row_pos[r + kRows - 1];
      const bool whole = n == kTileK && key_last <= first_pos &&
                         (window <= 0 || t0 > last_pos - window);
      vf s[kRows][kKeyVecs];
      for (int64_t u = 0; u < kRows; ++u)
        for (int64_t c = 0; c < kKeyVecs; ++c) s[u][c] = vf{};
      const float* qr = qf + r * kDim;
#pragma GCC unroll 4
      for (int64_t d = 0; d < kDim; ++d) {
        vf kd[kKeyVecs];
        for (int64_t c = 0; c < kKeyVecs; ++c) kd[c] = load_vf(kt + d * kTileK + c * kLanes);
        for (int64_t u = 0; u < kRows; ++u) {
          const float qd = qr[u * kDim + d];
          for (int64_t c = 0; c < kKeyVecs; ++c) s[u][c] += qd * kd[c];
        }
      }
      float alpha[kRows];
      for (int64_t u = 0; u < kRows; ++u) {
        if (!whole) {
          const float pos = static_cast<float>(row_pos[r + u]);
          for (int64_t c = 0; c < kKeyVecs; ++c) {
            vi hidden = key_pos[c] > pos;
            if (window > 0) hidden |= key_pos[c] <= pos - static_cast<float>(window);
            s[u][c] = hidden ? splat(-INFINITY) : s[u][c];
          }
        }
        vf top = s[u][0];
        for (int64_t c = 1; c < kKeyVecs; ++c) top = top > s[u][c] ? top : s[u][c];
        const float m_old = row_max[r + u];
        const float m_new = std::max(m_old, hmax(top));
        // A row whose keys so far are all masked keeps m = -inf: nothing to add yet.
        const float base = m_new == -INFINITY ? 0.f : m_new;
        vf total{};
        for (int64_t c = 0; c < kKeyVecs; ++c) {
          const vf e = exp_vf(s[u][c] - base);
          total += e;
          store_vf(probs + u * kTileK + c * kLanes, e);
        }
        alpha[u] = std::exp(m_old - base);
        row_sum[r + u] = row_sum[r + u] * alpha[u] + hsum(total);
        row_max[r + u] = m_new;
      }
      vf o[kRows][kVecs];
      for (int64_t u = 0; u < kRows; ++u)
        for (int64_t c = 0; c < kVecs; ++c)
          o[u][c] = load_vf(acc + (r + u) * kDim + c * kLanes) * alpha[u];
      for (int64_t j = 0; j < n; ++j) {
        vf vj[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) vj[c] = load_vf(vt + j * kDim + c * kLanes);
        for (int64_t u = 0; u < kRows; ++u) {
          const float pj = probs[u * kTileK + j];
          for (int64_t c = 0; c < kVecs; ++c) o[u][c] += pj * vj[c];
        }
      }
      for (int64_t u = 0; u < kRows; ++u)
        for (int64_t c = 0; c < kVecs; ++c) store_vf(acc + (r + u) * kDim + c * kLanes, o[u][c]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group, g = r % group;
    const float inv = 1.f / row_sum[r];
    T* dst = out + i * out_tok_stride + g * kDim;
    for (int64_t d = 0; d < kDim; ++d) dst[d] = static_cast<T>(acc[r * kDim + d] * inv);
  }
}

template <typename T, int64_t kDim>
void run_prefill(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                 const at::Tensor& tables, const at::Tensor& starts, const at::Tensor& qlens,
                 const at::Tensor& clens, double scale, int64_t window, at::Tensor& out) {
  const int64_t num_seqs = qlens.numel(), num_heads = q.size(1);
  const int64_t num_layers = kv.size(1), kv_heads = kv.size(3), block_size = kv.size(4);
  const int64_t group = num_heads / kv_heads;
  const int64_t head_stride = block_size * kDim;
  const int64_t kv_stride = kv_heads * head_stride;
  const int64_t layer_stride = 2 * kv_stride;
  const int64_t block_stride = num_layers * layer_stride;
  const int64_t* start_ptr = starts.data_ptr<int64_t>();
  const int64_t* qlen_ptr = qlens.data_ptr<int64_t>();
  const int64_t* clen_ptr = clens.data_ptr<int64_t>();
  std::vector<PrefillTask> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(0 < qlen_ptr[s] && qlen_ptr[s] <= clen_ptr[s], "0 < query_len <= context_len");
    TORCH_CHECK(0 <= start_ptr[s] && start_ptr[s] + qlen_ptr[s] <= q.size(0) &&
                    start_ptr[s] + qlen_ptr[s] <= out.size(0),
                "query rows out of range");
    TORCH_CHECK((clen_ptr[s] + block_size - 1) / block_size <= tables.size(1),
                "a block table is shorter than its context");
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t f = 0; f < qlen_ptr[s]; f += TileQ(group)) tasks.push_back({s, h, f});
  }
  const T* q_ptr = q.data_ptr<T>();
  const T* kv_ptr = kv.data_ptr<T>() + layer * layer_stride;
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t table_stride = tables.stride(0);
  T* out_ptr = out.data_ptr<T>();
  const int64_t q_tok = q.stride(0), q_head = q.stride(1), out_tok = out.stride(0);
  constexpr int64_t kRows = kRowsFor(kDim);
  const int64_t padded = (TileQ(group) * group + kRows - 1) / kRows * kRows;
  const size_t scratch_floats = static_cast<size_t>(2 * padded * kDim + 2 * kDim * kTileK +
                                                    kRows * kTileK + 4 * padded);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    // 64-byte aligned: a vector load that straddles two cache lines costs two.
    std::vector<float> buffer(scratch_floats + kLanes);
    float* scratch = buffer.data();
    scratch += (kLanes - reinterpret_cast<uintptr_t>(scratch) / sizeof(float) % kLanes) % kLanes;
    for (int64_t k = begin; k < end; ++k) {
      const PrefillTask& task = tasks[k];
      const int64_t s = task.seq, h = task.head;
      const int64_t row0 = start_ptr[s] + task.first;
      prefill_tile<T, kDim>(q_ptr + row0 * q_tok + h * group * q_head, q_tok, q_head,
                            kv_ptr + h * head_stride, block_stride, kv_stride,
                            table_ptr + s * table_stride, block_size, clen_ptr[s], qlen_ptr[s],
                            task.first, group, window, static_cast<float>(scale),
                            out_ptr + row0 * out_tok + h * group * kDim, out_tok,
                            scratch);
    }
  });
}

template <typename T>
void prefill_dispatch_dim(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                          const at::Tensor& tables, const at::Tensor& starts,
                          const at::Tensor& qlens, const at::Tensor& clens, double scale,
                          int64_t window, at::Tensor& out) {
  switch (q.size(2)) {
    case 16: return run_prefill<T, 16>(q, kv, layer, tables, starts, qlens, clens, scale, window, out);
    case 32: return run_prefill<T, 32>(q, kv, layer, tables, starts, qlens, clens, scale, window, out);
    case 64: return run_prefill<T, 64>(q, kv, layer, tables, starts, qlens, clens, scale, window, out);
    case 128: return run_prefill<T, 128>(q, kv, layer, tables, starts, qlens, clens, scale, window, out);
    default: TORCH_CHECK(false, "paged_prefill supports head_dim 16, 32, 64 and 128, not ", q.size(2));
  }
}

}  // namespace

// q [T, heads, d] (rows may be strided; heads and d contiguous), kv the whole pool,
// block_tables [S, >= ceil(context_len / block_size)], query_starts / query_lens /
// context_lens [S] int64: sequence s's queries are q rows query_starts[s] onwards, the
// last query_lens[s] of its context_lens[s] positions. Writes those rows of out [T', heads * d].
void paged_prefill_(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                    const at::Tensor& block_tables, const at::Tensor& query_starts,
                    const at::Tensor& query_lens, const at::Tensor& context_lens, double scale,
                    int64_t window, at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "paged_prefill runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 6, "q [T, heads, d] and kv [blocks, layers, 2, kv_heads, bs, d]");
  TORCH_CHECK(kv.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, kv and out must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q's heads and d must be contiguous");
  TORCH_CHECK(q.size(2) == kv.size(5) && q.size(1) % kv.size(3) == 0, "head shapes disagree");
  TORCH_CHECK(out.dim() == 2 && out.size(1) == q.size(1) * q.size(2) && out.stride(1) == 1,
              "out [T, heads * d], rows contiguous");
  TORCH_CHECK(0 <= layer && layer < kv.size(1), "layer out of range");
  for (const at::Tensor* t : {&block_tables, &query_starts, &query_lens, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong, "block tables and lengths must be int64");
  TORCH_CHECK(query_starts.is_contiguous() && query_lens.is_contiguous() &&
                  context_lens.is_contiguous() && query_starts.numel() == query_lens.numel() &&
                  context_lens.numel() == query_lens.numel(),
              "one start, query length and context length per sequence");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query_lens.numel() &&
                  block_tables.stride(1) == 1,
              "one block table row per sequence");
  if (q.scalar_type() == at::kFloat) {
    prefill_dispatch_dim<float>(q, kv, layer, block_tables, query_starts, query_lens,
                                context_lens, scale, window, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    prefill_dispatch_dim<c10::BFloat16>(q, kv, layer, block_tables, query_starts, query_lens,
                                        context_lens, scale, window, out);
  } else {
    TORCH_CHECK(false, "paged_prefill supports float32 and bfloat16, not ", q.scalar_type());
  }
}

}  // namespace baton
