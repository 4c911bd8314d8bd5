// Device helpers shared by the megablu kernels: dtype conversion, aligned vectors, warp sums.
// Deliberately free of torch headers so every .cu compiles with plain nvcc (CI compile-only
// check, and a fast JIT build); the torch-facing code lives in the per-op .cpp files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifndef MEGABLU_HOST_EMULATION   // the emulator (tests/ops/emulator) provides the builtins
#include <cuda_runtime.h>
#endif

#include <cstdint>
#include <cstring>

namespace megablu {

// float <-> storage type. Rounding is round-to-nearest-even, as torch's own casts.
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Round a float through the storage type (mirrors an intermediate torch tensor of dtype T).
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_f(from_f<T>(v)); }

// VEC elements loaded/stored as one aligned access (16 B = one LDG.128 / STG.128). The
// accesses go through integer vector types: a plain struct copy lets nvcc split a store
// into 2-byte pieces once the elements were written one by one.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <int BYTES> struct RawVec;                     // the integer type of one access
template <> struct RawVec<2> { using type = unsigned short; };
template <> struct RawVec<4> { using type = unsigned int; };
template <> struct RawVec<8> { using type = uint2; };
template <> struct RawVec<16> { using type = uint4; };

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec(const T* p) {
  constexpr int B = sizeof(T) * VEC;
  constexpr int A = B > 16 ? 16 : B;                    // 32-byte vectors: two 16-byte accesses
  using R = typename RawVec<A>::type;
  union { Vec<T, VEC> v; R r[B / A]; } u;
#pragma unroll
  for (int i = 0; i < B / A; ++i) u.r[i] = reinterpret_cast<const R*>(p)[i];
  return u.v;
}

// 16- and 8-byte stores are issued as explicit vector PTX stores: with a computed
// (row, column) address nvcc otherwise splits them into 2- or 4-byte stores (seen for
// sm_90 with CUDA 13). Generic addresses of global memory are valid global addresses.
// No "memory" clobber: no kernel reads back what it stores, and a clobber would pin every
// later load (e.g. of the L1-resident weight) behind each store.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ void store_raw(void* p, const uint4& r) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(r.x), "r"(r.y), "r"(r.z), "r"(r.w));
}
__device__ __forceinline__ void store_raw(void* p, const uint2& r) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(r.x), "r"(r.y));
}
#else
__device__ __forceinline__ void store_raw(void* p, const uint4& r) { *reinterpret_cast<uint4*>(p) = r; }
__device__ __forceinline__ void store_raw(void* p, const uint2& r) { *reinterpret_cast<uint2*>(p) = r; }
#endif
__device__ __forceinline__ void store_raw(void* p, unsigned int r) { *reinterpret_cast<unsigned int*>(p) = r; }
__device__ __forceinline__ void store_raw(void* p, unsigned short r) { *reinterpret_cast<unsigned short*>(p) = r; }

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, VEC>& v) {
  constexpr int B = sizeof(T) * VEC;
  constexpr int A = B > 16 ? 16 : B;
  using R = typename RawVec<A>::type;
  union { Vec<T, VEC> v; R r[B / A]; } u;
  u.v = v;
#pragma unroll
  for (int i = 0; i < B / A; ++i) store_raw(reinterpret_cast<R*>(p) + i, u.r[i]);
}

// 16-byte global -> shared copies that need no register and do not block (cp.async, sm_80+),
// in groups: commit closes a group, wait<N> returns once at most N groups are in flight.
// The host emulator, and a build for an arch below sm_80 (where the launchers never pick a
// kernel that uses them, but the extension must still compile), copy at once.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MEGABLU_CP_ASYNC 1
#else
#define MEGABLU_CP_ASYNC 0
#endif
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if MEGABLU_CP_ASYNC
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
#elif defined(__CUDA_ARCH__)
  *static_cast<uint4*>(smem) = *static_cast<const uint4*>(gmem);
#else
  std::memcpy(smem, gmem, 16);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if MEGABLU_CP_ASYNC
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if MEGABLU_CP_ASYNC
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace megablu
