"""RULER as published (Hsieh et al. 2024, arXiv 2404.06654): its 11 synthetic tasks, by RULER's own
definitions, under the names `ruler_<RULER's name>`; megablu.eval.ruler builds them.

Each spec transcribes one entry of NVIDIA/RULER scripts/synthetic.yaml (the task's script and its
args) and its tokens_to_generate from scripts/data/synthetic/constants.py. The `ruler_` prefix keeps
them apart from megablu's own RULER-like tasks (niah_single_1, vt, cwe, ...: other templates and
haystacks, see docs/EVAL.md): a cell's task name says which definition produced it, in every result
and every merge. `eval.suite: ruler` selects all 11.

Length: a RULER task at length L builds prompts of exactly L - tokens_to_generate tokens, so the
prompt plus the generation budget is L, RULER's max_seq_length (its prompts fill up to that).

The two QA tasks (qa_1: SQuAD, qa_2: HotpotQA) are left out: their data is downloaded at run time
(RULER's download_qa_dataset.sh) and cannot be fetched here.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class RulerSpec(BaseModel):
    """One RULER task (synthetic.yaml's `task` and `args`; fields named as RULER's arguments)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: Literal["ruler"] = "ruler"
    task: Literal["niah", "variable_tracking", "common_words_extraction", "freq_words_extraction"]
    tokens_to_generate: int = Field(gt=0, description="RULER's generation budget (constants.py)")
    # niah
    type_haystack: Optional[Literal["noise", "essay", "needle"]] = None
    type_needle_k: Literal["words", "numbers", "uuids"] = "words"
    type_needle_v: Literal["words", "numbers", "uuids"] = "numbers"
    num_needle_k: int = Field(default=1, ge=1)
    num_needle_v: int = Field(default=1, ge=1)
    num_needle_q: int = Field(default=1, ge=1)
    # variable_tracking
    num_chains: int = Field(default=1, ge=1)
    num_hops: int = Field(default=4, ge=1)
    # common_words_extraction
    freq_cw: int = Field(default=30, ge=2)
    freq_ucw: int = Field(default=3, ge=1)
    num_cw: int = Field(default=10, ge=1)
    # freq_words_extraction
    alpha: float = Field(default=2.0, gt=1.0)

    @property
    def max_new(self) -> int:
        return self.tokens_to_generate

    def min_words(self) -> int:
        """A tokenizer-free lower bound on length L (prompt + budget): the fixed content's words, each
        at least one token, plus tokens_to_generate (harness.preflight_problems checks it exactly)."""
        fixed = {
            "niah": 50 + 10 * max(self.num_needle_k, self.num_needle_q) * self.num_needle_v,
            "variable_tracking": 120 + 10 * self.num_chains * (self.num_hops + 1),
            "common_words_extraction": 60 + 2 * (40 + self.num_cw * 6),
            "freq_words_extraction": 60 + 3 * 10,
        }[self.task]
        return fixed + self.tokens_to_generate


def _niah(haystack, k="words", v="numbers", nk=1, nv=1, nq=1) -> RulerSpec:
    # tokens_to_generate 128: constants.py TASKS['niah']
    return RulerSpec(
        task="niah",
        tokens_to_generate=128,
        type_haystack=haystack,
        type_needle_k=k,
        type_needle_v=v,
        num_needle_k=nk,
        num_needle_v=nv,
        num_needle_q=nq,
    )


# scripts/synthetic.yaml, in its order (config_tasks.sh's `synthetic` list less qa_1, qa_2)
RULER_PRESETS: dict[str, RulerSpec] = {
    "ruler_niah_single_1": _niah("noise"),
    "ruler_niah_single_2": _niah("essay"),
    "ruler_niah_single_3": _niah("essay", v="uuids"),
    "ruler_niah_multikey_1": _niah("essay", nk=4),
    "ruler_niah_multikey_2": _niah("needle"),
    "ruler_niah_multikey_3": _niah("needle", k="uuids", v="uuids"),
    "ruler_niah_multivalue": _niah("essay", nv=4),
    "ruler_niah_multiquery": _niah("essay", nq=4),
    "ruler_vt": RulerSpec(
        task="variable_tracking", tokens_to_generate=30, type_haystack="noise", num_chains=1, num_hops=4
    ),
    "ruler_cwe": RulerSpec(task="common_words_extraction", tokens_to_generate=120, freq_cw=30, freq_ucw=3, num_cw=10),
    "ruler_fwe": RulerSpec(task="freq_words_extraction", tokens_to_generate=50, alpha=2.0),
}
RULER_TASKS = tuple(RULER_PRESETS)

# eval.suite names -> the tasks they select
SUITES: dict[str, tuple[str, ...]] = {"ruler": RULER_TASKS}
