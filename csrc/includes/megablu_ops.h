// Host-side launcher declarations shared by the torch bindings (*.cpp) and the kernels (*.cu).
// Plain C++ + the CUDA runtime API only: pointers, sizes, strides in elements, a stream.
// Every launcher returns the launch's cudaError_t; the binding turns it into a Python error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
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
  bool async_stages;   // the path, from rmsnorm_bwd_pick: rows staged by cp.async, else registers
};
cudaError_t rmsnorm_bwd_launch(const RmsNormBwdArgs& a, cudaStream_t stream);
// Grid size (= rows of dw_partial) for rmsnorm_bwd_launch: enough blocks to fill the GPU
// at the kernel's occupancy, never more than there are row groups; 0 when the chosen path's
// shared memory cannot be had. Reads a.rows/d/dtype/vpt/async_stages.
int rmsnorm_bwd_grid(const RmsNormBwdArgs& a);

// The backward's two paths give the same bits (csrc/rmsnorm/rmsnorm_kernel.cu says how they
// differ). Dynamic shared memory per block of one path, in bytes.
size_t rmsnorm_bwd_smem(int64_t d, DType dtype, bool async);
// MEGABLU_RMS_BWD_ASYNC as read once per process: -1 unset, empty or "auto"; 0 or 1 as set
// (force registers / force the cp.async stages); -2 any other value (the binding's error).
int rmsnorm_bwd_async_env();
// The path for rows of d on a device of compute capability cc_major.x that gives a block at
// most smem_optin bytes of shared memory (cudaDevAttrMaxSharedMemoryPerBlockOptin):
// force -1 (auto) -> 1 (async) where the device has cp.async (sm_80+) and the stages fit,
// else 0 (registers); force 0 -> 0; force 1 -> 1 where it fits, else -1 (cannot run here).
int rmsnorm_bwd_pick(int64_t d, DType dtype, int force, int cc_major, int smem_optin);

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
