// Torch binding of the fused residual-add + RMSNorm kernels (csrc/rmsnorm/rmsnorm_kernel.cu).
#include "megablu_bindings.h"

#include <cstdlib>

namespace megablu {

namespace {
// Vectors per lane instantiated by the kernels (a warp owns a row of d = 32 * vpt * vec).
int round_vpt(int64_t need) {
  for (int v : {1, 2, 3, 4, 6, 8})
    if (need <= v) return v;
  return -1;
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  MEGABLU_CHECK(t.is_cuda() && t.device() == like.device(), "rmsnorm: ", name, " must be on ", like.device());
  MEGABLU_CHECK(t.sizes() == like.sizes() && t.is_contiguous(), "rmsnorm: ", name, " must be contiguous ",
              like.sizes(), ", got ", t.sizes());
  MEGABLU_CHECK(t.scalar_type() == like.scalar_type(), "rmsnorm: ", name, " dtype ", t.scalar_type(), " != ",
              like.scalar_type());
  MEGABLU_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "rmsnorm: ", name, " not 16-byte aligned");
}

// (vec, vpt) for a row of d elements of size es, or an error naming the limit.
std::pair<int, int> plan(int64_t d, int64_t es) {
  const int vec = static_cast<int>(16 / es);
  MEGABLU_CHECK(d % vec == 0, "rmsnorm: d=", d, " must be a multiple of ", vec, " for this dtype");
  const int vpt = round_vpt((d / vec + 31) / 32);
  MEGABLU_CHECK(vpt > 0, "rmsnorm: d=", d, " exceeds the kernel's limit of ", 32 * 8 * vec);
  return {vec, vpt};
}

// The backward's path for a (a.async_stages; the two give the same bits): `path` 0/1 when
// given, else MEGABLU_RMS_BWD_ASYNC 0/1 when set, else the cp.async stages where this GPU
// has room for them (rmsnorm_bwd_pick). Sets a.blocks for that path. A forced path that
// cannot run here is an error naming the numbers, not a failed launch.
void choose_bwd_path(RmsNormBwdArgs& a, int64_t path) {
  MEGABLU_CHECK(path >= -1 && path <= 1, "rmsnorm: path must be -1 (auto), 0 (registers) or 1 (cp.async), got ", path);
  const int env = rmsnorm_bwd_async_env();
  if (path < 0) {
    const char* v = std::getenv("MEGABLU_RMS_BWD_ASYNC");
    MEGABLU_CHECK(env >= -1, "rmsnorm: MEGABLU_RMS_BWD_ASYNC must be 0 (registers), 1 (cp.async), auto or unset, got '",
                v ? v : "", "'");
  }
  const int force = path >= 0 ? static_cast<int>(path) : env;
  const char* by = path >= 0 ? "path=1" : "MEGABLU_RMS_BWD_ASYNC=1";
  const char* fix = path >= 0 ? "pass path=-1 (auto) or 0" : "unset it (auto) or set 0";
  int dev = 0, cc = 0, optin = 0;
  check_launch(cudaGetDevice(&dev), "rmsnorm_bwd (device query)");
  check_launch(cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev), "rmsnorm_bwd (device query)");
  check_launch(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
               "rmsnorm_bwd (device query)");
  const int pick = rmsnorm_bwd_pick(a.d, a.dtype, force, cc, optin);
  const size_t need = rmsnorm_bwd_smem(a.d, a.dtype, true);
  MEGABLU_CHECK(pick >= 0, "rmsnorm: ", by, " forces the cp.async backward, which needs sm_80+ and ", need,
              " bytes of shared memory per block at d=", a.d, "; GPU ", dev, " is sm_", cc, "x with ", optin,
              " bytes per block: ", fix, " to run the register path here");
  a.async_stages = pick == 1;
  a.blocks = rmsnorm_bwd_grid(a);
  if (a.rows > 0 && a.blocks == 0 && a.async_stages) {
    // the opt-in to that much shared memory was refused after all: auto takes the registers
    MEGABLU_CHECK(force != 1, "rmsnorm: ", by, " forces the cp.async backward, but GPU ", dev, " did not grant its ",
                need, " bytes of shared memory per block at d=", a.d, " (the opt-in or the occupancy query failed): ",
                fix);
    a.async_stages = false;
    a.blocks = rmsnorm_bwd_grid(a);
  }
}
}  // namespace

