"""Generator states (python, numpy, torch, cuda) saved per rank for an exact resume."""

from __future__ import annotations

import random

import numpy as np
import torch


def get_rng_state() -> dict:
    """python / numpy / torch (+cuda) generator states, for exact resume."""
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
