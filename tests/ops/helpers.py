"""Shared tolerances and helpers for the op tests.

Ground truth is the pure-torch reference evaluated in fp64 on the same (already rounded)
inputs; a low-precision result, from either implementation, must be within the dtype's
tolerance of it. Reductions (a weight gradient summed over rows) get an absolute
tolerance scaled by the reference's magnitude.
"""

import pytest
import torch

# per-dtype (atol, rtol) against the fp64 ground truth; bf16 has 8 mantissa bits (2^-8 = 0.0039)
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, reduction: bool = False, what: str = ""
):
    atol, rtol = TOL[dtype]
    expected = expected.double()
    if reduction:
        atol = atol * max(1.0, float(expected.abs().max()))
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what} ({dtype}): {m}")
