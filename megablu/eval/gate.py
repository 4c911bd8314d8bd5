"""Short-context gate: an arm may not buy long-context accuracy with short-context accuracy.

The seed's 2026-09-02 cache bug lifted 16k from 0 to 14-17% while 4k fell from 74% to 16%,
and perplexity looked fine. So a drop at any short length (default 1024 and 4096) of more
than margin_pp below the parent fails, whatever the long lengths did. A short length the
gate cannot check (missing in either result) fails too: an unchecked gate is not a pass.

Retrieval is not all of short context: when the arm measured the held-out short-document loss
(eval.loss), it may rise at most loss_margin_rel (relative) above the parent's, so an arm that
keeps its passkey but loses language modelling fails too. A parent without that loss cannot
check it (fails as unchecked).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .report import cells_by, difference, short_loss_change, string_setting


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

    def as_dict(self) -> dict:
        return {"passed": self.passed, "message": self.message, "checks": self.checks}


def parent_problems(parent: dict, gate_cfg, tasks, loss: bool = False) -> list[str]:
    """Why `parent` cannot gate an eval of `tasks` ([] if it can): check_gate fails as unchecked
    a parent that shares no task with the arm, or lacks a short length of a shared task. A
    caller about to spend hours on generation (or on training) asks this first."""
    have = {(c["task"], c["length"]) for c in parent.get("cells", [])}
    name = parent.get("_path") or f"{parent.get('arm')}@{parent.get('step')}"
    shared = [t for t in dict.fromkeys(tasks) if any(t == h for h, _ in have)]
    missing = [f"{t}@{L}" for t in shared for L in gate_cfg.short_lengths if (t, L) not in have] if shared \
        else [f"any of the tasks {list(dict.fromkeys(tasks))}"]
    out = []
    changed = inference_changes(parent)
    if changed:
        out.append(f"gate parent {name} was evaluated with an inference-time change ({'; '.join(changed)}): the gate "
                   f"compares against the parent as trained; evaluate the parent without it and gate against that")
    if loss and not (parent.get("loss") or {}).get("short"):
        out.append(f"gate parent {name} has no short-document loss (result['loss']['short']), so the loss gate could "
                   f"not be checked; evaluate the parent with the same eval.loss.data first")
    if not missing:
        return out
    return out + [f"gate parent {name} has no result for {', '.join(missing)} (it has "
            f"{', '.join(f'{t}@{L}' for t, L in sorted(have)) or 'nothing'}), so the gate could not be checked; "
            f"evaluate the parent at eval.gate.short_lengths {list(gate_cfg.short_lengths)} first"]


def check_gate(result: dict, parent: dict, gate_cfg) -> GateResult:
    """gate_cfg: megablu.config.schema.GateConfig (short_lengths, margin_pp)."""
    margin = float(gate_cfg.margin_pp)
    checks, failures, missing = [], [], []
    changed = inference_changes(parent)
    if changed:   # the parent's scores are not the parent's: nothing can be checked against them
        missing.append(f"against a parent evaluated with {'; '.join(changed)} (gate against the parent as trained)")
    parent_tasks = {c["task"] for c in parent["cells"]}
    tasks = [t for t in dict.fromkeys(c["task"] for c in result["cells"]) if t in parent_tasks]
    if not tasks:
        missing.append(f"any task (arm has {sorted({c['task'] for c in result['cells']})}, parent has "
                       f"{sorted(parent_tasks)})")
    for task in tasks:
        mine, theirs = cells_by(result, task), cells_by(parent, task)
        for L in gate_cfg.short_lengths:
            if L not in mine or L not in theirs:
                missing.append(f"{task}@{L} ({'arm' if L not in mine else 'parent'} has no result)")
                continue
            a, b = mine[L], theirs[L]
            d, paired = difference(result, a, parent, b)
            drop = b["acc_pp"] - a["acc_pp"]
            ok = drop <= margin
            checks.append({"task": task, "length": L, "acc_pp": a["acc_pp"], "parent_acc_pp": b["acc_pp"],
                           "drop_pp": drop, **d.as_dict(), "paired": paired is not None, "passed": ok})
            if not ok:
                failures.append(f"{task}@{L}: {a['acc_pp']:.1f}% vs parent {b['acc_pp']:.1f}% = drop {drop:.1f} pp "
                                f"> margin {margin:g} pp (95% diff [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}]"
                                f"{', paired' if paired is not None else ''})")
    # what the long lengths did, so the message shows the trade the gate refuses
    gains = []
    for task in tasks:
        mine, theirs = cells_by(result, task), cells_by(parent, task)
        for L in sorted(set(mine) & set(theirs)):
            if L not in gate_cfg.short_lengths:
                gains.append(f"{task}@{L} {mine[L]['acc_pp'] - theirs[L]['acc_pp']:+.1f} pp")
    if result.get("loss") and (result["loss"] or {}).get("short"):
        d = short_loss_change(result, parent)
        rel_margin = float(getattr(gate_cfg, "loss_margin_rel", 0.02))
        if d is None:
            missing.append("the short-document loss (parent has none)")
        else:
            ok = d["rel"] <= rel_margin
            ci = (f" (paired 95% [{100 * d['ci_rel'][0]:+.1f}%, {100 * d['ci_rel'][1]:+.1f}%])" if d["ci_rel"]
                  else " (not paired: other documents)")
            checks.append({"task": "loss:short_docs", "loss": d["arm"], "parent_loss": d["parent"], "rel": d["rel"],
                           "ci_rel": d["ci_rel"], "passed": ok})
            if not ok:
                failures.append(f"short-document loss {d['arm']:.4f} vs parent {d['parent']:.4f} = "
                                f"{100 * d['rel']:+.1f}% > margin {100 * rel_margin:g}%{ci}")
    pname = f"{parent.get('arm')}@{parent.get('step')}"
    if failures or missing:
        problems = failures + [f"cannot check {m}" for m in missing]
        msg = (f"SHORT-CONTEXT GATE FAILED against {pname}: " + "; ".join(problems)
               + (f". Long lengths: {', '.join(gains)} -- a long-context gain does not excuse a short-context loss"
                  if gains else ""))
        return GateResult(False, msg, checks)
    return GateResult(True, f"short-context gate passed against {pname} (margin {margin:g} pp at "
                            f"{list(gate_cfg.short_lengths)})", checks)
