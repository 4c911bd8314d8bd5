"""Long-context evaluation: seeded prompts at exact token lengths -- passkey, needle, multikey,
RULER's 11 synthetic tasks as published (ruler_*, megablu/eval/ruler) and megablu's RULER-like
tasks (niah on filler / real text / key-value haystacks, multikey, multivalue, multiquery, variable
tracking, common and frequent words; not comparable to RULER's numbers) -- greedy generation (one rank or
Ulysses-sharded prefill, preallocated KV cache, EOT stop), held-out loss per length and on short
documents, Wilson/Newcombe statistics, slope per doubling, effective length, the RULER average,
the short-context gate (retrieval and loss), and reports (json, markdown, plot, depth heatmaps).
docs/EVAL.md is the reference.

Entry points: `run_eval` (trainer auto-eval and `megablu eval`), `megablu compare`.
"""

from .prompts import EvalError, Prompt

__all__ = ["EvalError", "Prompt", "run_eval"]


def run_eval(*args, **kwargs):
    """See megablu.eval.harness.run_eval (imported lazily: torch-free import of this package)."""
    from .harness import run_eval as _run_eval

    return _run_eval(*args, **kwargs)
