"""MEGABLU_CHECK's messages (csrc/includes/megablu_msg.h), built on a CPU: the parts the bindings pass
(literals, std::string, integers of every width, bool, double, sizes, devices, dtypes) come out as the
message TORCH_CHECK raises, with no std::ostream number formatting (the H100 crash of 2026-12-06,
tests/ops/test_ext_errors.py). Skipped, saying why, where no C++ compiler or no Python.h can build a torch extension."""

import shutil
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SRC = r"""
#include <pybind11/pybind11.h>
#include "megablu_msg.h"

std::string check(int64_t kind) {
  const std::vector<int64_t> sizes{2, 3, 4};
  try {
    if (kind == 0) MEGABLU_CHECK(false, "plain");
    if (kind == 1) MEGABLU_CHECK(false, "d=", int64_t(1024), " int ", 7, " size_t ", size_t(8), " u8 ", uint8_t(9),
                                 " bool ", true, " double ", 0.5, " str ", std::string("s"));
    if (kind == 2) MEGABLU_CHECK(false, "got ", c10::IntArrayRef(sizes), " empty ", c10::IntArrayRef());
    if (kind == 3) MEGABLU_CHECK(false, "on ", c10::Device("cuda:1"), " ", c10::Device("cpu"), " dtype ",
                                 c10::ScalarType::BFloat16);
    if (kind == 4) MEGABLU_CHECK(kind == 4, "never");   // a true condition: no throw, no message built
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no throw";
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("check", &check); }
"""


def skip_unless_buildable():
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler (c++ / g++) to build the probe extension")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip(f"no Python.h under {sysconfig.get_paths()['include']} (python's dev headers) to build it")


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    skip_unless_buildable()
    from torch.utils.cpp_extension import load

    d = tmp_path_factory.mktemp("msg_ext")
    (d / "msg.cpp").write_text(SRC)
    return load(
        "megablu_msg_probe",
        [str(d / "msg.cpp")],
        extra_include_paths=[str(ROOT / "csrc" / "includes")],
        extra_cflags=["-O1"],
        build_directory=str(d),
        verbose=False,
    )


@pytest.mark.parametrize(
    "kind,want",
    [
        (0, "plain"),
        (1, "d=1024 int 7 size_t 8 u8 9 bool true double 0.500000 str s"),
        (2, "got [2, 3, 4] empty []"),
        (3, "on cuda:1 cpu dtype BFloat16"),
        (4, "no throw"),
    ],
)
def test_megablu_check_message(ext, kind, want):
    assert ext.check(kind) == want


def test_a_char_or_a_pointer_in_a_message_does_not_compile(tmp_path):
    """msg_part refuses a char (it would print its code) and a pointer other than char* (it would print as a
    bool) at compile time."""
    skip_unless_buildable()
    from torch.utils.cpp_extension import load

    for i, part in enumerate(["','", "(const int*) nullptr"]):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "bad.cpp").write_text(
            '#include <pybind11/pybind11.h>\n#include "megablu_msg.h"\n'
            f'void f() {{ MEGABLU_CHECK(false, "x", {part}); }}\n'
            'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("f", &f); }\n'
        )
        with pytest.raises(RuntimeError, match="Error building extension"):
            load(
                f"megablu_msg_bad{i}",
                [str(d / "bad.cpp")],
                extra_include_paths=[str(ROOT / "csrc" / "includes")],
                build_directory=str(d),
                verbose=False,
            )
