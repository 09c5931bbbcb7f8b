// What the CPU kernels share: element conversion to float32 and the declarations of
// the ops that cpu_kernels.cpp registers as torch.ops.baton.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace baton {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, int64_t window);

void paged_prefill_(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                    const at::Tensor& block_tables, const at::Tensor& query_starts,
                    const at::Tensor& query_lens, const at::Tensor& context_lens, double scale,
                    int64_t window, at::Tensor& out);

}  // namespace baton
