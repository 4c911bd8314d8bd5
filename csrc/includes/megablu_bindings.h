// Torch-facing entry points of the megablu extension (one per op direction). Each checks
// devices/dtypes/layouts, picks the vector width, allocates outputs and calls a launcher
// from megablu_ops.h on the current CUDA stream. Registered in csrc/megablu_ops.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

#include "megablu_msg.h"
#include "megablu_ops.h"

namespace megablu {

// q (B, T, H, D), k (B, T, Hkv, D), cos/sin (B|1, T, D): returns {q', k'} contiguous.
std::vector<at::Tensor> rope_apply(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                   const at::Tensor& sin, bool backward);

// x, residual (rows, d) contiguous, weight (d,): returns {y, r, rstd (rows,) fp32};
// r is x itself when residual is None.
std::vector<at::Tensor> rmsnorm_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                    const at::Tensor& weight, double eps);
// returns {dr (rows, d), dw (d,) in weight's dtype}. path: -1 MEGABLU_RMS_BWD_ASYNC or auto,
// 0 the register path, 1 the cp.async one (both give the same bits; tests compare them).
std::vector<at::Tensor> rmsnorm_bwd(const at::Tensor& gy, const c10::optional<at::Tensor>& g_res,
                                    const at::Tensor& r, const at::Tensor& weight, const at::Tensor& rstd,
                                    int64_t path);

// gate, up (rows, cols) with unit column stride: returns out (rows, cols) contiguous.
at::Tensor swiglu_fwd(const at::Tensor& gate, const at::Tensor& up);
// packed=false: {d_gate, d_up}; packed=true: {d_gate_up (rows, 2*cols)}.
std::vector<at::Tensor> swiglu_bwd(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,
                                   bool packed);

// ---- helpers shared by the bindings ----

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    // float16 is not instantiated (megablu trains in bf16; it would cost a third more
    // compile time): the Python dispatch sends it to the torch reference
    default: MEGABLU_CHECK(false, "megablu ops: unsupported dtype ", t, " (float32 and bfloat16 only)");
  }
  return DType::F32;
}

inline void check_launch(cudaError_t err, const char* what) {
  MEGABLU_CHECK(err == cudaSuccess, "megablu ", what, " launch failed: ", cudaGetErrorString(err));
}

// Largest v in {max_vec, max_vec/2, ..., 1} dividing every value in `divisible` and keeping
// every pointer in `ptrs` (with its element size) aligned to v elements.
inline int pick_vec(int max_vec, std::initializer_list<int64_t> divisible,
                    std::initializer_list<std::pair<const void*, int64_t>> ptrs) {
  for (int v = max_vec; v > 1; v /= 2) {
    bool ok = true;
    for (int64_t x : divisible) ok = ok && (x % v == 0);
    for (auto& p : ptrs) ok = ok && (reinterpret_cast<uintptr_t>(p.first) % (v * p.second) == 0);
    if (ok) return v;
  }
  return 1;
}

}  // namespace megablu
