"""Long-context evaluation: seeded passkey / needle / multi-key prompts at exact token lengths,
greedy generation (one rank or Ulysses-sharded prefill), Wilson/Newcombe statistics, slope per
doubling, effective length, the short-context gate, and reports (json, markdown, plot).

Entry points: `run_eval` (trainer auto-eval and `megablu eval`), `megablu compare`.
"""
from .prompts import EvalError, Prompt

__all__ = ["EvalError", "Prompt", "run_eval"]


def run_eval(*args, **kwargs):
    """See megablu.eval.harness.run_eval (imported lazily: torch-free import of this package)."""
    from .harness import run_eval as _run_eval

    return _run_eval(*args, **kwargs)
