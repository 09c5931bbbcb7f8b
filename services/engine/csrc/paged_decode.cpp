// paged_decode: decode attention straight from the paged KV pool (one query per sequence).
//
// The pool is kv[num_blocks, layers, 2, kv_heads, block_size, head_dim] (KVLayout):
// one head's keys of one block are block_size contiguous rows. Each task is one
// (sequence, kv head): it walks the sequence's block table, scores all the query
// heads that share the kv head (grouped-query attention) against each key row while
// it is in cache, takes an exact softmax over the scores (max, exp, sum) and sums the
// value rows weighted by it. Nothing is gathered or copied; float32 accumulation for
// float32 and bfloat16 pools.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace baton {
namespace {

// Blocks of one sequence lie anywhere in the pool, so the hardware prefetcher loses
// the stream at every block edge: ask for the next block's rows of this head early.
template <typename T>
inline void prefetch_rows(const T* rows, int64_t count) {
  const char* p = reinterpret_cast<const char*>(rows);
  const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

template <typename T, int64_t kDim>
void decode_one(const T* q, int64_t q_head_stride, const T* kv_layer, int64_t block_stride,
                int64_t kv_stride, int64_t head_stride, const int64_t* table, int64_t block_size,
                int64_t start, int64_t end, int64_t group, int64_t dim_rt, float scale, T* out,
                std::vector<float>& scratch) {
  const int64_t dim = kDim > 0 ? kDim : dim_rt;
  const int64_t n = end - start;
  scratch.resize(static_cast<size_t>(group * (n + dim) + group * dim));
  float* qf = scratch.data();               // [group, dim] scaled query
  float* acc = qf + group * dim;            // [group, dim] weighted values
  float* scores = acc + group * dim;        // [group, n]
  prefetch_rows(kv_layer + table[start / block_size] * block_stride, head_stride);
  for (int64_t g = 0; g < group; ++g) {
    const T* qg = q + g * q_head_stride;
    for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(qg[d]) * scale;
  }
  // Scores: each key row once, against every query head of the group.
  for (int64_t t = start; t < end;) {
    const int64_t block = table[t / block_size];
    const int64_t off = t % block_size;
    const int64_t stop = std::min(end, t + (block_size - off));
    const T* k = kv_layer + block * block_stride + off * dim;
    if (stop < end) prefetch_rows(kv_layer + table[stop / block_size] * block_stride, head_stride);
    for (int64_t u = t; u < stop; ++u, k += dim) {
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf + g * dim;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; ++d) s += qg[d] * to_float(k[d]);
        scores[g * n + (u - start)] = s;
      }
    }
    t = stop;
  }
  prefetch_rows(kv_layer + table[start / block_size] * block_stride + kv_stride, head_stride);
  // Softmax per query head.
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = std::exp(sg[i] - m);
      sum += sg[i];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
  }
  // Weighted values: each value row once, into every query head's accumulator.
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t t = start; t < end;) {
    const int64_t block = table[t / block_size];
    const int64_t off = t % block_size;
    const int64_t stop = std::min(end, t + (block_size - off));
    const T* v = kv_layer + block * block_stride + kv_stride + off * dim;
    if (stop < end) {
      prefetch_rows(kv_layer + table[stop / block_size] * block_stride + kv_stride, head_stride);
    }
    for (int64_t u = t; u < stop; ++u, v += dim) {
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * n + (u - start)];
        float* ag = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ag[d] += p * to_float(v[d]);
      }
    }
    t = stop;
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<T>(acc[g * dim + d]);
}

template <typename T, int64_t kDim>
void run(const at::Tensor& q, const at::Tensor& kv, int64_t layer, const at::Tensor& tables,
         const at::Tensor& lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t num_layers = kv.size(1), kv_heads = kv.size(3), block_size = kv.size(4);
  const int64_t group = num_heads / kv_heads;
  const int64_t head_stride = block_size * dim;             // one head of one block
  const int64_t kv_stride = kv_heads * head_stride;         // K -> V
  const int64_t layer_stride = 2 * kv_stride;
  const int64_t block_stride = num_layers * layer_stride;
  const T* q_ptr = q.data_ptr<T>();
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const T* kv_ptr = kv.data_ptr<T>() + layer * layer_stride;
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t table_stride = tables.stride(0);
  const int64_t* lens_ptr = lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      const int64_t len = lens_ptr[s];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      decode_one<T, kDim>(q_ptr + s * q_seq_stride + h * group * q_head_stride, q_head_stride,
                          kv_ptr + h * head_stride, block_stride, kv_stride, head_stride,
                          table_ptr + s * table_stride, block_size, start, len, group, dim,
                          static_cast<float>(scale), out_ptr + (s * num_heads + h * group) * dim,
                          scratch);
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& kv, int64_t layer, const at::Tensor& tables,
                  const at::Tensor& lens, double scale, int64_t window, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return run<T, 64>(q, kv, layer, tables, lens, scale, window, out);
    case 128: return run<T, 128>(q, kv, layer, tables, lens, scale, window, out);
    default: return run<T, 0>(q, kv, layer, tables, lens, scale, window, out);
  }
}

}  // namespace

// q [S, heads, d] (rows may be strided; heads and d contiguous), kv the whole pool,
// block_tables [S, >= ceil(len / block_size)] int64, context_lens [S] int64 (> 0),
// window: keys kept per query (0: all). Returns [S, heads * d].
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 6, "q [S, heads, d] and kv [blocks, layers, 2, kv_heads, bs, d]");
  TORCH_CHECK(kv.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q's heads and d must be contiguous");
  TORCH_CHECK(q.size(2) == kv.size(5) && q.size(1) % kv.size(3) == 0, "head shapes disagree");
  TORCH_CHECK(0 <= layer && layer < kv.size(1), "layer out of range");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  block_tables.stride(1) == 1 && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0),
              "one block table row and one length per sequence");
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    dispatch_dim<float>(q, kv, layer, block_tables, context_lens, scale, window, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_dim<c10::BFloat16>(q, kv, layer, block_tables, context_lens, scale, window, out);
  } else {
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace baton
