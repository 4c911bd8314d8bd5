"""The CUDA extension's own argument checks raise RuntimeError with their message, each call in
a process of its own.

Why a process per case: on an H100 (2026-12-06, torch 2.11.0+cu130) `rmsnorm_bwd(..., path=2)`,
whose first check must throw "path must be", killed the whole pytest run with SIGSEGV, so
none of the later tests/ops ran. Here a crash fails one case, with its signal and the
faulthandler's stack. Their first run (H100, 2026-12-06, fifteenth session): the three throw probes
raised, and of the argument checks exactly those whose message streamed a number died (1-d x,
path=2, swiglu's shapes; a device or a literal raised). The checks now build their messages with
MEGABLU_CHECK (csrc/includes/megablu_msg.h, no std::ostream numbers), and
test_ostream_number_probes_agree says whether ostream number formatting is the cause.

The extension's Python callers validate before calling it (megablu/ops/*.py: an unsupported shape or
dtype takes the torch path), so these checks are the second line; they must still fail loudly and
never take the process down."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import cuda

ROOT = Path(__file__).resolve().parents[2]

SETUP = """
import torch
from megablu.ops import builder
ext = builder.load()
g = torch.Generator(device="cpu").manual_seed(0)
def t(*shape, dtype=torch.bfloat16, device="cuda"):
    return torch.randn(*shape, generator=g).to(device, dtype)
x, res, w = t(64, 1024), t(64, 1024), t(1024)
y, r, rstd = ext.rmsnorm_fwd(x, res, w, 1e-5)
gy, gr = t(64, 1024), t(64, 1024)
torch.cuda.synchronize()
"""

# (case, the call that must raise, a fragment of its message[, the Python exception, RuntimeError if not given])
CASES = [
    # the module's exception path alone, one kind each (csrc/megablu_ops.cpp _throw_probe): if only c10::Error
    # crashes, torch's translation of it does; if all three do, unwinding out of this build does
    ("throw_pybind11_value_error", "ext._throw_probe(0)", "pybind11 value_error", "ValueError"),
    ("throw_c10_error", "ext._throw_probe(1)", "c10::Error"),
    ("throw_std_runtime_error", "ext._throw_probe(2)", "std::runtime_error"),
    # the checks' own form since the H100 crash (csrc/includes/megablu_msg.h): a number through std::to_string
    ("throw_megablu_check_number", "ext._throw_probe(5)", "MEGABLU_CHECK with the number 5"),
    ("rmsnorm_fwd_1d", "ext.rmsnorm_fwd(x.flatten(), None, w, 1e-5)", "x must be (rows, d)"),
    ("rmsnorm_bwd_grad_on_cpu", "ext.rmsnorm_bwd(gy.cpu(), gr, r, w, rstd)", "grad_y must be on"),
    ("rmsnorm_bwd_rstd_dtype", "ext.rmsnorm_bwd(gy, gr, r, w, rstd.bfloat16())", "rstd must be fp32"),
    ("rmsnorm_bwd_path_2", "ext.rmsnorm_bwd(gy, gr, r, w, rstd, path=2)", "path must be"),
    ("swiglu_fwd_shape", "ext.swiglu_fwd(t(8, 64), t(8, 32))", "swiglu: up must be (rows, cols)"),
    (
        "rope_cpu",
        "ext.rope_apply(t(1, 8, 2, 64, device='cpu'), t(1, 8, 2, 64, device='cpu'), "
        "t(1, 8, 64, device='cpu'), t(1, 8, 64, device='cpu'), False)",
        "CUDA tensors expected",
    ),
]

PROBE = """
import json
try:
    {call}
except RuntimeError as e:
    print(json.dumps({{"raised": "RuntimeError", "msg": str(e).splitlines()[0]}}))
except Exception as e:
    print(json.dumps({{"raised": type(e).__name__, "msg": str(e).splitlines()[0]}}))
else:
    print(json.dumps({{"raised": None}}))
"""


def run_probe(call: str, setup: str = SETUP) -> tuple[int, str, dict]:
    """Run `call` after `setup` in a fresh interpreter: (rc, stderr, what it raised)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", (setup + PROBE).format(call=call)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = p.stdout.strip().splitlines()
    if p.returncode == 0 and not lines:
        return p.returncode, p.stderr, {"raised": "nothing printed", "msg": p.stderr[-2000:]}
    return p.returncode, p.stderr, (json.loads(lines[-1]) if p.returncode == 0 else {})


@cuda
@pytest.mark.parametrize("case,call,fragment,exc", [(*c, "RuntimeError")[:4] for c in CASES], ids=[c[0] for c in CASES])
def test_extension_check_raises_in_its_own_process(case, call, fragment, exc):
    rc, err, got = run_probe(call)
    assert rc == 0, (
        f"{case}: the probe (the extension's load and inputs, then `{call}`) ended the process with "
        f"rc {rc}{' (signal %d)' % -rc if rc < 0 else ''} instead of raising; stderr tail:\n{err[-3000:]}"
    )
    assert got["raised"] == exc and fragment in got["msg"], (case, got)


def test_probe_cases_are_python():
    """The probes compile as Python (a typo in a case would read as the extension's failure on a GPU)."""
    for case, call, *_ in CASES:
        compile((SETUP + PROBE).format(call=call), case, "exec")


def test_probe_tells_a_raise_from_a_crash():
    """The harness on CPU: a raise comes back with its type and message, a SIGSEGV as rc -11 with
    the faulthandler's stack, a call that does not raise as raised None."""
    rc, _, got = run_probe("torch.zeros(2) @ torch.zeros(3)", setup="import torch\n")
    assert rc == 0 and got["raised"] == "RuntimeError" and "size" in got["msg"], got
    rc, err, _ = run_probe("os.kill(os.getpid(), signal.SIGSEGV)", setup="import os, signal\n")
    assert rc == -11 and "Segmentation fault" in err, (rc, err[-500:])
    rc, _, got = run_probe("pass", setup="")
    assert rc == 0 and got["raised"] is None
    rc, _, got = run_probe("pass", setup="import sys\nsys.exit(0)\n")  # exit 0 before the probe: said so
    assert rc == 0 and got["raised"] == "nothing printed", got


@cuda
def test_ostream_number_probes_agree(record_property):
    """What crashed on the H100 (2026-12-06): every check whose message streamed a number died with SIGSEGV,
    those with strings only raised. Probe 3 is a TORCH_CHECK streaming a number, probe 4 a std::ostringstream
    number in a std::runtime_error: each must raise or die with SIGSEGV, and the two must agree. Both raising:
    the build is sound and MEGABLU_CHECK is a precaution; both dying: std::ostream number formatting in this
    build is the cause and MEGABLU_CHECK (probe 5, above) the fix; one of each: the cause is elsewhere, and this
    fails to say so. The outcomes go to the junit xml as properties."""
    seen = {}
    for kind, fragment in ((3, "c10::Error with the number 3"), (4, "ostream with the number 4")):
        rc, err, got = run_probe(f"ext._throw_probe({kind})")
        seen[kind] = "raised" if rc == 0 and fragment in got.get("msg", "") else f"rc {rc}"
        record_property(f"probe_{kind}", seen[kind])
        assert seen[kind] == "raised" or rc == -11, (kind, rc, got, err[-2000:])
    assert seen[3] == seen[4], f"TORCH_CHECK with a number: {seen[3]}; ostream number: {seen[4]}"
