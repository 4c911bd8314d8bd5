"""The device a `train.device` setting means on this machine (one rule for the trainer, the
preflight and the eval CLI)."""

from __future__ import annotations

from typing import Optional

# dense bf16 tensor-core peak, TF/s (vendor datasheets, no sparsity), by a whole-word pattern of the
# device name torch reports; the more specific names come first (an H100 NVL is not an H100 SXM)
PEAK_BF16_TFLOPS = (
    (r"H100 PCIe", 756.0),
    (r"H100 NVL", 835.0),
    (r"H200 NVL", 835.0),
    (r"H800 PCIe", 756.0),
    (r"GH200", 989.4),
    (r"H200", 989.4),
    (r"H100", 989.4),
    (r"H800", 989.4),
    (r"GB200", 2500.0),
    (r"B200", 2250.0),
    (r"A100", 312.0),
    (r"A800", 312.0),
    (r"L40S", 362.1),
    (r"L40", 181.0),
    (r"L4", 121.0),
)


def resolve_device(setting: str = "auto", *, require: bool = False) -> str:
    """ "auto" -> "cuda" when a GPU is visible, else "cpu"; "cpu" / "cuda" as given.

    require: an explicit "cuda" without a visible GPU raises (the trainer); otherwise it is
    returned as asked (a config checked for the GPU box it was written for)."""
    import torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if require and setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but CUDA is not available on this machine")
    return setting


def peak_bf16_tflops(name: Optional[str] = None, index: Optional[int] = None) -> Optional[float]:
    """The dense bf16 peak of a GPU by its name (default: CUDA device `index`, or the current one), or
    None when it is not in PEAK_BF16_TFLOPS or there is no GPU: MFU is then not reported, not guessed."""
    import re

    if name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(torch.cuda.current_device() if index is None else index)
    return next((tf for pat, tf in PEAK_BF16_TFLOPS if re.search(rf"(?<![A-Za-z0-9]){pat}(?![A-Za-z0-9])", name)), None)


def mfu(flops_per_token: float, tokens_per_gpu: float, seconds: float, peak_tflops: Optional[float]) -> Optional[float]:
    """Model flops utilisation of one GPU: model flops done per second over the GPU's peak."""
    if not peak_tflops or seconds <= 0:
        return None
    return flops_per_token * tokens_per_gpu / seconds / (peak_tflops * 1e12)
