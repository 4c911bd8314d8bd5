"""The device a `train.device` setting means on this machine (one rule for the trainer, the
preflight and the eval CLI)."""
from __future__ import annotations


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
