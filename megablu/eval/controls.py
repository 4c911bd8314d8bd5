"""Controls for inference-time changes in `megablu compare` (a control in every compare).

A result ran an inference-time change when it was scored with `eval.string` (either variant) or with a
rope other than the one its weights were trained with (`megablu eval --rope-override`: another YaRN
factor, another attention temperature). The change's effect on a trained arm (the arm with it minus the
arm as trained) says nothing about training by itself: STRING added 15-22 pp to every arm it touched, and
it may add as much to the parent + YaRN that was never trained at length. So every such effect is shown
beside the same change's effect on the untrained parent + YaRN (the control), or a line says it has none.

The pairing rule reads only what results record (eval/cli.py: `weights`, `model`, `rope`,
`rope_override`, `eval.string`, `tokenizer`), never arm names:
- a model is a weights fingerprint with its architecture and tokenizer; a result without a fingerprint
  is never paired;
- its trained rope is `rope_override.checkpoint` when the eval overrode the rope, else the rope it ran;
- an arm's changed result needs a control when its weights were trained with YaRN (a YaRN extension of a
  parent); changes on weights trained without it (the parent itself, the untrained parent + YaRN) are the
  control's side, not a trained arm's;
- the arm's reference: the same model at its trained rope, STRING off;
- the control: another fingerprint of the same architecture and tokenizer whose trained rope is a parent
  of the arm's by the rope lineage (the same theta and plain RoPE, or YaRN with the same original length
  and betas and a smaller factor: never another trained arm), with one result at the arm's trained rope
  with STRING off (the untrained parent + YaRN, `--rope-override`) and one at exactly the changed setting
  (the same rope, the same STRING setting). Two such fingerprints are ambiguous and neither is used;
- each effect is `compare.difference` of two cells of one model (paired where they hold the same
  prompts); a control cell on other prompts than the arm's is marked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from .compare import _score, difference
from .results import _label, cells_by, string_setting
from .stats import paired_mean_diff

NO_CONTROL = "no control on the untrained parent + YaRN: the change's effect cannot be attributed to training"


def _rope_key(rope: Optional[dict]) -> Optional[str]:
    """A rope as it computes (the allow_* switches are config permissions, not frequencies)."""
    if rope is None:
        return None
    return json.dumps({k: v for k, v in rope.items() if not k.startswith("allow_")}, sort_keys=True)


def trained_rope(res: dict) -> Optional[dict]:
    """The rope a result's weights were trained with: its --rope-override's record, else the rope it ran; None
    when the override could not read it."""
    ro = res.get("rope_override")
    return ro.get("checkpoint") if ro else res.get("rope")


def changed(res: dict) -> bool:
    """Whether the result ran an inference-time change (STRING, or a rope its weights were not trained with)."""
    return bool(string_setting(res)) or bool(res.get("rope_override"))


def change_words(res: dict) -> str:
    """The change, in words: 'STRING authors S=0.33L W=128 af=1.069' and/or 'rope <differences>'."""
    out = []
    st = string_setting(res)
    if st:
        s = f"S={st['shift_ratio']:g}L" if st["variant"] == "authors" else f"S={st['shift']}"
        out.append(
            f"STRING {st['variant']} {s} W={st['local']}"
            + (f" af={st['attention_factor']:.4g}" if st["attention_factor"] != 1 else "")
            + (f" beyond {st['beyond']}" if st["beyond"] else "")
        )
    ro = res.get("rope_override")
    if ro:
        out.append("rope " + ("; ".join(ro.get("differences") or []) or "override") + " (checkpoint vs eval)")
    return " + ".join(out)


def _model_key(res: dict) -> Optional[tuple]:
    if res.get("weights") is None:
        return None
    return res["weights"], res.get("tokenizer"), json.dumps(res.get("model"), sort_keys=True)


def _lineage_parent(p: dict, c: dict) -> bool:
    """Whether rope p can be the parent's of rope c, a YaRN extension (config/lineage.py's rules, without the
    window): the same theta; p plain, or p YaRN with c's original length and betas and a smaller factor."""
    cy, py = c.get("yarn"), p.get("yarn")
    if cy is None or p.get("theta") != c.get("theta"):
        return False
    if py is None:
        return True
    same = all(py.get(k) == cy.get(k) for k in ("original_max_position", "beta_fast", "beta_slow", "truncate"))
    return same and py.get("factor", 0) < cy.get("factor", 0)


