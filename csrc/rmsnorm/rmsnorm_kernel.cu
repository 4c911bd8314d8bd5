// Fused residual add + RMSNorm, forward and backward. fp32 accumulation, bf16/fp32 I/O.
//
// Forward, per row of d (HF LlamaRMSNorm order, with the residual add of the block):
//   r    = round_T(x + residual)                 (the new residual stream, as `h = x + a`)
//   rstd = rsqrt(mean(r^2) + eps)                (fp32, saved for backward: 4 B per row)
//   y    = round_T(w * round_T(r * rstd))        (HF casts the normalised x before * w)
// Backward, with xhat = r * rstd, gw = w * gy (fp32):
//   dr = rstd * (gw - xhat * mean(gw * xhat)) + g_r          (g_r: grad of the residual out)
//   dw = sum_rows gy * round_T(xhat)                          (fp32 partials per block)
// dr is the gradient of both x and residual (r = x + residual).
//
// Layout: one warp owns one row; lane l holds vectors l, l+32, ... (VPT of them, VEC
// elements each) in registers, so a row is read once and the sum of squares is a warp
// shuffle reduction (no shared memory, no block barrier) in the forward.
#include "megablu_common.cuh"
#include "megablu_ops.h"

#include <cstdlib>
#include <cstring>

namespace megablu {
namespace {

constexpr int kWarps = kRmsNormWarps;

template <typename T, int VEC, int VPT>
__global__ void __launch_bounds__(kWarps * 32) rmsnorm_fwd_kernel(RmsNormFwdArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= a.rows) return;
  const int64_t nvec = a.d / VEC;
  // __restrict__: outputs never alias inputs, so loads may be hoisted above stores
  const T* __restrict__ x = static_cast<const T*>(a.x) + row * a.d;
  const T* __restrict__ res = a.residual ? static_cast<const T*>(a.residual) + row * a.d : nullptr;
  const T* __restrict__ w = static_cast<const T*>(a.weight);

  // all of the row's loads first (one memory round trip), then the sum and the r stores
  Vec<T, VEC> xv[VPT], rv[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t j = lane + 32 * i;
    if (j < nvec) {
      xv[i] = load_vec<T, VEC>(x + j * VEC);
      if (res) rv[i] = load_vec<T, VEC>(res + j * VEC);
    }
  }
  float r[VPT][VEC];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t j = lane + 32 * i;
    if (j < nvec) {
      if (res) {
        Vec<T, VEC> out;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          out.v[e] = from_f<T>(to_f(xv[i].v[e]) + to_f(rv[i].v[e]));   // torch's add in T
          r[i][e] = to_f(out.v[e]);
        }
        store_vec<T, VEC>(static_cast<T*>(a.r_out) + row * a.d + j * VEC, out);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) r[i][e] = to_f(xv[i].v[e]);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) ss += r[i][e] * r[i][e];
    }
  }
  ss = warp_sum(ss);
  const float rstd = rsqrtf(ss / static_cast<float>(a.d) + a.eps);
  if (lane == 0) a.rstd[row] = rstd;

  T* __restrict__ y = static_cast<T*>(a.y) + row * a.d;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t j = lane + 32 * i;
    if (j < nvec) {
      const Vec<T, VEC> wv = load_vec<T, VEC>(w + j * VEC);
      Vec<T, VEC> out;
#pragma unroll
      for (int e = 0; e < VEC; ++e) out.v[e] = from_f<T>(to_f(wv.v[e]) * round_to<T>(r[i][e] * rstd));
      store_vec<T, VEC>(y + j * VEC, out);
    }
  }
}

