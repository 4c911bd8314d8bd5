"""RULER as published (Hsieh et al. 2024, arXiv 2404.06654; NVIDIA/RULER's scripts/data/synthetic):
the 11 synthetic tasks of megablu/config/ruler_tasks.py, prompts built in the model's tokens.

What is RULER's here: every template word for word (templates.py, with file and line), the needles,
haystack kinds, keys and values, tokens_to_generate, the answer prefix after the chat template, the
worked examples of vt and cwe, cwe's word lists (wonderwords, then a longer list), fwe's Zipf law and
vocabulary size, scoring (string_match_all, megablu.eval.prompts.score with scoring 'all') and the
average over tasks with its 85.6 threshold (megablu.eval.results.ruler_average). What differs, and why:
docs/EVAL.md ("RULER as published").
"""

from __future__ import annotations

from ..prompts import EvalError


def make_ruler_builder(task: str, spec, tokenizer, seed: int, n: int, chat_template: str = "auto", essay=None):
    """The builder of one RULER task (spec: megablu.config.ruler_tasks.RulerSpec). essay: a text in place
    of the shipped essays (tests)."""
    if spec.task == "niah":
        from .niah import RulerNiah

        return RulerNiah(task, spec, tokenizer, seed, n, chat_template, essay=essay)
    if spec.task == "variable_tracking":
        from .vt import RulerVT

        return RulerVT(task, spec, tokenizer, seed, n, chat_template)
    if spec.task == "common_words_extraction":
        from .words import RulerCWE

        return RulerCWE(task, spec, tokenizer, seed, n, chat_template)
    if spec.task == "freq_words_extraction":
        from .words import RulerFWE

        return RulerFWE(task, spec, tokenizer, seed, n, chat_template)
    raise EvalError(f"task {task!r}: unknown RULER task {spec.task!r}")
