// Torch binding of the fused SwiGLU kernels (csrc/swiglu/swiglu_kernel.cu).
#include "megablu_bindings.h"

namespace megablu {

namespace {
void check_2d(const at::Tensor& t, const at::Tensor& like, const char* name) {
  MEGABLU_CHECK(t.is_cuda() && t.device() == like.device(), "swiglu: ", name, " must be on ", like.device());
  MEGABLU_CHECK(t.dim() == 2 && t.size(0) == like.size(0) && t.size(1) == like.size(1),
              "swiglu: ", name, " must be (rows, cols) = ", like.sizes(), ", got ", t.sizes());
  MEGABLU_CHECK(t.stride(1) == 1 || t.size(1) == 1, "swiglu: ", name, " needs unit column stride");
  MEGABLU_CHECK(t.scalar_type() == like.scalar_type(), "swiglu: ", name, " dtype differs");
}
int64_t rs(const at::Tensor& t) { return t.size(0) == 1 ? t.size(1) : t.stride(0); }
}  // namespace

at::Tensor swiglu_fwd(const at::Tensor& gate, const at::Tensor& up) {
  check_2d(gate, gate, "gate");
  check_2d(up, gate, "up");
  const c10::cuda::CUDAGuard guard(gate.device());
  auto out = at::empty({gate.size(0), gate.size(1)}, gate.options());
  SwigluFwdArgs a{};
  a.gate = gate.data_ptr(); a.up = up.data_ptr(); a.out = out.data_ptr();
  a.rows = gate.size(0); a.cols = gate.size(1); a.gate_rs = rs(gate); a.up_rs = rs(up);
  a.dtype = to_dtype(gate.scalar_type());
  const int64_t es = gate.element_size();
  a.vec = pick_vec(static_cast<int>(16 / es), {a.cols, a.gate_rs, a.up_rs}, {{a.gate, es}, {a.up, es}});
  check_launch(swiglu_fwd_launch(a, c10::cuda::getCurrentCUDAStream()), "swiglu_fwd");
  return out;
}

std::vector<at::Tensor> swiglu_bwd(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,
                                   bool packed) {
  check_2d(gate, gate, "gate");
  check_2d(up, gate, "up");
  check_2d(grad, gate, "grad");
  const int64_t rows = gate.size(0), cols = gate.size(1);
  const c10::cuda::CUDAGuard guard(gate.device());
  at::Tensor dgu, dg, du;
  if (packed) {
    // one (rows, 2*cols) buffer: the gradient of a packed gate_up projection output
    dgu = at::empty({rows, 2 * cols}, gate.options());
    dg = dgu.narrow(1, 0, cols);
    du = dgu.narrow(1, cols, cols);
  } else {
    dg = at::empty({rows, cols}, gate.options());
    du = at::empty({rows, cols}, gate.options());
  }
  SwigluBwdArgs a{};
  a.grad = grad.data_ptr(); a.gate = gate.data_ptr(); a.up = up.data_ptr();
  a.d_gate = dg.data_ptr(); a.d_up = du.data_ptr();
  a.rows = rows; a.cols = cols;
  a.grad_rs = rs(grad); a.gate_rs = rs(gate); a.up_rs = rs(up);
  a.dgate_rs = packed ? 2 * cols : cols; a.dup_rs = a.dgate_rs;
  a.dtype = to_dtype(gate.scalar_type());
  const int64_t es = gate.element_size();
  a.vec = pick_vec(static_cast<int>(16 / es), {cols, a.grad_rs, a.gate_rs, a.up_rs, a.dgate_rs},
                   {{a.grad, es}, {a.gate, es}, {a.up, es}, {a.d_gate, es}, {a.d_up, es}});
  check_launch(swiglu_bwd_launch(a, c10::cuda::getCurrentCUDAStream()), "swiglu_bwd");
  if (packed) return {dgu};
  return {dg, du};
}

}  // namespace megablu
