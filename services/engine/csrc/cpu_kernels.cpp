// The CPU hot path's kernels, registered as torch.ops.baton (services/engine/cpu_kernels.py):
// paged_decode (paged_decode.cpp), paged_prefill_ (paged_prefill.cpp), and here rms_norm
// and rotary_write_. Built by services/engine/cpu_kernels.py.
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace baton {
namespace {

// RMSNorm over the last dim of a contiguous [rows, dim] x, in one pass per row: what
// model.rms_norm spells out in six torch ops (each a pass and a dispatch). Float32
// throughout; for bfloat16, the normalised row is rounded to bfloat16 before the weight,
// as Hugging Face does.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      T* yr = out + r * dim;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < dim; ++d) ss += to_float(xr[d]) * to_float(xr[d]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      for (int64_t d = 0; d < dim; ++d) {
        const T normed = static_cast<T>(to_float(xr[d]) * inv);
        yr[d] = static_cast<T>(to_float(w[d]) * to_float(normed));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && weight.is_contiguous(),
              "rms_norm takes contiguous CPU tensors");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.numel() == dim, "weight must match the last dim");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = dim == 0 ? 0 : x.numel() / dim;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, dim,
                  static_cast<float>(eps));
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                  out.data_ptr<c10::BFloat16>(), rows, dim, static_cast<float>(eps));
  } else {
    TORCH_CHECK(false, "rms_norm supports float32 and bfloat16, not ", x.scalar_type());
  }
  return out;
}

// RoPE (half-split convention: x * cos + roll(x) * signed_sin, as rope.apply_rotary) on
// q and k heads in place, then k and v stored at their pool slots: kv[slot / bs, layer,
// 0 or 1, head, slot % bs]. qk [T, heads + kv_heads, d] rows may be strided (a view of
// the fused qkv product), heads and d contiguous; v likewise; cos / sin [T, d].
template <typename T>
void rotary_write_rows(T* qk, int64_t qk_row, const T* v, int64_t v_row, const T* cos,
                       const T* sin, T* kv, const int64_t* slots, int64_t tokens, int64_t heads,
                       int64_t kv_heads, int64_t dim, int64_t layer, int64_t layers,
                       int64_t block_size) {
  const int64_t half = dim / 2;
  const int64_t head_stride = block_size * dim;
  const int64_t kv_stride = kv_heads * head_stride;
  const int64_t block_stride = layers * 2 * kv_stride;
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<T> x(static_cast<size_t>(dim));
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      const int64_t slot = slots[t];
      T* dst = kv + (slot / block_size) * block_stride + layer * 2 * kv_stride +
               (slot % block_size) * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* row = qk + t * qk_row + h * dim;
        std::copy(row, row + dim, x.begin());
        for (int64_t d = 0; d < dim; ++d) {
          const float rolled = to_float(x[d < half ? d + half : d - half]);
          // Rounded as torch rounds x * cos before its addcmul (bfloat16).
          const float xc = to_float(static_cast<T>(to_float(x[d]) * to_float(c[d])));
          row[d] = static_cast<T>(xc + rolled * to_float(s[d]));
        }
        if (h >= heads) std::copy(row, row + dim, dst + (h - heads) * head_stride);
      }
      const T* vt = v + t * v_row;
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::copy(vt + h * dim, vt + (h + 1) * dim, dst + kv_stride + h * head_stride);
      }
    }
  });
}

void rotary_write_(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor& kv, int64_t layer, const at::Tensor& slots) {
  TORCH_CHECK(qk.device().is_cpu() && kv.is_contiguous() && kv.dim() == 6, "CPU qk and pool");
  TORCH_CHECK(qk.dim() == 3 && v.dim() == 3 && qk.size(0) == v.size(0), "qk and v [T, heads, d]");
  const int64_t tokens = qk.size(0), dim = qk.size(2), kv_heads = kv.size(3);
  TORCH_CHECK(qk.stride(2) == 1 && qk.stride(1) == dim && v.stride(2) == 1 && v.stride(1) == dim,
              "heads and d of qk and v must be contiguous");
  TORCH_CHECK(v.size(1) == kv_heads && kv.size(5) == dim && dim % 2 == 0, "head shapes disagree");
  TORCH_CHECK(qk.size(1) > kv_heads && 0 <= layer && layer < kv.size(1), "bad heads or layer");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * dim &&
                  sin.numel() == tokens * dim, "cos and sin [T, d], contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "slots [T] int64");
  const auto dtype = qk.scalar_type();
  TORCH_CHECK(v.scalar_type() == dtype && cos.scalar_type() == dtype &&
                  sin.scalar_type() == dtype && kv.scalar_type() == dtype,
              "qk, v, cos, sin and the pool must share a dtype");
  const int64_t heads = qk.size(1) - kv_heads;
  if (dtype == at::kFloat) {
    rotary_write_rows(qk.data_ptr<float>(), qk.stride(0), v.data_ptr<float>(), v.stride(0),
                      cos.data_ptr<float>(), sin.data_ptr<float>(), kv.data_ptr<float>(),
                      slots.data_ptr<int64_t>(), tokens, heads, kv_heads, dim, layer, kv.size(1),
                      kv.size(4));
  } else if (dtype == at::kBFloat16) {
    using B = c10::BFloat16;
    rotary_write_rows(qk.data_ptr<B>(), qk.stride(0), v.data_ptr<B>(), v.stride(0),
                      cos.data_ptr<B>(), sin.data_ptr<B>(), kv.data_ptr<B>(),
                      slots.data_ptr<int64_t>(), tokens, heads, kv_heads, dim, layer, kv.size(1),
                      kv.size(4));
  } else {
    TORCH_CHECK(false, "rotary_write_ supports float32 and bfloat16, not ", dtype);
  }
}

}  // namespace
}  // namespace baton

TORCH_LIBRARY(baton, m) {
  m.def("paged_decode(Tensor q, Tensor kv, int layer, Tensor block_tables, Tensor context_lens, float scale, int window) -> Tensor");
  m.def("paged_prefill_(Tensor q, Tensor kv, int layer, Tensor block_tables, Tensor query_starts, Tensor query_lens, Tensor context_lens, float scale, int window, Tensor(a!) out) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_write_(Tensor(a!) qk, Tensor v, Tensor cos, Tensor sin, Tensor(b!) kv, int layer, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("paged_decode", &baton::paged_decode);
  m.impl("paged_prefill_", &baton::paged_prefill_);
  m.impl("rms_norm", &baton::rms_norm);
  m.impl("rotary_write_", &baton::rotary_write_);
}
