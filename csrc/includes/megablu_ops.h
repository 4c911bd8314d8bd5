// Host-side launcher declarations shared by the torch bindings (*.cpp) and the kernels (*.cu).
// Plain C++ + the CUDA runtime API only: pointers, sizes, strides in elements, a stream.
// Every launcher returns the launch's cudaError_t; the binding turns it into a Python error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megablu {

// Storage dtypes; the kernels are instantiated for F32 and BF16 (F16 launches return
// cudaErrorInvalidValue). The bindings map torch dtypes onto these.
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// ---- RoPE --------------------------------------------------------------------------------
// One launch rotates q (B, T, H, D) and k (B, T, Hkv, D) with a cos/sin table (B|1, T, D).
// Inputs may be strided in B/T/H (last dim contiguous); outputs are contiguous.
// backward=true applies the transposed rotation (grad in, grad out).
struct RopeArgs {
  const void* q; const void* k; void* out_q; void* out_k;
  const void* cos; const void* sin;
  int64_t B, T, H, Hkv, D;
  int64_t q_sb, q_st, q_sh;   // q strides (elements) for B, T, H
  int64_t k_sb, k_st, k_sh;
  int64_t c_sb, c_st;         // cos strides for B (0 when broadcast), T
  int64_t s_sb, s_st;         // sin strides
  DType dtype;                // q, k, outputs
  bool table_f32;             // cos/sin are fp32 (else same dtype as q)
  int vec;                    // elements per vector access (1, 2, 4 or 8), chosen by the binding
  bool backward;
};
cudaError_t rope_launch(const RopeArgs& a, cudaStream_t stream);

// ---- residual add + RMSNorm --------------------------------------------------------------
// rows x d; r = x + residual (when residual != nullptr), y = w * round(r * rstd(r)).
struct RmsNormFwdArgs {
  const void* x; const void* residual; const void* weight;
  void* y; void* r_out; float* rstd;
  int64_t rows; int64_t d; float eps;
  DType dtype; int vec; int vpt;   // vpt: vectors per lane (a warp owns one row)
};
cudaError_t rmsnorm_fwd_launch(const RmsNormFwdArgs& a, cudaStream_t stream);

// dr = rstd * (w*gy - xhat * mean(w*gy*xhat)) + g_res; dw_partial[block, d] (fp32) is
// reduced by the caller. g_res may be nullptr.
struct RmsNormBwdArgs {
  const void* gy; const void* g_res; const void* r; const void* weight; const float* rstd;
  void* dr; float* dw_partial;
  int64_t rows; int64_t d; int blocks;
  DType dtype; int vec; int vpt;
};
cudaError_t rmsnorm_bwd_launch(const RmsNormBwdArgs& a, cudaStream_t stream);
// Grid size (= rows of dw_partial) for rmsnorm_bwd_launch: enough blocks to fill the GPU
// at the kernel's occupancy, never more than there are row groups. Reads a.rows/d/dtype/vpt.
int rmsnorm_bwd_grid(const RmsNormBwdArgs& a);
constexpr int kRmsNormWarps = 8;   // rows (warps) per block

// ---- SwiGLU ------------------------------------------------------------------------------
// out (rows, cols) contiguous = silu(gate) * up; gate/up row strides allow a packed
// (rows, 2*cols) gate_up tensor.
struct SwigluFwdArgs {
  const void* gate; const void* up; void* out;
  int64_t rows, cols, gate_rs, up_rs;
  DType dtype; int vec;
};
cudaError_t swiglu_fwd_launch(const SwigluFwdArgs& a, cudaStream_t stream);

struct SwigluBwdArgs {
  const void* grad; const void* gate; const void* up; void* d_gate; void* d_up;
  int64_t rows, cols, grad_rs, gate_rs, up_rs, dgate_rs, dup_rs;
  DType dtype; int vec;
};
cudaError_t swiglu_bwd_launch(const SwigluBwdArgs& a, cudaStream_t stream);

}  // namespace megablu
