// Host build of csrc/*/ *_kernel.cu (see host_shim.h) with a C ABI for ctypes: the kernels'
// own index math, vector widths, reductions and roundings, run on a CPU against torch.
#include "host_shim.h"

#include "../../../csrc/rmsnorm/rmsnorm_kernel.cu"
#include "../../../csrc/rope/rope_kernel.cu"
#include "../../../csrc/swiglu/swiglu_kernel.cu"

// rmsnorm_bwd_kernel's dynamic shared memory (`extern __shared__ float dw_smem[]`: the dw
// sums, then the async path's stages; rmsnorm_bwd_smem is at most 200 KB); blocks run one
// after another here, so one buffer serves them all
namespace megablu {
namespace {
float dw_smem[1 << 16];
}  // namespace
}  // namespace megablu

using namespace megablu;

namespace {
// bf16 for dtype 2, fp32 otherwise
template <template <typename> class F>
int by_dtype(int dtype) {
  if (dtype == 0) return F<float>::run();
  if (dtype == 2) return F<__nv_bfloat16>::run();
  return 1;
}

#define RMS_VPT(KERNEL, T, V, A, ...)                                \
  switch (A.vpt) {                                                   \
    case 1: return go(KERNEL<T, V, 1 __VA_OPT__(,) __VA_ARGS__>);    \
    case 2: return go(KERNEL<T, V, 2 __VA_OPT__(,) __VA_ARGS__>);    \
    case 3: return go(KERNEL<T, V, 3 __VA_OPT__(,) __VA_ARGS__>);    \
    case 4: return go(KERNEL<T, V, 4 __VA_OPT__(,) __VA_ARGS__>);    \
    case 6: return go(KERNEL<T, V, 6 __VA_OPT__(,) __VA_ARGS__>);    \
    case 8: return go(KERNEL<T, V, 8 __VA_OPT__(,) __VA_ARGS__>);    \
  }                                                                  \
  return 1;

// the backward of one path (ASYNC: rows staged through shared memory), as the CUDA launcher
// picks it from a->async_stages
template <bool ASYNC>
int rmsnorm_bwd_path(const RmsNormBwdArgs* a) {
  auto go = [&](auto kernel) { emu::launch(a->blocks, kRmsNormWarps * 32, [&] { kernel(*a); }, true); return 0; };
  if (a->dtype == DType::F32 && a->vec == 4) { RMS_VPT(rmsnorm_bwd_kernel, float, 4, (*a), ASYNC) }
  if (a->dtype == DType::BF16 && a->vec == 8) { RMS_VPT(rmsnorm_bwd_kernel, __nv_bfloat16, 8, (*a), ASYNC) }
  return 1;
}
}  // namespace

extern "C" {

int emu_rope(const RopeArgs* a) {
  const int64_t total = a->B * a->T * (a->H + a->Hkv) * (a->D / 2 / a->vec);
  const unsigned threads = 256, grid = static_cast<unsigned>((total + threads - 1) / threads);
  auto go = [&](auto kernel) { emu::launch(grid, threads, [&] { kernel(*a); }, false); return 0; };
#define ROPE_CASES(T, TT)                                            \
  switch (a->vec) {                                                  \
    case 8: return go(rope_kernel<T, TT, 8>);                        \
    case 4: return go(rope_kernel<T, TT, 4>);                        \
    case 2: return go(rope_kernel<T, TT, 2>);                        \
    case 1: return go(rope_kernel<T, TT, 1>);                        \
  }                                                                  \
  return 1;
  if (a->dtype == DType::F32) { ROPE_CASES(float, float) }
  if (a->dtype == DType::BF16 && a->table_f32) { ROPE_CASES(__nv_bfloat16, float) }
  if (a->dtype == DType::BF16) { ROPE_CASES(__nv_bfloat16, __nv_bfloat16) }
  return 1;
}

int emu_rmsnorm_fwd(const RmsNormFwdArgs* a) {
  const unsigned grid = static_cast<unsigned>((a->rows + kRmsNormWarps - 1) / kRmsNormWarps);
  auto go = [&](auto kernel) { emu::launch(grid, kRmsNormWarps * 32, [&] { kernel(*a); }, true); return 0; };
  if (a->dtype == DType::F32 && a->vec == 4) { RMS_VPT(rmsnorm_fwd_kernel, float, 4, (*a)) }
  if (a->dtype == DType::BF16 && a->vec == 8) { RMS_VPT(rmsnorm_fwd_kernel, __nv_bfloat16, 8, (*a)) }
  return 1;
}

int emu_rmsnorm_bwd(const RmsNormBwdArgs* a) {
  if (rmsnorm_bwd_smem(a->d, a->dtype, a->async_stages) > sizeof(dw_smem)) return 2;   // the buffer above
  return a->async_stages ? rmsnorm_bwd_path<true>(a) : rmsnorm_bwd_path<false>(a);
}

// the path rule and the environment override, host code of rmsnorm_kernel.cu as the binding calls it
size_t emu_rmsnorm_bwd_smem(int64_t d, int dtype, bool async) { return rmsnorm_bwd_smem(d, DType(dtype), async); }
int emu_rmsnorm_bwd_pick(int64_t d, int dtype, int force, int cc_major, int smem_optin) {
  return rmsnorm_bwd_pick(d, DType(dtype), force, cc_major, smem_optin);
}
int emu_rmsnorm_bwd_async_env() { return rmsnorm_bwd_async_env(); }

#define SWIGLU_CASES(KERNEL, T)                                      \
  switch (a->vec) {                                                  \
    case 8: return go(KERNEL<T, 8>);                                 \
    case 4: return go(KERNEL<T, 4>);                                 \
    case 2: return go(KERNEL<T, 2>);                                 \
    case 1: return go(KERNEL<T, 1>);                                 \
  }                                                                  \
  return 1;

int emu_swiglu_fwd(const SwigluFwdArgs* a) {
  const int64_t total = a->rows * (a->cols / a->vec);
  const unsigned grid = static_cast<unsigned>((total + 255) / 256);
  auto go = [&](auto kernel) { emu::launch(grid, 256, [&] { kernel(*a); }, false); return 0; };
  if (a->dtype == DType::F32) { SWIGLU_CASES(swiglu_fwd_kernel, float) }
  if (a->dtype == DType::BF16) { SWIGLU_CASES(swiglu_fwd_kernel, __nv_bfloat16) }
  return 1;
}

int emu_swiglu_bwd(const SwigluBwdArgs* a) {
  const int64_t total = a->rows * (a->cols / a->vec);
  const unsigned grid = static_cast<unsigned>((total + 255) / 256);
  auto go = [&](auto kernel) { emu::launch(grid, 256, [&] { kernel(*a); }, false); return 0; };
  if (a->dtype == DType::F32) { SWIGLU_CASES(swiglu_bwd_kernel, float) }
  if (a->dtype == DType::BF16) { SWIGLU_CASES(swiglu_bwd_kernel, __nv_bfloat16) }
  return 1;
}

}  // extern "C"
