"""Short-context gate: an arm may not buy long-context accuracy with short-context accuracy.

A KV-cache bug can lift a long length from 0 to 14-17% while 4k falls from 74% to 16%, and
perplexity look fine. So a drop at any short length (default 1024 and 4096) of more
than margin_pp below the parent fails, whatever the long lengths did. A short length the
gate cannot check (missing in either result) fails too: an unchecked gate is not a pass.

Passkey and needle at 1k/4k are at ceiling for most parents, so they see little. RULER's tasks
(ruler_*) are gated as well at the parent's window (`ruler_at_window`): at the longest length the
parent result has for each (every length of a gate parent fits its window), with the same margin.

Retrieval is not all of short context: when the arm measured the held-out short-document loss
(eval.loss.data, and each set of eval.loss.sets: text from outside the training corpus, e.g. the
shipped essays), it may rise at most loss_margin_rel (relative) above the parent's on every set, so
an arm that keeps its passkey but loses language modelling fails too. A parent without that loss
cannot check it (fails as unchecked).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from ..config.eval_tasks import RULER_SUITE
from .compare import difference, short_loss_change
from .results import cells_by, loss_section, string_setting


def inference_changes(res: dict) -> list[str]:
    """What a result changed at inference against the model as trained: STRING, or a rope other than the
    checkpoint's (--rope-override). A gate parent must have neither: the gate asks whether the arm kept
    what the parent, as trained, could do."""
    out = []
    st = string_setting(res)
    if st:
        out.append(f"eval.string={st}")
    ro = res.get("rope_override")
    if ro:
        out.append(f"--rope-override ({'; '.join(ro.get('differences') or []) or 'rope not recorded'})")
    return out


@dataclass
class GateResult:
    passed: bool
    message: str
    checks: list = field(default_factory=list)
    unchecked: list = field(default_factory=list)  # what could not be checked (each one fails the gate)

    def as_dict(self) -> dict:
        return {"passed": self.passed, "message": self.message, "checks": self.checks, "unchecked": self.unchecked}

    @property
    def verdict(self) -> str:
        """passed | FAILED (a check failed) | UNCHECKED (none failed, but something could not be checked)."""
        if self.passed:
            return "passed"
        return "FAILED" if any(not c["passed"] for c in self.checks) else "UNCHECKED"


def window_length(parent: dict, task: str) -> Optional[int]:
    """The length a RULER task is gated at beside the short lengths: the longest the parent result has for it
    (a gate parent ran as trained, so each of its lengths fits its window); None for other tasks or none."""
    if task not in RULER_SUITE:
        return None
    return max(cells_by(parent, task), default=None)


def gate_lengths(parent: dict, task: str, gate_cfg) -> list[int]:
    """Where `task` is gated: eval.gate.short_lengths, and for a RULER task the parent's window length
    (window_length) when gate_cfg.ruler_at_window."""
    out = list(gate_cfg.short_lengths)
    w = window_length(parent, task) if getattr(gate_cfg, "ruler_at_window", True) else None
    return out + ([w] if w is not None and w not in out else [])


def parent_problems(
    parent: dict,
    gate_cfg,
    tasks,
    loss: bool = False,
    lengths: Optional[Sequence[int]] = None,
    loss_sets: Sequence[str] = (),
) -> list[str]:
    """Why `parent` cannot gate an eval of `tasks` ([] if it can): check_gate fails as unchecked
    a parent that shares no task with the arm, or lacks a short length of a shared task, or (with the
    arm's `lengths`) a RULER task's window length the arm will not measure, or a held-out loss set of the
    arm's (`loss`: eval.loss.data, `loss_sets`: names of eval.loss.sets). A caller about to spend hours on
    generation (or on training) asks this first."""
    have = {(c["task"], c["length"]) for c in parent.get("cells", [])}
    name = parent.get("_path") or f"{parent.get('arm')}@{parent.get('step')}"
    shared = [t for t in dict.fromkeys(tasks) if any(t == h for h, _ in have)]
    missing = (
        [f"{t}@{L}" for t in shared for L in gate_cfg.short_lengths if (t, L) not in have]
        if shared
        else [f"any of the tasks {list(dict.fromkeys(tasks))}"]
    )
    out = []
    if lengths is not None:
        unmeasured = [
            f"{t}@{L}"
            for t in shared
            for L in gate_lengths(parent, t, gate_cfg)
            if L not in gate_cfg.short_lengths and L not in lengths
        ]
        if unmeasured:
            out.append(
                f"the gate checks RULER's tasks at the parent's window too ({', '.join(unmeasured)}: the "
                f"longest length {name} has for each), but eval.lengths {list(lengths)} leaves them out: add "
                f"them to eval.lengths, or set eval.gate.ruler_at_window=false"
            )
    for s in loss_sets:
        if not (loss_section(parent, s) or {}).get("short"):
            out.append(
                f"gate parent {name} has no short-document loss on eval.loss.sets.{s} (result['loss_sets']"
                f"[{s!r}]['short']), so the loss gate could not be checked there; evaluate the parent with the "
                f"same eval.loss.sets first"
            )
    changed = inference_changes(parent)
    if changed:
        out.append(
            f"gate parent {name} was evaluated with an inference-time change ({'; '.join(changed)}): the gate "
            f"compares against the parent as trained; evaluate the parent without it and gate against that"
        )
    if loss and not (parent.get("loss") or {}).get("short"):
        out.append(
            f"gate parent {name} has no short-document loss (result['loss']['short']), so the loss gate could "
            f"not be checked; evaluate the parent with the same eval.loss.data first"
        )
    if not missing:
        return out
    return out + [
        f"gate parent {name} has no result for {', '.join(missing)} (it has "
        f"{', '.join(f'{t}@{L}' for t, L in sorted(have)) or 'nothing'}), so the gate could not be checked; "
        f"evaluate the parent at eval.gate.short_lengths {list(gate_cfg.short_lengths)} first"
    ]


def check_gate(result: dict, parent: dict, gate_cfg) -> GateResult:
    """gate_cfg: megablu.config.schema.GateConfig (short_lengths, margin_pp, loss_margin_rel, ruler_at_window).
    Every task shared with the parent at gate_lengths; the short-document loss of every held-out set the arm
    measured (eval.loss.data, eval.loss.sets)."""
    margin = float(gate_cfg.margin_pp)
    checks, failures, missing = [], [], []
    changed = inference_changes(parent)
    if changed:  # the parent's scores are not the parent's: nothing can be checked against them
        missing.append(f"against a parent evaluated with {'; '.join(changed)} (gate against the parent as trained)")
    parent_tasks = {c["task"] for c in parent["cells"]}
    tasks = [t for t in dict.fromkeys(c["task"] for c in result["cells"]) if t in parent_tasks]
    if not tasks:
        missing.append(
            f"any task (arm has {sorted({c['task'] for c in result['cells']})}, parent has {sorted(parent_tasks)})"
        )
    gated = {task: gate_lengths(parent, task, gate_cfg) for task in tasks}
    for task in tasks:
        mine, theirs = cells_by(result, task), cells_by(parent, task)
        for L in gated[task]:
            if L not in mine or L not in theirs:
                missing.append(f"{task}@{L} ({'arm' if L not in mine else 'parent'} has no result)")
                continue
            a, b = mine[L], theirs[L]
            d, paired = difference(result, a, parent, b)
            drop = b["acc_pp"] - a["acc_pp"]
            ok = drop <= margin
            checks.append(
                {
                    "task": task,
                    "length": L,
                    "acc_pp": a["acc_pp"],
                    "parent_acc_pp": b["acc_pp"],
                    "drop_pp": drop,
                    **d.as_dict(),
                    "paired": paired is not None,
                    "passed": ok,
                }
            )
            if not ok:
                failures.append(
                    f"{task}@{L}: {a['acc_pp']:.1f}% vs parent {b['acc_pp']:.1f}% = drop {drop:.1f} pp "
                    f"> margin {margin:g} pp (95% diff [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}]"
                    f"{', paired' if paired is not None else ''})"
                )
    # what the long lengths did, so the message shows the trade the gate refuses
    gains = []
    for task in tasks:
        mine, theirs = cells_by(result, task), cells_by(parent, task)
        for L in sorted(set(mine) & set(theirs)):
            if L not in gated[task]:
                gains.append(f"{task}@{L} {mine[L]['acc_pp'] - theirs[L]['acc_pp']:+.1f} pp")
    rel_margin = float(getattr(gate_cfg, "loss_margin_rel", 0.02))
    sets = [None] + sorted(result.get("loss_sets") or {})
    for name in [s for s in sets if (loss_section(result, s) or {}).get("short")]:
        what = "short-document loss" + (f" on {name}" if name else "")
        sd = short_loss_change(result, parent, name)
        if sd is None:
            missing.append(f"the {what} (parent has none)")
            continue
        ok = sd["rel"] <= rel_margin
        ci = (
            f" (paired 95% [{100 * sd['ci_rel'][0]:+.1f}%, {100 * sd['ci_rel'][1]:+.1f}%])"
            if sd["ci_rel"]
            else " (not paired: other documents)"
        )
        checks.append(
            {
                "task": "loss:short_docs" + (f":{name}" if name else ""),
                "loss": sd["arm"],
                "parent_loss": sd["parent"],
                "rel": sd["rel"],
                "ci_rel": sd["ci_rel"],
                "passed": ok,
            }
        )
        if not ok:
            failures.append(
                f"{what} {sd['arm']:.4f} vs parent {sd['parent']:.4f} = "
                f"{100 * sd['rel']:+.1f}% > margin {100 * rel_margin:g}%{ci}"
            )
    pname = f"{parent.get('arm')}@{parent.get('step')}"
    if failures or missing:
        problems = failures + [f"cannot check {m}" for m in missing]
        msg = (
            f"SHORT-CONTEXT GATE FAILED against {pname}: "
            + "; ".join(problems)
            + (
                f". Long lengths: {', '.join(gains)} -- a long-context gain does not excuse a short-context loss"
                if gains
                else ""
            )
        )
        return GateResult(False, msg, checks, missing)
    at_window = sorted({f"{t}@{L}" for t, Ls in gated.items() for L in Ls if L not in gate_cfg.short_lengths})
    where = f"{list(gate_cfg.short_lengths)}" + (
        f"; RULER at the parent's window: {', '.join(at_window)}" if at_window else ""
    )
    return GateResult(True, f"short-context gate passed against {pname} (margin {margin:g} pp at {where})", checks)


def gate_markdown(gated: Sequence[tuple[str, GateResult]], parent_label: str, gate_cfg) -> list[str]:
    """`megablu compare --gate-parent`'s section: one row per configuration the compare reports (each arm@step
    and identity: a STRING or --rope-override row is gated like any other), its verdict, its checks, and
    what it could not check (an unchecked gate is not a pass)."""
    lines = [
        f"### short-context gate against {parent_label}",
        "",
        f"Every configuration above, against the parent as trained: a drop of more than "
        f"{float(gate_cfg.margin_pp):g} pp at {list(gate_cfg.short_lengths)}"
        + (
            " and, for RULER's tasks, at the parent's window (its longest length)"
            if getattr(gate_cfg, "ruler_at_window", True)
            else ""
        )
        + f", or a short-document loss more than {100 * float(gate_cfg.loss_margin_rel):g}% above the "
        f"parent's on any held-out set, fails; a check that cannot be made fails as UNCHECKED.",
        "",
        "| configuration | gate | checked | failed or not checkable |",
        "|---|---|---|---|",
    ]
    for label, g in gated:
        bad = [f"{c['task']}@{c['length']}" if "length" in c else c["task"] for c in g.checks if not c["passed"]]
        bad += [f"cannot check {m}" for m in g.unchecked]
        lines.append(f"| {label} | {g.verdict} | {len(g.checks)} | {'; '.join(bad) or '-'} |")
    lines.append("")
    return lines
