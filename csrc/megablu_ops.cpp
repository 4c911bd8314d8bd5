// The one megablu extension module: Python bindings for every op in csrc/<op>/.
// MEGABLU_OPS_HASH (set by megablu/ops/builder.py) identifies the sources this module was
// built from, so a stale ahead-of-time build is detected and JIT-rebuilt.
#include <torch/extension.h>

#include "megablu_bindings.h"

#ifndef MEGABLU_OPS_HASH
#define MEGABLU_OPS_HASH unknown
#endif
#define MEGABLU_STR2(x) #x
#define MEGABLU_STR(x) MEGABLU_STR2(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megablu fused CUDA ops (RoPE, residual-add RMSNorm, SwiGLU)";
  m.def("source_hash", [] { return std::string(MEGABLU_STR(MEGABLU_OPS_HASH)); });
  m.def("rope_apply", &megablu::rope_apply, "RoPE on q and k in one launch (backward=True: transposed)",
        py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"), py::arg("backward"));
  m.def("rmsnorm_fwd", &megablu::rmsnorm_fwd, "residual add + RMSNorm forward -> (y, r, rstd)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("rmsnorm_bwd", &megablu::rmsnorm_bwd,
        "residual add + RMSNorm backward -> (dr, dw); path: -1 MEGABLU_RMS_BWD_ASYNC or auto, 0 registers, "
        "1 cp.async (same bits)",
        py::arg("grad_y"), py::arg("grad_residual"), py::arg("r"), py::arg("weight"), py::arg("rstd"),
        py::arg("path") = -1);
  m.def("swiglu_fwd", &megablu::swiglu_fwd, "silu(gate) * up", py::arg("gate"), py::arg("up"));
  m.def("swiglu_bwd", &megablu::swiglu_bwd, "SwiGLU backward", py::arg("grad"), py::arg("gate"), py::arg("up"),
        py::arg("packed"));
}
