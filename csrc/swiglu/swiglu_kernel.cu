// Fused SwiGLU: out = silu(gate) * up, forward and backward, fp32 math.
//
// Rounding mirrors the torch expression `F.silu(g) * u` in the storage type T (silu's
// result is a T tensor before the product), so bf16 outputs match torch's bit for bit in
// almost all elements. Backward, with s = sigmoid(g), a = round_T(g*s) (the saved silu):
//   d_up   = round_T(grad * a)
//   d_gate = round_T(round_T(grad * up) * s * (1 + g * (1 - s)))   (torch's silu_backward)
// Memory bound: forward reads 2 and writes 1 tensor, backward reads 3 and writes 2.
// gate/up/grads may be column slices of a packed (rows, 2*cols) tensor (row strides).
#include "megablu_common.cuh"
#include "megablu_ops.h"

namespace megablu {
namespace {

__device__ __forceinline__ float sigmoidf_(float g) { return 1.f / (1.f + expf(-g)); }

// (row, first column) of vector `idx`; 32-bit division when the range allows (a 64-bit
// division is ~100 instructions, comparable to the memory time of the 48 bytes it serves).
__device__ __forceinline__ void row_col(int64_t idx, int64_t cv, int64_t total, int vec, int64_t& row, int64_t& c) {
  if (total <= 0xffffffffll) {
    const uint32_t i = static_cast<uint32_t>(idx), n = static_cast<uint32_t>(cv);
    const uint32_t r = i / n;
    row = r;
    c = static_cast<int64_t>(i - r * n) * vec;
  } else {
    row = idx / cv;
    c = (idx - row * cv) * vec;
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(256) swiglu_fwd_kernel(SwigluFwdArgs a) {
  const int64_t cv = a.cols / VEC;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = a.rows * cv;
  if (idx >= total) return;
  int64_t row, c;
  row_col(idx, cv, total, VEC, row, c);
  const Vec<T, VEC> g = load_vec<T, VEC>(static_cast<const T*>(a.gate) + row * a.gate_rs + c);
  const Vec<T, VEC> u = load_vec<T, VEC>(static_cast<const T*>(a.up) + row * a.up_rs + c);
  Vec<T, VEC> o;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float gf = to_f(g.v[e]);
    o.v[e] = from_f<T>(round_to<T>(gf * sigmoidf_(gf)) * to_f(u.v[e]));
  }
  store_vec<T, VEC>(static_cast<T*>(a.out) + row * a.cols + c, o);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(256) swiglu_bwd_kernel(SwigluBwdArgs a) {
  const int64_t cv = a.cols / VEC;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = a.rows * cv;
  if (idx >= total) return;
  int64_t row, c;
  row_col(idx, cv, total, VEC, row, c);
  const Vec<T, VEC> go = load_vec<T, VEC>(static_cast<const T*>(a.grad) + row * a.grad_rs + c);
  const Vec<T, VEC> g = load_vec<T, VEC>(static_cast<const T*>(a.gate) + row * a.gate_rs + c);
  const Vec<T, VEC> u = load_vec<T, VEC>(static_cast<const T*>(a.up) + row * a.up_rs + c);
  Vec<T, VEC> dg, du;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float gf = to_f(g.v[e]), gof = to_f(go.v[e]);
    const float s = sigmoidf_(gf);
    du.v[e] = from_f<T>(gof * round_to<T>(gf * s));
    dg.v[e] = from_f<T>(round_to<T>(gof * to_f(u.v[e])) * (s * (1.f + gf * (1.f - s))));
  }
  store_vec<T, VEC>(static_cast<T*>(a.d_gate) + row * a.dgate_rs + c, dg);
  store_vec<T, VEC>(static_cast<T*>(a.d_up) + row * a.dup_rs + c, du);
}

// Launchers. Left out when tests/ops/emulator compiles the kernels above as host code
// (MEGABLU_HOST_EMULATION) to run their exact index and rounding logic on a CPU.
#ifndef MEGABLU_HOST_EMULATION
// KERNEL<T, vec> for the vector width the binding picked (8 only for 2-byte types: 16 B)
#define MEGABLU_SWIGLU_LAUNCH(KERNEL)                                                   \
  const int64_t total = a.rows * (a.cols / a.vec);                                      \
  if (total == 0) return cudaSuccess;                                                   \
  const int threads = 256;                                                              \
  const int64_t blocks = (total + threads - 1) / threads;                               \
  switch (a.vec) {                                                                      \
    case 8:                                                                             \
      if constexpr (sizeof(T) == 2) {                                                   \
        KERNEL<T, 8><<<blocks, threads, 0, s>>>(a);                                     \
        break;                                                                          \
      }                                                                                 \
      return cudaErrorInvalidValue;                                                     \
    case 4: KERNEL<T, 4><<<blocks, threads, 0, s>>>(a); break;                          \
    case 2: KERNEL<T, 2><<<blocks, threads, 0, s>>>(a); break;                          \
    case 1: KERNEL<T, 1><<<blocks, threads, 0, s>>>(a); break;                          \
    default: return cudaErrorInvalidValue;                                              \
  }                                                                                     \
  return cudaGetLastError();

template <typename T>
cudaError_t fwd_typed(const SwigluFwdArgs& a, cudaStream_t s) {
  MEGABLU_SWIGLU_LAUNCH(swiglu_fwd_kernel)
}

template <typename T>
cudaError_t bwd_typed(const SwigluBwdArgs& a, cudaStream_t s) {
  MEGABLU_SWIGLU_LAUNCH(swiglu_bwd_kernel)
}

}  // namespace

cudaError_t swiglu_fwd_launch(const SwigluFwdArgs& a, cudaStream_t s) {
  switch (a.dtype) {
    case DType::F32: return fwd_typed<float>(a, s);
    case DType::F16: return cudaErrorInvalidValue;   // not built: megablu trains in bf16
    case DType::BF16: return fwd_typed<__nv_bfloat16>(a, s);
  }
  return cudaErrorInvalidValue;
}

cudaError_t swiglu_bwd_launch(const SwigluBwdArgs& a, cudaStream_t s) {
  switch (a.dtype) {
    case DType::F32: return bwd_typed<float>(a, s);
    case DType::F16: return cudaErrorInvalidValue;
    case DType::BF16: return bwd_typed<__nv_bfloat16>(a, s);
  }
  return cudaErrorInvalidValue;
}

#else
}  // namespace
#endif

}  // namespace megablu