std::vector<at::Tensor> rmsnorm_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                    const at::Tensor& weight, double eps) {
  MEGABLU_CHECK(x.dim() == 2, "rmsnorm: x must be (rows, d), got ", x.sizes());
  check_rows(x, x, "x");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) check_rows(*residual, x, "residual");
  const int64_t rows = x.size(0), d = x.size(1);
  MEGABLU_CHECK(weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.device() == x.device(),
              "rmsnorm: weight must be contiguous (", d, ",) of x's dtype and device");
  MEGABLU_CHECK(reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0, "rmsnorm: weight not 16-byte aligned");
  const auto [vec, vpt] = plan(d, x.element_size());

  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  auto r = has_res ? at::empty_like(x) : x;
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  RmsNormFwdArgs a{};
  a.x = x.data_ptr(); a.residual = has_res ? residual->data_ptr() : nullptr; a.weight = weight.data_ptr();
  a.y = y.data_ptr(); a.r_out = has_res ? r.data_ptr() : nullptr; a.rstd = rstd.data_ptr<float>();
  a.rows = rows; a.d = d; a.eps = static_cast<float>(eps);
  a.dtype = to_dtype(x.scalar_type()); a.vec = vec; a.vpt = vpt;
  check_launch(rmsnorm_fwd_launch(a, c10::cuda::getCurrentCUDAStream()), "rmsnorm_fwd");
  return {y, r, rstd};
}

std::vector<at::Tensor> rmsnorm_bwd(const at::Tensor& gy, const c10::optional<at::Tensor>& g_res,
                                    const at::Tensor& r, const at::Tensor& weight, const at::Tensor& rstd,
                                    int64_t path) {
  MEGABLU_CHECK(r.dim() == 2, "rmsnorm: r must be (rows, d), got ", r.sizes());
  check_rows(r, r, "r");
  check_rows(gy, r, "grad_y");
  const bool has_gr = g_res.has_value() && g_res->defined();
  if (has_gr) check_rows(*g_res, r, "grad_residual");
  const int64_t rows = r.size(0), d = r.size(1);
  MEGABLU_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == rows && rstd.is_contiguous(),
              "rmsnorm: rstd must be fp32 (rows,)");
  const auto [vec, vpt] = plan(d, r.element_size());

  const c10::cuda::CUDAGuard guard(r.device());
  auto dr = at::empty_like(r);
  RmsNormBwdArgs a{};
  a.gy = gy.data_ptr(); a.g_res = has_gr ? g_res->data_ptr() : nullptr; a.r = r.data_ptr();
  a.weight = weight.data_ptr(); a.rstd = rstd.data_ptr<float>(); a.dr = dr.data_ptr();
  a.rows = rows; a.d = d; a.dtype = to_dtype(r.scalar_type()); a.vec = vec; a.vpt = vpt;
  choose_bwd_path(a, path);
  // one fp32 partial dw row per block, summed here (fp32) then cast to the weight's dtype
  auto partial = at::empty({std::max(a.blocks, 1), d}, r.options().dtype(at::kFloat));
  if (a.blocks == 0) partial.zero_();
  a.dw_partial = partial.data_ptr<float>();
  check_launch(rmsnorm_bwd_launch(a, c10::cuda::getCurrentCUDAStream()), "rmsnorm_bwd");
  return {dr, partial.sum(0).to(weight.scalar_type())};
}

}  // namespace megablu