// Grid-stride over rows (a warp at a time). A lane owns the same columns in every row its
// warp takes (vectors lane, lane+32, ...), so it sums its share of dw in registers across
// all those rows; at the end the block's warps add their sums into shared memory in turn
// (one barrier per warp, no atomics) and the block writes one fp32 row of dw_partial.
//
// What has been measured on the H200 (bf16, d=1024, experiments/speed/LOG.md):
// - An earlier form added to shared memory per element per row with atomicAdd; on sm_90 a
//   float atomicAdd to shared memory is a CAS spin loop (ATOMS.CAST.SPIN). Removing them
//   made dw bitwise deterministic but left the kernel at 58% / 63% of HBM (32k / 128k rows).
// - The time is the rows' memory round trips: a row's dr needs the row's dot product, so a
//   warp's next loads wait for its current row, and with the dw sums in registers (128 a
//   lane) 16 warps fit on an SM. Prefetching the next row into L2, and loading grad_r with
//   gy and r (16 more registers, spills), both made it slower (44-60%).
// ASYNC = true stages rows through shared memory with cp.async instead: each warp has the
// NEXT row's gy, r and grad_r in flight (no registers held) while it works on the current
// one from shared memory, reading it twice rather than keeping it in registers. Each lane
// copies and later reads only its own vectors, so no barrier is needed between. Measured on
// an H100 (bf16, d=1024): 86-93% of HBM against the register path's 72-76%, bitwise equal.
// Per block it needs kWarps x 2 stages x 3 rows of d in T beside the dw sums (100 KB for bf16
// d=1024, 200 KB at d=2048): more than some GPUs give a block (A100: 163 KB), so both paths
// are built and the binding (rmsnorm.cpp) chooses per call with rmsnorm_bwd_pick (end of
// this file): the stages where the device's opt-in shared memory per block holds them and
// it has cp.async (sm_80+), else registers. MEGABLU_RMS_BWD_ASYNC=0/1 in the environment
// forces either (bench/rmsnorm_bwd_variants.py). Both are instantiated for every arch the
// extension is built for (TORCH_CUDA_ARCH_LIST or the visible GPUs, so possibly below
// sm_80): there cp_async16 is a plain copy (megablu_common.cuh) and the path is never picked.

// dynamic shared memory of the backward: the dw sums (fp32 d) + the async path's stages
template <typename T>
inline size_t bwd_smem(int64_t d, bool async) {
  return sizeof(float) * d + (async ? sizeof(T) * kWarps * 2 * 3 * d : 0);
}

template <typename T, int VEC, int VPT, bool ASYNC>
__global__ void __launch_bounds__(kWarps * 32, (VPT <= 4 ? 2 : 1)) rmsnorm_bwd_kernel(RmsNormBwdArgs a) {
  extern __shared__ float dw_smem[];   // (VEC, d / VEC): column j*VEC+e at e*nvec + j
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t nvec = a.d / VEC;
  const T* __restrict__ w = static_cast<const T*>(a.weight);
  const float inv_d = 1.f / static_cast<float>(a.d);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  float dw[VPT][VEC];
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int e = 0; e < VEC; ++e) dw[i][e] = 0.f;

  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  // ASYNC: this warp's two stages, each gy | r | grad_r of one row
  T* const stages = reinterpret_cast<T*>(dw_smem + a.d) + static_cast<int64_t>(warp) * 2 * 3 * a.d;
  auto issue = [&](int64_t row, int stage) {   // the row's copies, as one group (empty past the end)
    if (row < a.rows) {
      T* s = stages + stage * 3 * a.d;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int64_t j = lane + 32 * i;
        if (j < nvec) {
          cp_async16(s + j * VEC, static_cast<const T*>(a.gy) + row * a.d + j * VEC);
          cp_async16(s + a.d + j * VEC, static_cast<const T*>(a.r) + row * a.d + j * VEC);
          if (a.g_res) cp_async16(s + 2 * a.d + j * VEC, static_cast<const T*>(a.g_res) + row * a.d + j * VEC);
        }
      }
    }
    cp_async_commit();
  };
  int stage = 0;
  if constexpr (ASYNC) issue(first, 0);
  for (int64_t row = first; row < a.rows; row += stride) {
    if constexpr (ASYNC) {
      issue(row + stride, stage ^ 1);   // the next row flies while this one is computed
      cp_async_wait<1>();               // this row's group has landed
    }
    // the row's gy | r | grad_r: this warp's stage in shared memory (ASYNC), else global memory
    const T* __restrict__ gy = ASYNC ? stages + stage * 3 * a.d : static_cast<const T*>(a.gy) + row * a.d;
    const T* __restrict__ rr = ASYNC ? gy + a.d : static_cast<const T*>(a.r) + row * a.d;
    const T* __restrict__ gres =
        !a.g_res ? nullptr : ASYNC ? gy + 2 * a.d : static_cast<const T*>(a.g_res) + row * a.d;
    if constexpr (ASYNC) stage ^= 1;
    const float rstd = a.rstd[row];
    float dot = 0.f;   // sum over the row of (w*gy) * xhat
    Vec<T, VEC> gv[VPT], rv[VPT];   // the register path keeps the row here for the second pass
    if constexpr (ASYNC) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int64_t j = lane + 32 * i;
        if (j < nvec) {
          const Vec<T, VEC> g1 = load_vec<T, VEC>(gy + j * VEC), r1 = load_vec<T, VEC>(rr + j * VEC);
          const Vec<T, VEC> wv = load_vec<T, VEC>(w + j * VEC);
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot += to_f(g1.v[e]) * to_f(wv.v[e]) * (to_f(r1.v[e]) * rstd);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int64_t j = lane + 32 * i;
        if (j < nvec) {
          gv[i] = load_vec<T, VEC>(gy + j * VEC);
          rv[i] = load_vec<T, VEC>(rr + j * VEC);
          const Vec<T, VEC> wv = load_vec<T, VEC>(w + j * VEC);
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot += to_f(gv[i].v[e]) * to_f(wv.v[e]) * (to_f(rv[i].v[e]) * rstd);
        }
      }
    }
    const float mean_dot = warp_sum(dot) * inv_d;
    T* __restrict__ dr = static_cast<T*>(a.dr) + row * a.d;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t j = lane + 32 * i;
      if (j < nvec) {
        // ASYNC reads the row from its stage a second time instead of holding it
        const Vec<T, VEC> gvi = ASYNC ? load_vec<T, VEC>(gy + j * VEC) : gv[i];
        const Vec<T, VEC> rvi = ASYNC ? load_vec<T, VEC>(rr + j * VEC) : rv[i];
        const Vec<T, VEC> wv = load_vec<T, VEC>(w + j * VEC);
        Vec<T, VEC> ev;
        if (gres) ev = load_vec<T, VEC>(gres + j * VEC);
        Vec<T, VEC> out;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float g = to_f(gvi.v[e]);
          const float xh = to_f(rvi.v[e]) * rstd;
          const float extra = gres ? to_f(ev.v[e]) : 0.f;
          dw[i][e] += g * round_to<T>(xh);
          out.v[e] = from_f<T>(rstd * (g * to_f(wv.v[e]) - xh * mean_dot) + extra);
        }
        store_vec<T, VEC>(dr + j * VEC, out);
      }
    }
  }
  if constexpr (ASYNC) cp_async_wait<0>();

  // the warps' sums into shared memory, warp 0 first (it writes every column: lanes x VPT
  // cover all nvec vectors), then each next warp adds; element-major layout (e * nvec + j)
  // keeps a warp's 32 lanes on consecutive banks
  for (int turn = 0; turn < kWarps; ++turn) {
    if (warp == turn) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int64_t j = lane + 32 * i;
        if (j < nvec) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            float* slot = &dw_smem[e * nvec + j];
            *slot = (turn == 0 ? 0.f : *slot) + dw[i][e];
          }
        }
      }
    }
    __syncthreads();
  }
  float* out = a.dw_partial + static_cast<int64_t>(blockIdx.x) * a.d;
  for (int64_t c = threadIdx.x; c < a.d; c += blockDim.x) out[c] = dw_smem[(c % VEC) * nvec + c / VEC];
}

