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
// An earlier form added to shared memory per element per row with atomicAdd; on sm_90 a
// float atomicAdd to shared memory compiles to a CAS spin loop (ATOMS.CAST.SPIN, 32 per lane
// per row for bf16 d=1024). Removing them made dw bitwise deterministic run to run but did
// not move the bandwidth (55% of HBM at 32k rows, 2026-12-03): the time is the rows' memory
// round trips. A row needs its gy and r before the row's dot product, and dr needs that dot
// product, so within a warp one row's loads cannot overlap the next's; with ~128 registers a
// lane (the dw sums) only 16 warps fit on an SM to hide them. Two knobs aimed at that, both
// OFF by default because on the H200 both made it slower (bench/rmsnorm_bwd_variants.py,
// 2026-12-03; kernel % of HBM at 32k / 128k rows, d=1024 bf16):
//   neither: 58% / 63%;  prefetch 1: 55% / 60%;  grad_r early: 55% / 60%;
//   both: 46% / 49%;  prefetch 2 + grad_r early: 44% / 46%.
//   MEGABLU_RMS_BWD_PREFETCH = k: each warp asks L2 for the lines of the row k ahead of the
//     one it works on (gy, r, grad_r; no registers), so its next loads hit L2;
//   MEGABLU_RMS_BWD_GRES_EARLY = 1: grad_r is loaded with gy and r instead of after the dot
//     product; its 16 registers push the kernel from 24 to ~200 bytes of spills.
#ifndef MEGABLU_RMS_BWD_PREFETCH
#define MEGABLU_RMS_BWD_PREFETCH 0
#endif
#ifndef MEGABLU_RMS_BWD_GRES_EARLY
#define MEGABLU_RMS_BWD_GRES_EARLY 0
#endif

// the L2 lines of one row of gy, r and (if any) grad_r, spread over the warp's lanes
template <typename T>
__device__ __forceinline__ void prefetch_row(const RmsNormBwdArgs& a, int64_t row, int lane) {
  const int64_t row_bytes = a.d * static_cast<int64_t>(sizeof(T));
  const int64_t lines = (row_bytes + 127) / 128;
  const int n = a.g_res ? 3 : 2;
  for (int64_t l = lane; l < n * lines; l += 32) {
    const void* base = l < lines ? a.gy : (l < 2 * lines ? a.r : a.g_res);
    prefetch_l2(static_cast<const char*>(base) + row * row_bytes + (l % lines) * 128);
  }
}

template <typename T, int VEC, int VPT>
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
#if MEGABLU_RMS_BWD_PREFETCH > 1
  for (int k = 1; k < MEGABLU_RMS_BWD_PREFETCH; ++k)
    if (first + k * stride < a.rows) prefetch_row<T>(a, first + k * stride, lane);
#endif
  for (int64_t row = first; row < a.rows; row += stride) {
#if MEGABLU_RMS_BWD_PREFETCH > 0
    if (row + MEGABLU_RMS_BWD_PREFETCH * stride < a.rows) prefetch_row<T>(a, row + MEGABLU_RMS_BWD_PREFETCH * stride, lane);
#endif
    const T* __restrict__ gy = static_cast<const T*>(a.gy) + row * a.d;
    const T* __restrict__ rr = static_cast<const T*>(a.r) + row * a.d;
    const float rstd = a.rstd[row];
    const T* __restrict__ gres = a.g_res ? static_cast<const T*>(a.g_res) + row * a.d : nullptr;
    Vec<T, VEC> gv[VPT], rv[VPT];
#if MEGABLU_RMS_BWD_GRES_EARLY
    Vec<T, VEC> ev[VPT];
#endif
    float dot = 0.f;   // sum over the row of (w*gy) * xhat
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t j = lane + 32 * i;
      if (j < nvec) {
        gv[i] = load_vec<T, VEC>(gy + j * VEC);
        rv[i] = load_vec<T, VEC>(rr + j * VEC);
#if MEGABLU_RMS_BWD_GRES_EARLY
        if (gres) ev[i] = load_vec<T, VEC>(gres + j * VEC);
#endif
        const Vec<T, VEC> wv = load_vec<T, VEC>(w + j * VEC);
#pragma unroll
        for (int e = 0; e < VEC; ++e) dot += to_f(gv[i].v[e]) * to_f(wv.v[e]) * (to_f(rv[i].v[e]) * rstd);
      }
    }
    const float mean_dot = warp_sum(dot) * inv_d;
    T* __restrict__ dr = static_cast<T*>(a.dr) + row * a.d;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t j = lane + 32 * i;
      if (j < nvec) {
        const Vec<T, VEC> wv = load_vec<T, VEC>(w + j * VEC);
#if MEGABLU_RMS_BWD_GRES_EARLY
        const Vec<T, VEC>& evi = ev[i];
#else
        Vec<T, VEC> evi;
        if (gres) evi = load_vec<T, VEC>(gres + j * VEC);
#endif
        Vec<T, VEC> out;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float g = to_f(gv[i].v[e]);
          const float xh = to_f(rv[i].v[e]) * rstd;
          const float extra = gres ? to_f(evi.v[e]) : 0.f;
          dw[i][e] += g * round_to<T>(xh);
          out.v[e] = from_f<T>(rstd * (g * to_f(wv.v[e]) - xh * mean_dot) + extra);
        }
        store_vec<T, VEC>(dr + j * VEC, out);
      }
    }
  }

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

template <typename T>
cudaError_t bwd_typed(const RmsNormBwdArgs& a, cudaStream_t s) {
  if (a.rows == 0 || a.blocks == 0) return cudaSuccess;
  const size_t smem = sizeof(float) * a.d;
  constexpr int V = 16 / sizeof(T);
  if (a.vec == V) {
    MEGABLU_RMS_VPT(rmsnorm_bwd_kernel, T, V, a.blocks, kWarps * 32, smem, s)
  } else {
    return cudaErrorInvalidValue;
  }
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
  constexpr int V = 16 / sizeof(T);
  const void* fn = nullptr;
  switch (a.vpt) {
    case 1: fn = reinterpret_cast<const void*>(rmsnorm_bwd_kernel<T, V, 1>); break;
    case 2: fn = reinterpret_cast<const void*>(rmsnorm_bwd_kernel<T, V, 2>); break;
    case 3: fn = reinterpret_cast<const void*>(rmsnorm_bwd_kernel<T, V, 3>); break;
    case 4: fn = reinterpret_cast<const void*>(rmsnorm_bwd_kernel<T, V, 4>); break;
    case 6: fn = reinterpret_cast<const void*>(rmsnorm_bwd_kernel<T, V, 6>); break;
    case 8: fn = reinterpret_cast<const void*>(rmsnorm_bwd_kernel<T, V, 8>); break;
    default: return 0;
  }
  int dev = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kWarps * 32, sizeof(float) * a.d);
  const int64_t need = (a.rows + kWarps - 1) / kWarps;
  const int64_t cap = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
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

}  // namespace megablu
