"""Task name -> prompt builder: the one place the families of megablu.config.eval_tasks meet
their builders. Every builder has `build(length, index) -> Prompt` (exactly `length` tokens --
RULER's tasks: length - tokens_to_generate, see megablu/config/ruler_tasks.py -- seeded by
(seed, task, index)) and `min_length()` (the shortest length its n prompts fit, in
this tokenizer)."""

from __future__ import annotations

from typing import Optional

from ..config.eval_tasks import MEGABLU_SUITE, RULER_SUITE, needs_text_haystack
from .needle import Haystack, NeedleBuilder, NiahBuilder
from .passkey import PasskeyBuilder
from .prompts import EvalError, TokenizerLike
from .vt import VTBuilder
from .words import CWEBuilder, FWEBuilder

__all__ = ["MEGABLU_SUITE", "RULER_SUITE", "make_builder", "needs_text_haystack"]


def make_builder(
    task: str,
    spec,
    tokenizer: TokenizerLike,
    seed: int,
    n: int,
    haystack: Optional[Haystack],
    chat_template: str = "auto",
):
    """chat_template (eval.chat_template) applies to RULER's tasks (family 'ruler') only."""
    f = spec.family
    if f == "ruler":
        from .ruler import make_ruler_builder

        return make_ruler_builder(task, spec, tokenizer, seed, n, chat_template)
    if f == "passkey":
        b = PasskeyBuilder(tokenizer, seed, n, digits=spec.digits, depth=spec.depth)
        if spec.digits != 5 or spec.depth != (0.0, 1.0):  # a variant: its own name seeds its keys and depths
            b.task = task
        return b
    if needs_text_haystack(spec) and haystack is None:
        raise EvalError(
            f"task {task!r} needs a real-text haystack: set eval.haystack (a dataset dir whose val split "
            f"is the haystack) or pass haystack="
        )
    if f == "needle":
        assert haystack is not None  # needs_text_haystack: checked above
        nb = NeedleBuilder(
            "multikey" if spec.distractors else "needle", tokenizer, seed, n, haystack, n_distractors=spec.distractors
        )
        nb.task = task
        return nb
    if f == "niah":
        return NiahBuilder(task, spec, tokenizer, seed, n, haystack)
    if f == "vt":
        return VTBuilder(task, spec, tokenizer, seed, n)
    if f == "cwe":
        return CWEBuilder(task, spec, tokenizer, seed, n)
    if f == "fwe":
        return FWEBuilder(task, spec, tokenizer, seed, n)
    raise EvalError(f"task {task!r}: unknown family {f!r}")
