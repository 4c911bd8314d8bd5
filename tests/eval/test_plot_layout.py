"""`megablu compare --plot` geometry: each arm's points sit over their length's tick, side by side
among the arms that have points in that panel, and a one-length panel is centred on its tick.
(Before 2026-12-06 the sideways offsets were shared out over every arm of the compare, and a
one-length panel's x-limits were those offsets: in the fourteenth session's nine-arm plot the
suite's panels showed its two arms at the two edges, far from the 32640 tick.)"""

import math

from megablu.config.schema import EvalConfig
from megablu.eval import plots
from megablu.eval.plots import panel_x, panel_xlim, plot
from megablu.eval.results import make_result


def _res(arm, task_acc, n=50):
    cells = []
    for (task, L), a in task_acc.items():
        k = round(a * n / 100)
        cells.append(
            {
                "task": task,
                "length": L,
                "n": n,
                "correct": k,
                "acc_pp": 100 * k / n,
                "ci_pp": [0, 100],
                "padded_len": L,
                "digest": "d",
                "seconds": 0,
                "by_depth": [],
            }
        )
    samples = [{"task": t, "length": L, "correct": True} for t, L in task_acc]
    return make_result(
        cells,
        samples,
        arm=arm,
        step=0,
        window=32768,
        eval_cfg=EvalConfig(lengths=sorted({L for _, L in task_acc})),
        tokenizer_identity="t",
        sp=1,
    )


def test_offsets_among_the_panels_arms_only():
    xs = panel_x({2: [32640], 8: [32640]})
    c = math.log2(32640)
    assert set(xs) == {2, 8}
    assert all(abs(x - c) <= 0.03 + 1e-9 for v in xs.values() for x in v)
    assert xs[2][0] < c < xs[8][0]
    lo, hi = panel_xlim([32640], 2)
    assert math.isclose((lo + hi) / 2, c) and hi - lo >= 1.0
    lo, hi = panel_xlim([1024, 32744], 9)
    assert lo < math.log2(1024) - 0.24 and hi > math.log2(32744) + 0.24  # nine arms' spread fits


def test_plot_places_a_one_length_panel_over_its_tick(tmp_path, monkeypatch):
    figs = []
    real = plots._mpl

    def spy():
        plt = real()
        monkeypatch.setattr(plt, "close", figs.append)
        return plt

    monkeypatch.setattr(plots, "_mpl", spy)
    arms = [_res(f"a{j}", {("passkey", 1024): 90, ("passkey", 32744): 50 + j}) for j in range(8)]
    arms.append(_res("suite", {("passkey", 1024): 80, ("vt", 32640): 20}))
    arms[0]["cells"].append({**arms[8]["cells"][1], "acc_pp": 30.0, "correct": 15})
    plot(arms, tmp_path / "p.png")
    (fig,) = figs
    vt = next(ax for ax in fig.axes if ax.get_title().startswith("vt"))
    xs = [x for line in vt.get_lines() for x in line.get_xdata() if x > 12]  # not the threshold line's 0, 1
    c = math.log2(32640)
    assert len(xs) == 2 and all(abs(x - c) <= 0.03 + 1e-9 for x in xs), xs
    lo, hi = vt.get_xlim()
    assert math.isclose((lo + hi) / 2, c) and hi - lo >= 1.0, (lo, hi, c)  # matplotlib's own: ~0.07 wide
    pk = next(ax for ax in fig.axes if ax.get_title().startswith("passkey"))
    xs = [x for line in pk.get_lines() for x in line.get_xdata() if x > 12]
    assert len(xs) == 8 and max(xs) - min(xs) <= 8 * 0.06  # eight arms at 32744
    plots._mpl().close(fig)
