"""The device a `train.device` setting means on this machine (one rule for the trainer, the
preflight and the eval CLI)."""
from __future__ import annotations

from typing import Optional

# dense bf16 tensor-core peak, TF/s, by the device name torch reports (vendor datasheets; no sparsity).
# First match wins, so the more specific names come first.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H200", 989.4), ("H100", 989.4), ("GH200", 989.4), ("H800", 989.4),
                    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L4", 121.0))


def resolve_device(setting: str = "auto", *, require: bool = False) -> str:
    """"auto" -> "cuda" when a GPU is visible, else "cpu"; "cpu" / "cuda" as given.

    require: an explicit "cuda" without a visible GPU raises (the trainer); otherwise it is
    returned as asked (a config checked for the GPU box it was written for)."""
    import torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if require and setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but CUDA is not available on this machine")
    return setting


def peak_bf16_tflops(name: Optional[str] = None) -> Optional[float]:
    """The dense bf16 peak of a GPU by its name (default: the current CUDA device), or None when it
    is not in PEAK_BF16_TFLOPS or there is no GPU: MFU is then not reported rather than guessed."""
    if name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(torch.cuda.current_device())
    return next((tf for key, tf in PEAK_BF16_TFLOPS if key in name), None)


def mfu(flops_per_token: float, tokens_per_gpu: float, seconds: float, peak_tflops: Optional[float]) -> Optional[float]:
    """Model flops utilisation of one GPU: model flops done per second over the GPU's peak."""
    if not peak_tflops or seconds <= 0:
        return None
    return flops_per_token * tokens_per_gpu / seconds / (peak_tflops * 1e12)
