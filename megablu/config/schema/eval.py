"""The eval section: lengths, tasks, the gate, the held-out loss, STRING at evaluation, and the eval's
checks against the window that need no tokenizer (eval_problems, string_problems)."""

from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import Field, PositiveInt, field_validator, model_serializer, model_validator

from ..eval_tasks import PRESETS, TaskSpec, default_max_new, min_words, needs_text_haystack
from ..ruler_tasks import SUITES
from .base import Section


class GateConfig(Section):
    parent: Optional[str] = Field(default=None, description="parent eval json to gate against")
    short_lengths: list[PositiveInt] = [1024, 4096]
    margin_pp: float = Field(default=5.0, ge=0)
    loss_margin_rel: float = Field(
        default=0.02,
        ge=0,
        description="short-document validation loss (eval.loss) "
        "may rise at most this fraction above the parent's: 0.02 = +2% nats/token",
    )
    ruler_at_window: bool = Field(
        default=True,
        description="also gate every RULER task (ruler_*) at the parent's "
        "window: the longest length the parent result has for it (megablu/eval/gate.py)",
    )


class LossEvalConfig(Section):
    """Held-out language-modelling loss beside the retrieval tasks (megablu/eval/loss.py)."""

    data: Optional[str] = Field(
        default=None,
        description="dataset dir ('DIR' or 'DIR@bucket') whose val split is "
        "scored: loss per token at each eval length, and on whole short documents",
    )
    n: int = Field(default=8, gt=0, description="sequences of exactly L val tokens per eval length")
    short_docs: int = Field(
        default=200,
        ge=0,
        description="val documents of short_min..short_max tokens scored "
        "whole (the gate's short-context loss); 0 = none",
    )
    short_min: int = Field(default=1024, gt=0)
    short_max: int = Field(default=4096, gt=0)
    sets: dict[str, str] = Field(
        default={},
        description="more held-out sets, by name, each scored like data: "
        "'DIR' or 'DIR@bucket' (a dataset's val split) or 'megablu:essays' (the shipped "
        "prose, outside every training corpus here; docs/EVAL.md)",
    )

    @field_validator("sets")
    @classmethod
    def _set_names(cls, v):
        import re

        bad = [k for k in v if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", k) or k == "data"]
        if bad:
            raise ValueError(
                f"eval.loss.sets: names {bad} are not plain names (letters, digits, _ . -; not 'data', "
                f"which is eval.loss.data's); rename them"
            )
        return v


# STRING's attention factor in the authors' code (HKUNLP/STRING string_for_llama.py replace_with_string and
# vllm_string's rotary_embedding.py: 0.1 * ln(2) + 1, YaRN's mscale at scale 2): it multiplies the rotary cos and
# sin, so q and k alike, and the attention logits by its square, at every distance, whenever STRING is on.
STRING_AUTHORS_FACTOR = 0.1 * math.log(2) + 1
STRING_AUTHORS_RATIO = 0.33  # shifted_ratio: ruler/test_ruler_llama.py's default and the README's
STRING_AUTHORS_LOCAL = 128  # local_value / small_local_value: their Llama default


class StringConfig(Section):
    """STRING at evaluation (An et al. 2024, "Why Does the Effective Context Length of LLMs Fall Short?",
    arXiv 2410.18745; megablu/model/string.py): each relative distance d >= S is attended as d - S + W
    (local), so the largest distances reuse well-trained positions; distances below S are unchanged, and the
    attention logits are multiplied by attention_factor**2 (the factor multiplies q and k). Inference only.

    Two variants (docs/EVAL.md):
      authors      (default) the authors' code (HKUNLP/STRING): S = int(shift_ratio * L) for an input built to
                   L tokens (an eval length, a held-out sequence's length), shift_ratio 0.33, local 128,
                   attention_factor 1 + 0.1 ln 2;
      fixed_shift  megablu's earlier variant: S = `shift` tokens at every length, attention_factor 1."""

    variant: Literal["authors", "fixed_shift"] = Field(
        default="authors",
        description="authors: S = shift_ratio x "
        "the input's length, the authors' factor; fixed_shift: S = "
        "shift tokens at every length, no factor",
    )
    shift_ratio: Optional[float] = Field(
        default=None,
        gt=0,
        lt=1,
        description=f"authors: S = int(shift_ratio * L) for an input of L tokens (default {STRING_AUTHORS_RATIO})",
    )
    shift: Optional[int] = Field(
        default=None,
        strict=True,
        gt=0,
        description="fixed_shift: S in tokens, the same at every length (required there)",
    )
    local: Optional[int] = Field(
        default=None,
        strict=True,
        ge=0,
        description="W: the position a distance of "
        f"exactly S becomes; W < S (authors default {STRING_AUTHORS_LOCAL}; fixed_shift: "
        "required)",
    )
    attention_factor: Optional[float] = Field(
        default=None,
        gt=0,
        description="multiplies q and k (the logits by "
        "its square) whenever STRING is on (default: authors "
        f"{STRING_AUTHORS_FACTOR:.6f} = 1 + 0.1 ln 2, fixed_shift 1)",
    )
    beyond: int = Field(
        default=0,
        strict=True,
        ge=0,
        description="STRING only for prompts (and held-out loss "
        "sequences) longer than this many tokens; shorter ones are evaluated plain. 0: every "
        "length",
    )
    kernel: Literal["auto", "sdpa", "flex"] = Field(
        default="auto",
        description="the kernel of STRING's attention (megablu/model/string.py): sdpa = masked "
        "SDPA over the plain and shifted keys, per block of query rows (any device); flex = FlexAttention "
        "skipping the tiles with no visible pair (compiled on CUDA); auto = flex on CUDA for a prefill, sdpa "
        "otherwise. The same attention up to the order of float sums: how, not what, so every JSON dump leaves "
        "it out (the result's eval.string, the resolved config, the config hash); the result records it as "
        "string_kernel, and the calls each kernel ran as string_kernels_used",
    )

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data):
        """The variant's defaults written into the setting, so a resolved config and a result record the
        values that ran (a before-validator: assigning in an after-validator would validate again)."""
        if not isinstance(data, dict):
            return data
        d = dict(data)
        defaults = {
            "authors": {
                "shift_ratio": STRING_AUTHORS_RATIO,
                "local": STRING_AUTHORS_LOCAL,
                "attention_factor": STRING_AUTHORS_FACTOR,
            },
            "fixed_shift": {"attention_factor": 1.0},
        }.get(d.get("variant", "authors"), {})
        for k, v in defaults.items():
            if d.get(k) is None:
                d[k] = v
        return d

    @model_validator(mode="after")
    def _fields(self):
        if self.variant == "authors":
            if self.shift is not None:
                raise ValueError(
                    f"eval.string: shift={self.shift} (tokens at every length) is variant fixed_shift's "
                    f"field; variant authors (the default) takes S = shift_ratio x the input's length: "
                    f"set eval.string.variant=fixed_shift to keep S={self.shift}, or drop shift (and set "
                    f"shift_ratio, default {STRING_AUTHORS_RATIO})"
                )
            return self
        if self.shift_ratio is not None:
            raise ValueError(
                f"eval.string: shift_ratio={self.shift_ratio} with variant fixed_shift, whose S is "
                f"`shift` tokens; set variant=authors for S = shift_ratio x the input's length, or drop "
                f"shift_ratio"
            )
        missing = [f for f in ("shift", "local") if getattr(self, f) is None]
        if missing:
            raise ValueError(
                f"eval.string: variant fixed_shift needs {' and '.join(missing)} (no default: S and W in "
                f"tokens, e.g. shift=10922, local=128), or use variant authors (S = "
                f"{STRING_AUTHORS_RATIO} x the input's length, W = {STRING_AUTHORS_LOCAL})"
            )
        if self.local >= self.shift:
            raise ValueError(
                f"eval.string: local={self.local} >= shift={self.shift}; STRING maps distances d >= "
                f"shift to d - shift + local, which only moves them closer when local < shift: set "
                f"local < shift (e.g. shift=10922, local=128)"
            )
        return self

    @model_serializer(mode="wrap")
    def _kernel_not_in_json(self, handler, info):
        """kernel out of the JSON dumps (see the field): two results that differ by it scored the same model"""
        d = handler(self)
        if info.mode == "json":
            d.pop("kernel", None)
        return d

    def applies(self, length: int) -> bool:
        """Whether STRING runs on a prompt or a sequence of `length` tokens (eval.string.beyond)."""
        return length > self.beyond

    def shift_for(self, length: int) -> int:
        """S for an input built to `length` tokens: `shift` (fixed_shift) or int(shift_ratio * length) (authors,
        as their eval scripts compute shifted_offset from the test length)."""
        # the validators fill shift_ratio (authors) and require shift (fixed_shift)
        if self.variant == "fixed_shift":
            assert self.shift is not None
            return self.shift
        assert self.shift_ratio is not None
        return int(self.shift_ratio * length)


