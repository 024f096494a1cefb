// What our kernels' ops (group_gemm.cpp, skinny_gemm.cpp) share: torch's stable ABI, an output of x's rows, and
// aten's linear through the dispatcher (for the rows a kernel does not take).
#pragma once
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <array>
#include <vector>

namespace stable_ops {

using torch::stable::Tensor;
using torch::stable::detail::from;

// an uninitialised (..., n) tensor for x (..., K)
inline Tensor rows_out(const Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return torch::stable::new_empty(x, shape);
}

// x @ w.T + bias, aten's (oneDNN's on the CPU)
inline Tensor linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias) {
  std::array<StableIValue, 3> stack{from(x), from(w), from(bias)};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::linear", "", stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<Tensor>(stack[0]);
}

}  // namespace stable_ops