// Launchers. Left out when tests/ops/emulator compiles the kernels above as host code
// (MEGABLU_HOST_EMULATION) to run their exact index and rounding logic on a CPU.
#ifndef MEGABLU_HOST_EMULATION
// vpt is rounded up by the binding to one of the instantiated values below.
#define MEGABLU_RMS_VPT(KERNEL, T, VEC, ...)                                   \
  switch (a.vpt) {                                                             \
    case 1: KERNEL<T, VEC, 1><<<__VA_ARGS__>>>(a); break;                      \
    case 2: KERNEL<T, VEC, 2><<<__VA_ARGS__>>>(a); break;                      \
    case 3: KERNEL<T, VEC, 3><<<__VA_ARGS__>>>(a); break;                      \
    case 4: KERNEL<T, VEC, 4><<<__VA_ARGS__>>>(a); break;                      \
    case 6: KERNEL<T, VEC, 6><<<__VA_ARGS__>>>(a); break;                      \
    case 8: KERNEL<T, VEC, 8><<<__VA_ARGS__>>>(a); break;                      \
    default: return cudaErrorInvalidValue;                                     \
  }

template <typename T>
cudaError_t fwd_typed(const RmsNormFwdArgs& a, cudaStream_t s) {
  if (a.rows == 0) return cudaSuccess;
  const int64_t blocks = (a.rows + kWarps - 1) / kWarps;
  constexpr int V = 16 / sizeof(T);
  if (a.vec == V) {
    MEGABLU_RMS_VPT(rmsnorm_fwd_kernel, T, V, blocks, kWarps * 32, 0, s)
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// The backward kernel for a.vpt and a.async_stages, or nullptr when not instantiated.
using BwdKernel = void (*)(RmsNormBwdArgs);
template <typename T, bool ASYNC>
BwdKernel bwd_kernel_vpt(int vpt) {
  constexpr int V = 16 / sizeof(T);
  switch (vpt) {
    case 1: return rmsnorm_bwd_kernel<T, V, 1, ASYNC>;
    case 2: return rmsnorm_bwd_kernel<T, V, 2, ASYNC>;
    case 3: return rmsnorm_bwd_kernel<T, V, 3, ASYNC>;
    case 4: return rmsnorm_bwd_kernel<T, V, 4, ASYNC>;
    case 6: return rmsnorm_bwd_kernel<T, V, 6, ASYNC>;
    case 8: return rmsnorm_bwd_kernel<T, V, 8, ASYNC>;
    default: return nullptr;
  }
}
template <typename T>
BwdKernel bwd_kernel(const RmsNormBwdArgs& a) {
  if (a.vec != 16 / static_cast<int>(sizeof(T))) return nullptr;
  return a.async_stages ? bwd_kernel_vpt<T, true>(a.vpt) : bwd_kernel_vpt<T, false>(a.vpt);
}

template <typename T>
cudaError_t bwd_typed(const RmsNormBwdArgs& a, cudaStream_t s) {
  if (a.rows == 0) return cudaSuccess;
  if (a.blocks <= 0) return cudaErrorInvalidConfiguration;   // rmsnorm_bwd_grid found no fit
  const BwdKernel k = bwd_kernel<T>(a);
  if (k == nullptr) return cudaErrorInvalidValue;
  k<<<a.blocks, kWarps * 32, bwd_smem<T>(a.d, a.async_stages), s>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rmsnorm_fwd_launch(const RmsNormFwdArgs& a, cudaStream_t s) {
  switch (a.dtype) {
    case DType::F32: return fwd_typed<float>(a, s);
    case DType::F16: return cudaErrorInvalidValue;   // not built: megablu trains in bf16
    case DType::BF16: return fwd_typed<__nv_bfloat16>(a, s);
  }
  return cudaErrorInvalidValue;
}

namespace {
template <typename T>
int bwd_grid_typed(const RmsNormBwdArgs& a) {
  const BwdKernel k = bwd_kernel<T>(a);
  if (k == nullptr) return 0;
  const void* fn = reinterpret_cast<const void*>(k);
  int dev = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const size_t smem = bwd_smem<T>(a.d, a.async_stages);   // the chosen path's
  // above 48 KB of dynamic shared memory a kernel must opt in; 0 blocks (an error at launch)
  // when the device cannot give it
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kWarps * 32, smem) != cudaSuccess || per_sm <= 0) {
    cudaGetLastError();
    return 0;
  }
  const int64_t need = (a.rows + kWarps - 1) / kWarps;
  const int64_t cap = static_cast<int64_t>(sms) * per_sm;
  return static_cast<int>(need < cap ? need : cap);
}
}  // namespace

int rmsnorm_bwd_grid(const RmsNormBwdArgs& a) {
  switch (a.dtype) {
    case DType::F32: return bwd_grid_typed<float>(a);
    case DType::F16: return 0;
    case DType::BF16: return bwd_grid_typed<__nv_bfloat16>(a);
  }
  return 0;
}

cudaError_t rmsnorm_bwd_launch(const RmsNormBwdArgs& a, cudaStream_t s) {
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

// ---- which backward path (host code; the emulator runs it too) ----------------------------

size_t rmsnorm_bwd_smem(int64_t d, DType dtype, bool async) {
  return dtype == DType::F32 ? bwd_smem<float>(d, async) : bwd_smem<__nv_bfloat16>(d, async);
}

int rmsnorm_bwd_async_env() {
  // read once per process (a launch must not depend on when the variable was changed)
  static const int force = [] {
    const char* v = std::getenv("MEGABLU_RMS_BWD_ASYNC");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return -1;
    if (std::strcmp(v, "0") == 0) return 0;
    if (std::strcmp(v, "1") == 0) return 1;
    return -2;
  }();
  return force;
}

int rmsnorm_bwd_pick(int64_t d, DType dtype, int force, int cc_major, int smem_optin) {
  if (force == 0) return 0;
  const bool fits = cc_major >= 8 && rmsnorm_bwd_smem(d, dtype, true) <= static_cast<size_t>(smem_optin);
  if (fits) return 1;
  return force == 1 ? -1 : 0;
}

}  // namespace megablu
