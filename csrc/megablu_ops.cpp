// The one megablu extension module: Python bindings for every op in csrc/<op>/.
// MEGABLU_OPS_HASH (set by megablu/ops/builder.py) identifies the sources this module was
// built from, so a stale ahead-of-time build is detected and JIT-rebuilt.
#include <torch/extension.h>

#include <sstream>

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
  // A diagnostic (tests/ops/test_ext_errors.py): throw one kind of exception out of this module, 0 pybind11's
  // value_error, 1 c10::Error (TORCH_CHECK, a literal message), 2 std::runtime_error, 3 TORCH_CHECK streaming a
  // number into its message, 4 std::runtime_error of a std::ostringstream holding a number, 5 MEGABLU_CHECK with
  // a number (std::to_string); else none. On an H100 (2026-12-06) 0-2 raised, and every argument check whose
  // message streamed a number died with SIGSEGV: 3 and 4 against 5 say whether ostream number formatting in
  // this build is what crashes (megablu_bindings.h: MEGABLU_CHECK).
  m.def(
      "_throw_probe",
      [](int64_t kind) {
        if (kind == 0) throw py::value_error("megablu throw probe: pybind11 value_error");
        TORCH_CHECK(kind != 1, "megablu throw probe: c10::Error");
        if (kind == 2) throw std::runtime_error("megablu throw probe: std::runtime_error");
        TORCH_CHECK(kind != 3, "megablu throw probe: c10::Error with the number ", kind);
        if (kind == 4) {
          std::ostringstream ss;
          ss << "megablu throw probe: ostream with the number " << kind;
          throw std::runtime_error(ss.str());
        }
        MEGABLU_CHECK(kind != 5, "megablu throw probe: MEGABLU_CHECK with the number ", kind);
        return kind;
      },
      "throw a pybind11 value_error (0), a c10::Error (1), a std::runtime_error (2), a c10::Error with a "
      "streamed number (3), a std::runtime_error from an ostringstream number (4), a MEGABLU_CHECK number (5); "
      "else return kind",
      py::arg("kind"));
  m.def("swiglu_fwd", &megablu::swiglu_fwd, "silu(gate) * up", py::arg("gate"), py::arg("up"));
  m.def("swiglu_bwd", &megablu::swiglu_bwd, "SwiGLU backward", py::arg("grad"), py::arg("gate"), py::arg("up"),
        py::arg("packed"));
}