def _setting(res: dict) -> tuple:
    return _rope_key(res.get("rope")), json.dumps(string_setting(res), sort_keys=True)


@dataclass
class Control:
    """One changed result of a trained arm: its reference (the same weights without the change) and the
    control's two results (the untrained parent + YaRN without and with the change). problem: why the
    effect cannot be attributed (None: all four are there)."""

    arm: dict
    change: str
    reference: Optional[dict] = None
    control_reference: Optional[dict] = None
    control: Optional[dict] = None
    problem: Optional[str] = None

    def four(self) -> tuple[dict, dict, dict, dict]:
        """(arm, reference, control, control_reference), for a control without a problem (all four found)."""
        assert self.reference is not None and self.control is not None and self.control_reference is not None, (
            self.problem
        )
        return self.arm, self.reference, self.control, self.control_reference


def find_controls(results: Sequence[dict]) -> list[Control]:
    """A Control for every changed result whose weights were trained with YaRN (module docstring)."""
    out = []
    for a in results:
        if not changed(a):
            continue
        tr = trained_rope(a)
        c = Control(a, change_words(a))
        key = _model_key(a)
        if tr is not None and tr.get("yarn") is None:
            continue  # weights trained without YaRN: the parent (or the untrained parent + YaRN) itself
        out.append(c)
        if key is None:
            c.problem = (
                f"{NO_CONTROL} ({_label(a)} records no weights fingerprint, so neither its reference nor "
                f"a control can be told apart; evaluate it again with megablu eval)"
            )
            continue
        if tr is None:
            c.problem = (
                f"{NO_CONTROL} ({_label(a)}'s --rope-override could not read the rope its weights were trained with)"
            )
            continue
        base = (_rope_key(tr), json.dumps(None))
        c.reference = next(
            (r for r in results if _model_key(r) == key and not changed(r) and _setting(r) == base), None
        )
        cands: dict = {}
        for r in results:
            k = _model_key(r)
            if k is None or k[0] == key[0] or k[1:] != key[1:]:
                continue
            ptr = trained_rope(r)
            if ptr is None or not _lineage_parent(ptr, tr):
                continue
            if r.get("rope_override") and not string_setting(r) and _setting(r) == base:
                cands.setdefault(k, r)
        missing = (
            []
            if c.reference is not None
            else [f"no result of {a['arm']}@{a['step']}'s weights without the change (its trained rope, STRING off)"]
        )
        if len(cands) > 1:
            names = ", ".join(f"{_label(r)} (weights {k[0][:8]})" for k, r in cands.items())
            c.problem = (
                f"{NO_CONTROL} (ambiguous: {len(cands)} untrained parents + YaRN among the inputs: {names}; "
                f"compare one of them at a time)"
            )
            continue
        if not cands:
            missing.append(
                f"no untrained parent + YaRN among the inputs: the parent evaluated with "
                f"{a['arm']}'s trained rope (megablu eval --rope-override), STRING off, of the same "
                f"architecture and tokenizer"
            )
        else:
            ((k, c0),) = cands.items()
            c.control_reference = c0
            c.control = next((r for r in results if _model_key(r) == k and _setting(r) == _setting(a)), None)
            if c.control is None:
                missing.append(f"the control {_label(c0)} was not evaluated with the change ({c.change})")
        if missing:
            c.problem = f"{NO_CONTROL} ({'; '.join(missing)})"
    # a control's own results are not trained arms of this compare (a parent that is itself a YaRN extension,
    # evaluated at the arm's factor, is a change on YaRN-trained weights, and the control of the arm)
    used = {id(r) for c in out if not c.problem for r in (c.control, c.control_reference)}
    return [c for c in out if id(c.arm) not in used]