class EvalConfig(Section):
    lengths: list[PositiveInt] = Field(
        default=[],
        description="prompt lengths in tokens; each must hold every "
        "task's prompt without filler (checked against the tokenizer)",
    )
    max_new: int = Field(
        default=24,
        gt=0,
        description="tokens generated for passkey/needle/multikey (the other "
        "tasks have their own budget, megablu.config.eval_tasks.default_max_new)",
    )
    pad: int = Field(default=256, gt=0)
    tasks: list[str] = Field(
        default=["passkey"],
        description="task names: the built-in ones (megablu.config.eval_tasks.PRESETS) or names defined in task_defs",
    )
    task_defs: dict[str, TaskSpec] = Field(
        default={}, description="tasks of your own, by name: a family and its options (megablu/config/eval_tasks.py)"
    )
    n: int = Field(default=50, gt=0, description="prompts per (task, length)")
    seed: int = Field(default=0, ge=0)
    at_steps: list[int] = []
    final: bool = False
    haystack: Optional[str] = Field(default=None, description="dataset dir whose val text is the haystack")
    loss: LossEvalConfig = LossEvalConfig()
    gate: GateConfig = GateConfig()
    string: Optional[StringConfig] = Field(
        default=None,
        description="STRING position remapping at evaluation "
        "({variant: authors | fixed_shift, ...}; megablu/model/string.py); "
        "null = off",
    )
    suite: Optional[str] = Field(
        default=None,
        description="a named set of tasks added to eval.tasks (alone when "
        "eval.tasks is not given): 'ruler' = RULER's 11 synthetic tasks as published, "
        "ruler_niah_single_1 ... ruler_fwe (megablu/config/ruler_tasks.py)",
    )
    decode: Literal["auto", "eager", "static", "graph"] = Field(
        default="auto",
        description="how generation runs its one-token steps (megablu/eval/decode.py): auto = CUDA "
        "graphs where the model allows them (one rank, no STRING, no hooks), eager otherwise; the "
        "same tokens either way",
    )
    chat_template: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="wrap the ruler_* prompts in the "
        "tokenizer's chat template, as RULER does for a chat model: "
        "auto = when the tokenizer has one; on = required (an error "
        "without one); off = plain text",
    )

    @field_validator("chat_template", mode="before")
    @classmethod
    def _yaml_on_off(cls, v):
        # YAML 1.1 reads a bare on / off as a bool: `chat_template: on` means "on"
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_not_bool(cls, v):
        if isinstance(v, bool):  # pydantic would take true as 1: seed 1's prompts under another name
            raise ValueError(
                f"eval.seed={v!r}: a bool is not a seed (true would reproduce seed 1's prompts); give "
                f"an integer >= 0, e.g. eval.seed=1"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _suite(cls, data):
        """eval.suite -> its tasks, after eval.tasks when given (in place of the default otherwise)."""
        if not isinstance(data, dict) or data.get("suite") is None:
            return data
        name = data["suite"]
        if name not in SUITES:
            raise ValueError(
                f"eval.suite={name!r} is not a suite; known: {sorted(SUITES)} ('ruler': RULER's 11 "
                f"synthetic tasks as published); or list the tasks in eval.tasks"
            )
        tasks = list(data.get("tasks") or [])
        return {**data, "tasks": tasks + [t for t in SUITES[name] if t not in tasks]}

    @model_validator(mode="after")
    def _tasks(self):
        clash = sorted(set(self.task_defs) & set(PRESETS))
        if clash:
            raise ValueError(
                f"eval.task_defs: {clash} are built-in task names (they mean the same prompts in every "
                f"config); give your variant another name"
            )
        unknown = [t for t in self.tasks if t not in PRESETS and t not in self.task_defs]
        if unknown:
            raise ValueError(
                f"eval.tasks: unknown task(s) {unknown}; known tasks: {sorted(PRESETS)}"
                + (f" and task_defs {sorted(self.task_defs)}" if self.task_defs else "")
                + "; or define one under eval.task_defs"
            )
        if not self.tasks:
            raise ValueError("eval.tasks is empty: name at least one task")
        return self

    def spec(self, task: str):
        """The task's typed spec (a built-in preset or an eval.task_defs entry)."""
        return self.task_defs.get(task) or PRESETS[task]

    def task_max_new(self, task: str) -> int:
        return default_max_new(self.spec(task)) or self.max_new

    def task_prompt_len(self, task: str, length: int) -> int:
        """Prompt tokens of task@length: the length itself, except RULER's tasks, whose length counts the
        generation budget too (RULER's max_seq_length), so their prompts are length - tokens_to_generate."""
        return length - self.task_max_new(task) if self.spec(task).family == "ruler" else length


def eval_padded_len(length: int, max_new: int, pad: int) -> int:
    """prompt + generated tokens, rounded up to a multiple of pad (the eval's PAD rule)."""
    return math.ceil((length + max_new) / pad) * pad


def eval_problems(e: EvalConfig, window: int) -> list[str]:
    """The eval section against the window, tokenizer-free (check_invariants calls it): the PAD
    rule per task (each task has its own max_new), each task's minimum content (a lower bound:
    megablu.eval.harness.preflight_problems checks it exactly in the run's tokenizer), the
    haystack a task needs, the gate's lengths, the loss section."""
    errs = []
    for task in dict.fromkeys(e.tasks):
        spec, mn = e.spec(task), e.task_max_new(task)
        for L in e.lengths:
            padded = eval_padded_len(e.task_prompt_len(task, L), mn, e.pad)
            if padded > window:
                fit = (window // e.pad) * e.pad - (mn if spec.family != "ruler" else 0)
                errs.append(
                    f"eval.lengths: {task}@{L} + max_new {mn} pads to {padded} at pad {e.pad} > data.window "
                    f"{window}; the longest length that fits is {fit}"
                )
        short = [L for L in e.lengths if L < min_words(spec)]
        if short:
            errs.append(
                f"eval.lengths: {short} cannot hold task {task}'s content (at least {min_words(spec)} tokens: "
                f"instruction, needles/list, question); drop those lengths or the task"
            )
        if needs_text_haystack(spec) and not e.haystack:
            errs.append(
                f"eval.haystack: task {task} needs a real-text haystack; set eval.haystack to a dataset dir "
                f"(its val split is the haystack, e.g. data_cache/demo@b3) or drop the task"
            )
    if (e.at_steps or e.final) and not e.lengths:
        errs.append("eval.lengths: empty but eval.at_steps/eval.final ask for evaluation")
    for L in e.gate.short_lengths:
        if e.gate.parent and L not in e.lengths:
            errs.append(f"eval.gate.short_lengths: {L} is not in eval.lengths {e.lengths}; the gate cannot check it")
    errs += string_problems(e)
    lo = e.loss
    if lo.short_min > lo.short_max:
        errs.append(f"eval.loss: short_min={lo.short_min} > short_max={lo.short_max}")
    if (lo.data or lo.sets) and lo.short_docs and lo.short_max > window:
        errs.append(f"eval.loss.short_max={lo.short_max} > data.window {window}: a short document must fit the window")
    return errs


def string_problems(e: EvalConfig) -> list[str]:
    """eval.string against the lengths it runs at (eval_problems and run_eval call it): at each eval length L
    where it applies (L > beyond), S must lie inside the prompt (fixed_shift: shift < L; else no distance of the
    prompt reaches S) and above W (authors: int(shift_ratio * L) > local, else a "shifted" distance would move
    farther). The held-out loss's short documents (authors: S follows each one's length) are checked at the
    shortest one STRING applies to."""
    st = e.string
    if st is None:
        return []
    W = st.local
    assert W is not None  # StringConfig's validators fill it (authors) or require it (fixed_shift)
    errs = []
    for L in sorted(set(e.lengths)):
        if not st.applies(L):
            continue
        S = st.shift_for(L)
        if st.variant == "fixed_shift" and S >= L:
            errs.append(
                f"eval.string.shift={S} >= eval length {L} (variant fixed_shift, beyond={st.beyond}): no "
                f"distance in a {L}-token prompt reaches S, so STRING would only touch the answer; set "
                f"eval.string.beyond >= {L} to evaluate that length plain, a shift below {L}, or "
                f"variant authors (S = shift_ratio x the length)"
            )
        elif S <= W:
            errs.append(
                f"eval.string at length {L}: S = int(shift_ratio {st.shift_ratio:g} x {L}) = {S} <= local="
                f"{st.local}; STRING moves distances d >= S to d - S + local, closer only when local < S: "
                f"raise shift_ratio, lower local, or set eval.string.beyond >= {L}"
            )
    lo = e.loss
    if st.variant == "authors" and (lo.data or lo.sets) and lo.short_docs:
        shortest = max(lo.short_min, st.beyond + 1)
        if shortest <= lo.short_max and st.shift_for(shortest) <= W:
            errs.append(
                f"eval.string with eval.loss short documents: at {shortest} tokens S = int(shift_ratio "
                f"{st.shift_ratio:g} x {shortest}) = {st.shift_for(shortest)} <= local={st.local}; raise "
                f"eval.loss.short_min or eval.string.beyond, or lower local"
            )
    return errs
