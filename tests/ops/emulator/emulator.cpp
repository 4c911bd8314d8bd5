// Host build of csrc/*/ *_kernel.cu (see host_shim.h) with a C ABI for ctypes: the kernels'
// own index math, vector widths, reductions and roundings, run on a CPU against torch.
#include "host_shim.h"

#include "../../../csrc/rmsnorm/rmsnorm_kernel.cu"
#include "../../../csrc/rope/rope_kernel.cu"
#include "../../../csrc/swiglu/swiglu_kernel.cu"

// rmsnorm_bwd_kernel's dynamic shared memory (`extern __shared__ float dw_smem[]`); blocks
// run one after another here, so one buffer serves them all
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

#define RMS_VPT(KERNEL, T, V, A)                                     \
  switch (A.vpt) {                                                   \
    case 1: return go(KERNEL<T, V, 1>);                              \
    case 2: return go(KERNEL<T, V, 2>);                              \
    case 3: return go(KERNEL<T, V, 3>);                              \
    case 4: return go(KERNEL<T, V, 4>);                              \
    case 6: return go(KERNEL<T, V, 6>);                              \
    case 8: return go(KERNEL<T, V, 8>);                              \
  }                                                                  \
  return 1;

int emu_rmsnorm_fwd(const RmsNormFwdArgs* a) {
  const unsigned grid = static_cast<unsigned>((a->rows + kRmsNormWarps - 1) / kRmsNormWarps);
  auto go = [&](auto kernel) { emu::launch(grid, kRmsNormWarps * 32, [&] { kernel(*a); }, true); return 0; };
  if (a->dtype == DType::F32 && a->vec == 4) { RMS_VPT(rmsnorm_fwd_kernel, float, 4, (*a)) }
  if (a->dtype == DType::BF16 && a->vec == 8) { RMS_VPT(rmsnorm_fwd_kernel, __nv_bfloat16, 8, (*a)) }
  return 1;
}

int emu_rmsnorm_bwd(const RmsNormBwdArgs* a) {
  auto go = [&](auto kernel) { emu::launch(a->blocks, kRmsNormWarps * 32, [&] { kernel(*a); }, true); return 0; };
  if (a->dtype == DType::F32 && a->vec == 4) { RMS_VPT(rmsnorm_bwd_kernel, float, 4, (*a)) }
  if (a->dtype == DType::BF16 && a->vec == 8) { RMS_VPT(rmsnorm_bwd_kernel, __nv_bfloat16, 8, (*a)) }
  return 1;
}

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