def _effect(with_: dict, without: dict, task: str, L: int, prompts: Optional[str] = None) -> str:
    a, b = cells_by(with_, task).get(L), cells_by(without, task).get(L)
    if a is None or b is None:
        return "-"
    d, paired = difference(with_, a, without, b)
    how = (
        ("" if paired.kind == "binary" else " paired t")
        if paired is not None
        else " indep."
        if a["digest"] == b["digest"]
        else " (prompts differ)"
    )
    p = f" p {d.p:.2g}" if d.p is not None else ""
    other = " (other prompts than the arm's)" if prompts is not None and a["digest"] != prompts else ""
    return f"{100 * d.diff:+.1f} [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}]{p}{how}{other}"


def _scores(res: dict, task: str, L: int) -> dict:
    return {s.get("index"): _score(s) for s in res.get("samples", []) if (s.get("task"), s.get("length")) == (task, L)}


def _beyond_control(c: Control, task: str, L: int) -> str:
    """What the change did on the arm beyond what it did on the control: the mean over prompts of (arm with -
    arm without) - (control with - control without), a paired t interval (stats.paired_mean_diff on the halves,
    each in [-1, 1], doubled); only where all four cells hold the same prompts with every score kept."""
    four = c.four()
    cells = [x for x in (cells_by(r, task).get(L) for r in four) if x is not None]
    if len(cells) < len(four) or len({x["digest"] for x in cells}) != 1 or len({x["n"] for x in cells}) != 1:
        return "-"
    sc = [_scores(r, task, L) for r in four]
    idx = set(sc[0])
    if len(idx) != cells[0]["n"] or any(set(x) != idx or None in x.values() for x in sc):
        return "-"
    d = paired_mean_diff([((sc[0][i] - sc[1][i]) - (sc[2][i] - sc[3][i])) / 2 for i in sorted(idx)])
    return f"{200 * d.diff:+.1f} [{200 * d.lo:+.1f}, {200 * d.hi:+.1f}] p {d.p:.2g}"


def controls_markdown(controls: Sequence[Control]) -> list[str]:
    """The compare's controls section: per changed result, its effect beside the control's, or its problem."""
    if not controls:
        return []
    lines = [
        "### controls: inference-time changes beside the same change on the untrained parent + YaRN",
        "",
        "Effect of a change = the result with it minus the same weights without it, in pp, 95% interval: "
        "paired where both scored the same prompts (Newcombe's paired interval, or 'paired t' for part "
        "credit), else marked; p = that test's two-sided p, not adjusted (these cells are not in the Holm "
        "family of the difference tables). An effect as large on the control is not the training's: "
        "'trained - control' is the per-prompt difference of the two effects (paired t interval), where all "
        "four results scored the same prompts.",
        "",
    ]
    for c in controls:
        title = f"#### {_label(c.arm)}: {c.change}"
        if c.problem:
            lines += [title, "", f"**{c.change}: {c.problem}.**", ""]
            continue
        a, a0, k, k0 = c.four()
        tasks = list(dict.fromkeys(x["task"] for x in a["cells"]))
        lines += [title, "", f"trained: {_label(a)} minus {_label(a0)}; control: {_label(k)} minus {_label(k0)}", ""]
        for task in tasks:
            lengths = sorted(cells_by(a, task))
            lines += [
                f"{task}:",
                "",
                "| effect on | " + " | ".join(map(str, lengths)) + " |",
                "|---|" + "---|" * len(lengths),
            ]
            mine = cells_by(a, task)
            lines.append("| trained | " + " | ".join(_effect(a, a0, task, L) for L in lengths) + " |")
            lines.append(
                "| control | " + " | ".join(_effect(k, k0, task, L, mine[L]["digest"]) for L in lengths) + " |"
            )
            lines.append("| trained - control | " + " | ".join(_beyond_control(c, task, L) for L in lengths) + " |")
            lines.append("")
    return lines


def missing_controls(controls: Sequence[Control]) -> list[str]:
    """One line per changed result without a complete control (what --require-controls refuses)."""
    return [f"{_label(c.arm)}: {c.change}: {c.problem}" for c in controls if c.problem]
