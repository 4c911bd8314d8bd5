"""Eval tasks as typed config: megablu's RULER-like suite (niah_*, vt, cwe, fwe: RULER's task structure,
Hsieh et al. 2024, arXiv 2404.06654, with megablu's own templates and haystacks -- not comparable to
published RULER numbers), RULER as published (ruler_*, megablu/config/ruler_tasks.py) and the
harness's original passkey / needle / multikey.

A task is a name in `eval.tasks`. The built-in names (PRESETS) mean the same prompts in every
config, so arms are comparable by name; a variant gets its own name under `eval.task_defs`
(`{my_niah: {family: niah, haystack: kv, key: uuids, value: uuids}}`), never a redefinition
of a built-in one. Each family's fields are documented once here; docs/EVAL.md shows the
templates, the scoring and the statistics.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .ruler_tasks import RULER_PRESETS, RULER_TASKS


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new: Optional[int] = Field(
        default=None,
        gt=0,
        description="tokens generated per prompt; None: eval.max_new "
        "for passkey/needle, the family's default otherwise (RULER's budget, rounded)",
    )


class PasskeySpec(_Spec):
    """Landmark/YaRN passkey: a 5-digit key in repeated filler; exact match of the first digit run."""

    family: Literal["passkey"] = "passkey"
    digits: int = Field(
        default=5,
        ge=1,
        le=9,
        description="digits of the key (1: the one digit token in the "
        "filler, a retrieval a tiny model learns in minutes; chance is 10%)",
    )
    depth: tuple[float, float] = Field(
        default=(0.0, 1.0),
        description="[lo, hi]: the needle's depths, stratified "
        "over this share of the filler (0 = first); [0, 0.3] keeps every key far from "
        "its question, the retrieval a YaRN extension has to learn",
    )

    @model_validator(mode="after")
    def _depth(self):
        lo, hi = self.depth
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(
                f"passkey: depth={list(self.depth)} needs 0 <= lo < hi <= 1 (e.g. [0, 0.3]: keys far from the question)"
            )
        return self


class NeedleSpec(_Spec):
    """The original real-text needle (7-digit value for an adjective-noun key), `distractors` other
    needles; exact match of the first digit run."""

    family: Literal["needle"] = "needle"
    distractors: int = Field(default=0, ge=0)


class NiahSpec(_Spec):
    """RULER's needle-in-a-haystack family (niah.py): `keys` needles with distinct keys, each with
    `values` values; `queries` of the keys are asked and every value of every asked key is an
    answer (string_match_all: part credit per answer found)."""

    family: Literal["niah"] = "niah"
    haystack: Literal["filler", "text", "kv"] = Field(
        description="filler: the repeated grass/sky sentences; "
        "text: real text (eval.haystack's val split); kv: lines of "
        "other key-value needles"
    )
    key: Literal["words", "numbers", "uuids"] = "words"
    value: Literal["numbers", "words", "uuids"] = "numbers"
    keys: int = Field(default=1, ge=1, description="needles with distinct keys (asked ones + distractors)")
    values: int = Field(default=1, ge=1, description="values per key, all expected")
    queries: int = Field(default=1, ge=1, description="keys asked, <= keys")

    @model_validator(mode="after")
    def _q(self):
        if self.queries > self.keys:
            raise ValueError(f"niah: queries={self.queries} > keys={self.keys}; a question needs a needle")
        return self


class VTSpec(_Spec):
    """RULER variable tracking (variable_tracking.py): `chains` chains of `hops` assignments
    VAR B = VAR A hidden in filler; the answer is every variable bound to the asked value."""

    family: Literal["vt"] = "vt"
    chains: int = Field(default=1, ge=1)
    hops: int = Field(default=4, ge=1)


class CWESpec(_Spec):
    """RULER common words extraction: a numbered list where `common` words appear `freq_common`
    times and the others `freq_uncommon` times; answer: the common words."""

    family: Literal["cwe"] = "cwe"
    common: int = Field(default=10, ge=1)
    freq_common: int = Field(default=30, ge=2)
    freq_uncommon: int = Field(default=3, ge=1)

    @model_validator(mode="after")
    def _f(self):
        if self.freq_uncommon >= self.freq_common:
            raise ValueError(
                f"cwe: freq_uncommon={self.freq_uncommon} >= freq_common={self.freq_common}: "
                f"the common words would not be the most common"
            )
        return self


class FWESpec(_Spec):
    """RULER frequent words extraction: coded words drawn from a Zipf(alpha) law; answer: the
    `top` most frequent."""

    family: Literal["fwe"] = "fwe"
    alpha: float = Field(default=2.0, gt=1.0)
    top: int = Field(default=3, ge=1)


TaskSpec = Annotated[Union[PasskeySpec, NeedleSpec, NiahSpec, VTSpec, CWESpec, FWESpec], Field(discriminator="family")]

# megablu's RULER-like tasks under RULER's task names (its synthetic.yaml) with our haystack names:
# noise -> filler, essay -> text (a val split of a dataset), needle -> kv. RULER as published: ruler_*.
PRESETS: dict[str, BaseModel] = {
    "passkey": PasskeySpec(),
    "needle": NeedleSpec(),
    "multikey": NeedleSpec(distractors=3),
    "niah_single_1": NiahSpec(haystack="filler", key="words", value="numbers"),
    "niah_single_2": NiahSpec(haystack="text", key="words", value="numbers"),
    "niah_single_3": NiahSpec(haystack="text", key="words", value="uuids"),
    "niah_multikey_1": NiahSpec(haystack="text", key="words", value="numbers", keys=4),
    "niah_multikey_2": NiahSpec(haystack="kv", key="words", value="numbers"),
    "niah_multikey_3": NiahSpec(haystack="kv", key="uuids", value="uuids"),
    "niah_multivalue": NiahSpec(haystack="text", key="words", value="numbers", values=4),
    "niah_multiquery": NiahSpec(haystack="text", key="words", value="numbers", keys=4, queries=4),
    "vt": VTSpec(),
    "cwe": CWESpec(),
    "fwe": FWESpec(),
    **RULER_PRESETS,
}
# RULER's 11 synthetic tasks as published (its 13 less the two QA tasks, which need SQuAD/HotpotQA): the
# "RULER average" of a report
RULER_SUITE = RULER_TASKS
# megablu's RULER-like tasks: their own average, never called RULER's
MEGABLU_SUITE = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)

# answer tokens RULER budgets (tokens_to_generate: niah 128, vt 30, cwe 120, fwe 50), cut to what
# the answers need: 7-digit numbers and words take < 10 tokens each, a UUID up to ~30
_UUID_TOKENS, _ITEM_TOKENS = 32, 12


def default_max_new(spec) -> Optional[int]:
    """The family's generation budget (None: eval.max_new, for passkey/needle)."""
    if spec.max_new is not None:
        return spec.max_new
    if spec.family == "niah":
        per = _UUID_TOKENS if spec.value == "uuids" else _ITEM_TOKENS
        return max(32, per * spec.values * spec.queries + 8)
    if spec.family == "vt":
        return 32 + 8 * spec.chains * spec.hops
    return {"cwe": 128, "fwe": 64}.get(spec.family)


def needs_text_haystack(spec) -> bool:
    return spec.family == "needle" or (spec.family == "niah" and spec.haystack == "text")


def min_words(spec) -> int:
    """A tokenizer-free lower bound on a task's prompt tokens: whitespace-separated words of its
    fixed content (instruction, needles, question; cwe's shortest list), each at least one token
    in the byte-level BPE and sentencepiece tokenizers megablu loads. The exact minimum, in the
    run's tokenizer, is checked by megablu.eval.harness.preflight_problems."""
    if spec.family == "ruler":
        return spec.min_words()
    if spec.family == "passkey":
        return 45
    if spec.family == "needle":
        return 45 + 10 * spec.distractors
    if spec.family == "niah":
        return 45 + 10 * spec.keys * spec.values
    if spec.family == "vt":
        return 60 + 4 * spec.chains * (spec.hops + 1)
    if spec.family == "cwe":
        # the one-shot example plus every common word freq_common times and one uncommon word, "i. w"
        return 120 + 2 * (spec.common * spec.freq_common + spec.freq_uncommon)
    return 100 + 3 * spec.top * 3  # fwe: the top words must each appear more often than the next


# every built-in task name (a config may add its own under eval.task_defs)
ALL_TASKS = tuple(PRESETS)
