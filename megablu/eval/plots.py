"""The pictures of eval results: accuracy vs log2(length) per task with Wilson bands (plot), the depth x
length heatmap of a task with needles (heatmap), and the files an eval writes beside its json
(write_artifacts). matplotlib is imported when a picture is drawn, never before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from .compare import markdown
from .prompts import EvalError
from .results import AVERAGES, _label, cells_by, ruler_average
from .stats import RULER_THRESHOLD


def _mpl():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise EvalError(f"plotting needs matplotlib (pip install matplotlib): {e}") from None
    return plt


_MARKERS = "osD^vP*X<>"
_STYLES = ("-", "--", "-.", ":")


def _offsets(k: int, step: float = 0.06) -> list[float]:
    """x offsets (log2 units) that set k arms side by side at one length, so none hides another."""
    return [(j - (k - 1) / 2) * step for j in range(k)]


def panel_x(lengths_by_arm: dict[int, list[int]]) -> dict[int, list[float]]:
    """x of each point in one panel: log2(length) plus a sideways offset shared out among the arms
    that have points in this panel only (a panel where 2 of 9 arms have cells sets those 2 side by
    side at the length, not at the two ends of nine arms' spread)."""
    offs = _offsets(len(lengths_by_arm))
    return {j: [math.log2(L) + o for L in Ls] for (j, Ls), o in zip(lengths_by_arm.items(), offs, strict=True)}


def panel_xlim(lengths: Sequence[int], k: int) -> tuple[float, float]:
    """x limits around a panel's lengths (log2) with room for k arms' offsets, at least half a
    doubling each side, so a one-length panel has its points over its tick, centred."""
    pad = max(0.5, abs(_offsets(k)[0]) + 0.25) if k else 0.5
    return math.log2(lengths[0]) - pad, math.log2(lengths[-1]) + pad


def _n_note(cells: list[dict]) -> Optional[str]:
    ns = sorted({c["n"] for c in cells})
    return f"n={ns[0]} per cell" if len(ns) == 1 else None


def plot(results: Sequence[dict], path: Path, task: Optional[str] = None) -> Path:
    """Accuracy vs log2(length), one line per arm (offset sideways, own marker and dash), Wilson
    95% bands; the RULER threshold line labelled; n per cell in the title (or at each point when
    it varies). Panels: each task, the RULER average, the held-out loss. matplotlib imported here."""
    plt = _mpl()
    tasks = [task] if task else list(dict.fromkeys(c["task"] for r in results for c in r["cells"]))
    have = [(t, s) for _, t, s in AVERAGES if any(ruler_average(r["cells"], suite=s) for r in results)]
    avg_title, avg_suite = have[0] if have else AVERAGES[0][1:]
    avgs = [ruler_average(r["cells"], suite=avg_suite) for r in results] if not task else [None] * len(results)
    panels = (
        [("task", t) for t in tasks]
        + ([("ruler", None)] if any(avgs) else [])
        + ([("loss", None)] if not task and any(r.get("loss") for r in results) else [])
    )
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
    for ax, (kind, t) in zip(axes.flat, panels, strict=False):
        series = {}  # arm index -> its points in this panel
        for j, r in enumerate(results):
            if kind == "task":
                pts = [
                    (c["length"], c["acc_pp"], c["ci_pp"][0], c["ci_pp"][1], c["n"])
                    for c in sorted(cells_by(r, t).values(), key=lambda c: c["length"])
                ]
            elif kind == "ruler":
                a = avgs[j]
                pts = [
                    (x["length"], x["acc_pp"], x["ci_pp"][0], x["ci_pp"][1], None)
                    for x in (a["by_length"] if a else [])
                ]
            else:
                lo = r.get("loss") or {}
                pts = [(c["length"], c["loss"], c["loss"], c["loss"], c["n"]) for c in lo.get("by_length", [])]
            if pts:
                series[j] = pts
        xs = panel_x({j: [p[0] for p in pts] for j, pts in series.items()})
        lengths = {p[0] for pts in series.values() for p in pts}
        for j, pts in series.items():
            r, x = results[j], xs[j]
            sty = dict(marker=_MARKERS[j % len(_MARKERS)], ls=_STYLES[j % len(_STYLES)], label=_label(r), ms=5)
            (line,) = ax.plot(x, [p[1] for p in pts], **sty)
            if kind != "loss":
                ax.fill_between(x, [p[2] for p in pts], [p[3] for p in pts], alpha=0.15, color=line.get_color())
            if kind == "task" and _n_note([cells_by(r, t)[p[0]] for p in pts]) is None:
                for xi, p in zip(x, pts, strict=True):
                    ax.annotate(f"n={p[4]}", (xi, p[1]), fontsize=6, xytext=(2, 3), textcoords="offset points")
        if lengths:
            ax.set_xlim(*panel_xlim(sorted(lengths), len(series)))
        ls = sorted(lengths)
        ax.set_xticks([math.log2(L) for L in ls], [str(L) for L in ls], rotation=30)
        ax.set_xlabel("prompt length (tokens, log2 axis)")
        if kind == "loss":
            ax.set_ylabel("validation loss (nats/token)")
            ax.set_title("held-out loss per length")
        else:
            ax.axhline(RULER_THRESHOLD, ls="--", lw=0.8, color="grey")
            ax.annotate(
                f"RULER threshold {RULER_THRESHOLD:g}%",
                (0.01, RULER_THRESHOLD),
                xycoords=("axes fraction", "data"),
                fontsize=7,
                color="grey",
                xytext=(0, 2),
                textcoords="offset points",
            )
            ax.set_ylim(-2, 102)
            ax.set_ylabel("accuracy (%), 95% band")
            cs = [c for r in results for c in r["cells"] if kind == "task" and c["task"] == t]
            note = _n_note(cs) if kind == "task" else "mean over tasks"
            ax.set_title(f"{t if kind == 'task' else avg_title.split(' (')[0]}" + (f" ({note})" if note else ""))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heatmap(results: Sequence[dict], path: Path, task: str) -> Optional[Path]:
    """Depth x length heatmap of one task, one panel per arm: the fraction of answers found per
    depth bin of the context (rows) at each length (columns), the count of answers in each box.
    None when no arm has depth bins for the task (cwe/fwe have no needle depth)."""
    have = [(r, sorted(cells_by(r, task).values(), key=lambda c: c["length"])) for r in results]
    have = [(r, cs) for r, cs in have if any(c.get("by_depth") for c in cs)]
    if not have:
        return None
    plt = _mpl()
    import matplotlib.colors as mcolors

    w = 1.0 * max(len(cs) for _, cs in have) + 1.2
    fig, axes = plt.subplots(1, len(have), figsize=(w * len(have) + 1.8, 4.4), squeeze=False, layout="constrained")
    norm, cmap = mcolors.Normalize(0, 100), plt.get_cmap("RdYlGn")
    for ax, (r, cs) in zip(axes[0], have, strict=True):
        for xi, c in enumerate(cs):
            for b in c.get("by_depth") or []:
                lo, hi = b["depth"]
                if b["n"] == 0:
                    ax.add_patch(plt.Rectangle((xi, lo), 1, hi - lo, color="lightgrey"))
                    continue
                acc = 100 * b["correct"] / b["n"]
                ax.add_patch(plt.Rectangle((xi, lo), 1, hi - lo, color=cmap(norm(acc))))
                if hi - lo >= 0.05:
                    ax.text(xi + 0.5, (lo + hi) / 2, f"{acc:.0f}\n({b['n']})", ha="center", va="center", fontsize=6)
        ax.set_xlim(0, len(cs))
        ax.set_ylim(1, 0)  # depth 0 (start of the context) at the top
        ax.set_xticks([i + 0.5 for i in range(len(cs))], [str(c["length"]) for c in cs], rotation=30)
        ax.set_xlabel("prompt length (tokens)")
        if ax is axes[0][0]:
            ax.set_ylabel("needle depth in the context (0 = start)")
        ax.set_title(f"{task}: {_label(r)}", fontsize=9)
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=list(axes[0]), label="answers found (%), (count)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heatmaps(results: Sequence[dict], prefix: Path) -> list[Path]:
    """<prefix>_<task>.png for every task with depth bins."""
    tasks = list(dict.fromkeys(c["task"] for r in results for c in r["cells"]))
    out = [heatmap(results, Path(f"{prefix}_{t}.png"), t) for t in tasks]
    return [p for p in out if p]


def write_artifacts(res: dict, out_dir: Path, step: int, plot: bool = True) -> list[Path]:
    """step_<N>.md (the tables), step_<N>.png (the plot) and step_<N>_depth_<task>.png (the depth x
    length heatmap of each task with needles) beside the json.

    The json is the result; a missing matplotlib costs only the picture (logged), never the eval."""
    import logging

    out_dir = Path(out_dir)
    md = out_dir / f"step_{step}.md"
    md.write_text(markdown([res]) + "\n")
    written = [md]
    if not plot:
        return written
    try:
        written.append(_plot([res], out_dir / f"step_{step}.png"))
        written += heatmaps([res], out_dir / f"step_{step}_depth")
    except EvalError as e:
        logging.getLogger(__name__).warning("no plot for step %d: %s", step, e)
    return written


_plot = plot
