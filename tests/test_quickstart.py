"""The README's first command, end to end on CPU: data, a tiny parent (window 256, 1 rank) that
learns a retrieval task, its YaRN x4 extension (window 1024, sp=2 on 2 ranks), the three evals,
compare with the gate, the summary. The summary's claims are checked here against the run files
(the eval JSONs), recomputed from their numbers, not read back from the summary."""

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
from scipy import stats as sps

from megablu.eval.stats import newcombe_paired, t_quantile

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
EXCERPT_START = "<!-- quickstart excerpt: written by tests/test_quickstart.py from a real run -->"


def summary_excerpt(summary: str) -> list[str]:
    """The README's 10 lines of the quick start's summary: its title, the held-out loss table (where the
    extension's resolved gain is) and the extension's short-context gate."""
    lines = summary.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("held-out loss"))
    gate = [ln.rstrip() for ln in lines if ln.lstrip().startswith("extension@")]
    return [lines[0], "", *[ln.rstrip() for ln in lines[i : i + 6]], "", *gate[:1]]


def readme_excerpt(text: str) -> list[str]:
    """The lines of the README's fenced block after EXCERPT_START."""
    block = text.split(EXCERPT_START, 1)[1].split("```", 2)[1]
    return block.split("\n")[1:-1]


NUM = re.compile(r"[-+]?\d+(?:\.\d+)?")
# The summary's numbers depend on where it runs: two reruns on this layout's branch (2-core box, 2026-12-07)
# printed identical tables, but the README's earlier transcript (commit 5f45491, the same kind of box) was
# 0.000-0.030 apart on the losses and 0.000-0.024 on the differences and their bounds (-0.055 vs -0.044 at
# 480), and one borderline `*` differed; a fresh clone elsewhere has reported such gaps too (issue 41). So a
# loss may move by LOSS_TOL, a difference or bound (|x| < 1) by DIFF_TOL, and a `*` may come or go; every other
# character (tasks, lengths, arms, the gate's verdict) must be the README's.
LOSS_TOL, DIFF_TOL = 0.05, 0.03


def _tol(x: str) -> float:
    if "." not in x:
        return 0.0  # lengths, windows, counts, steps: exact
    return LOSS_TOL if abs(float(x)) >= 1 else DIFF_TOL


def excerpt_drift(readme: list[str], run: list[str]) -> list[str]:
    """Where the README's excerpt and a run's disagree beyond the run-to-run spread (empty: they agree)."""
    if len(readme) != len(run):
        return [f"{len(readme)} lines vs {len(run)}"]
    out = []
    for a, b in zip(readme, run):
        shape = [NUM.sub("#", s.replace("*", "")).split() for s in (a, b)]
        nums = [NUM.findall(s) for s in (a, b)]
        far = [(x, y) for x, y in zip(*nums) if ("." in x) != ("." in y) or abs(float(x) - float(y)) > _tol(x)]
        if shape[0] != shape[1] or far:
            out.append(f"README: {a!r}\nrun:    {b!r}")
    return out


def _paired(a: list, b: list) -> tuple[float, float, float, float]:
    """mean of a - b, its 95% t interval and the paired t test's p (scipy) over the distinct sequences (the
    same ones in both arms; a sequence drawn twice has the same pair of losses and counts once)."""
    pairs = list(dict.fromkeys(zip(a, b)))
    d = [x - y for x, y in pairs]
    m = sum(d) / len(d)
    half = t_quantile(0.95, len(d) - 1) * math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d))
    return m, m - half, m + half, sps.ttest_rel([x for x, _ in pairs], [y for _, y in pairs]).pvalue


def _result(d: Path) -> dict:
    files = sorted(d.glob("step_*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_quickstart_end_to_end(tmp_path):
    runs = tmp_path / "runs"
    r = subprocess.run(
        ["bash", str(ROOT / "examples" / "quickstart" / "quickstart.sh"), "--runs-dir", str(runs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    parent = next(runs.glob("qs_parent-*"))
    ext = next(runs.glob("qs_ext-*"))
    ps, es = (json.loads((d / "summary.json").read_text()) for d in (parent, ext))
    assert ps["steps"] == 800 and es["steps"] == 240 and "sp 2" in es["world"]
    cfg = (ext / "config.resolved.yaml").read_text()
    assert "original_max_position: 256" in cfg and "factor: 4.0" in cfg and f"init_from: {parent}" in cfg

    # the run files: three eval results, the same prompts and val sequences for every arm
    P, U, E = _result(parent / "eval"), _result(runs / "quickstart" / "eval_untrained"), _result(ext / "eval")
    assert (P["window"], U["window"], E["window"]) == (256, 1024, 1024)
    acc = {name: {(c["task"], c["length"]): c for c in res["cells"]} for name, res in (("P", P), ("U", U), ("E", E))}
    loss = {name: {c["length"]: c for c in res["loss"]["by_length"]} for name, res in (("P", P), ("U", U), ("E", E))}
    assert sorted(loss["P"]) == [128, 240] and sorted(loss["U"]) == sorted(loss["E"]) == [128, 240, 480, 992]
    for L in loss["E"]:  # loss per length: n val sequences of exactly L tokens, the same for both arms
        assert loss["E"][L]["digest"] == loss["U"][L]["digest"] and len(loss["E"][L]["per_seq"]) == loss["E"][L]["n"]
        assert abs(sum(loss["E"][L]["per_seq"]) / loss["E"][L]["n"] - loss["E"][L]["loss"]) < 1e-6  # equal lengths

    # the parent really retrieves inside its window (chance: 10% for a 1-digit key)
    assert acc["P"][("passkey_1digit", 240)]["acc_pp"] >= 80, acc["P"]
    # the extension kept the parent's retrieval inside the window (the gate's margin, 5 pp)
    for t in ("passkey_1digit", "passkey_1digit_far"):
        for L in (128, 240):
            assert acc["E"][(t, L)]["acc_pp"] >= acc["P"][(t, L)]["acc_pp"] - 5

    # extension - untrained per length, recomputed here from the files: retrieval from every prompt's
    # outcome (the same prompts: a paired interval), loss over the same val sequences (paired t)
    def retrieval(task, L):
        key = (task, L)
        assert acc["E"][key]["digest"] == acc["U"][key]["digest"]
        got = {
            name: {s["index"]: bool(s["correct"]) for s in res["samples"] if (s["task"], s["length"]) == key}
            for name, res in (("E", E), ("U", U))
        }
        assert got["E"].keys() == got["U"].keys() and len(got["E"]) == acc["E"][key]["n"]
        t = [
            sum(1 for i in got["E"] if (got["E"][i], got["U"][i]) == k)
            for k in ((True, True), (True, False), (False, True), (False, False))
        ]
        d = newcombe_paired(*t)
        p = sps.binomtest(t[1], t[1] + t[2]).pvalue if t[1] + t[2] else 1.0  # exact McNemar
        return 100 * d.diff, 100 * d.lo, 100 * d.hi, p

    tasks = ("passkey_1digit", "passkey_1digit_far")  # the far one: every key in the first 30%
    assert {t for t, _ in acc["E"]} == set(tasks)
    diffs = {(t, L): retrieval(t, L) for t in tasks for L in (128, 240, 480, 992)}
    diffs.update({("loss", L): _paired(loss["E"][L]["per_seq"], loss["U"][L]["per_seq"]) for L in (128, 240, 480, 992)})
    # the stars: Holm's step-down over the 12 p values, at 0.05
    order, adj, run = sorted(diffs, key=lambda k: diffs[k][3]), {}, 0.0
    for i, k in enumerate(order):
        run = max(run, min(1.0, (len(order) - i) * diffs[k][3]))
        adj[k] = run
    gain = lambda k: diffs[k][0] if k[0] != "loss" else -diffs[k][0]  # noqa: E731
    beyond = [k for k in diffs if k[1] > 256 and adj[k] < 0.05 and gain(k) > 0]
    # the claim: beyond the old window the extension is resolvably better than untrained
    # YaRN on retrieval or loss (a star: Holm-adjusted p < 0.05 over the 12 differences), at this seed
    assert beyond, diffs
    # the summary's claims are these, and a gain is called long-context exactly when it exceeds every
    # gain of the same measure inside the window
    claims = json.loads((runs / "quickstart" / "claims.json").read_text())
    inside = {w: max([gain(k) for k in diffs if k[0] == w and k[1] <= 256] + [0.0]) for w in (*tasks, "loss")}
    want = {(k[0], k[1], gain(k) > inside[k[0]]) for k in beyond}
    assert {(b["what"], b["length"], b["long_context"]) for b in claims["better_beyond"]} == want, (claims, diffs)

    # the printed summary says the same, with the numbers of the files
    out = r.stdout
    assert out.startswith("megablu quick start (CPU): a parent at window 256, its YaRN x4 extension to window 1024")
    verdict = [ln for ln in out.splitlines() if ln.startswith("In one line:")]
    assert len(verdict) == 1 and "is resolvably better than the parent with untrained YaRN" in verdict[0], out
    said = verdict[0].split("; not resolved or worse: ")[0]
    for what, L, _ in want:
        m, lo, hi, _ = diffs[(what, L)]
        if what == "loss":
            assert f"loss@{L} {m:+.3f} nats/token [{lo:+.3f}, {hi:+.3f}]" in said, (L, m, said)
        else:
            assert f"{what}@{L} " in said and f"({m:+.0f} pp [{lo:+.0f}, {hi:+.0f}])" in said, (L, m, said)
    assert "* = the difference survives Holm's correction over the 12 tested differences above" in out
    assert "extension@240: short-context gate passed" in out
    assert (runs / "quickstart" / "compare.png").read_bytes()[:4] == b"\x89PNG"

    # the README shows 10 lines of this summary; a run that prints other lines fails here (the README drifted:
    # MEGABLU_README_UPDATE=1 rewrites the block from this run)
    want = summary_excerpt(out)
    assert len(want) == 10 and want[2].startswith("held-out loss"), want
    readme = ROOT / "README.md"
    text = readme.read_text()
    if os.environ.get("MEGABLU_README_UPDATE") == "1":
        head, rest = text.split(EXCERPT_START, 1)
        tail = rest.split("```", 2)[2]
        readme.write_text(head + EXCERPT_START + "\n```\n" + "\n".join(want) + "\n```" + tail)
        text = readme.read_text()
    drift = excerpt_drift(readme_excerpt(text), want)
    assert not drift, (
        "README.md's quick start excerpt differs from this run beyond the run-to-run spread; rerun "
        "with MEGABLU_README_UPDATE=1 and commit:\n" + "\n".join(drift)
    )


def test_summary_excerpt_is_the_readme_block():
    """The excerpt picks the summary's title, loss table and gate line, and the README parser reads it back."""
    summary = "\n".join(
        [
            "megablu quick start (CPU): t",
            "",
            "passkey table",
            "  row",
            "",
            "held-out loss, nats/token: ...",
            "  cols",
            "  parent",
            "  untrained",
            "  extension",
            "  extension - untrained",
            "",
            "short-context gate (...):",
            "  parent+yarn@800: passed",
            "  extension@240: short-context gate passed",
            "",
            "In one line: ...",
        ]
    )
    got = summary_excerpt(summary)
    assert got == [
        "megablu quick start (CPU): t",
        "",
        "held-out loss, nats/token: ...",
        "  cols",
        "  parent",
        "  untrained",
        "  extension",
        "  extension - untrained",
        "",
        "  extension@240: short-context gate passed",
    ]
    readme = f"intro\n{EXCERPT_START}\n```\n" + "\n".join(got) + "\n```\nafter ``` more\n"
    assert readme_excerpt(readme) == got


def test_excerpt_drift_allows_the_run_to_run_spread_only():
    row = "  extension - untrained         -0.026 [-0.05, -0.00]  -0.055* [-0.07, -0.04]"
    assert excerpt_drift([row], [row]) == []
    assert excerpt_drift([row], [row.replace("-0.055*", "-0.044 ")]) == []  # within DIFF_TOL, star gone
    assert excerpt_drift([row], [row.replace("-0.055*", "-0.095*")])  # beyond it
    loss = "  extension                                     6.300                   6.212"
    assert excerpt_drift([loss], [loss.replace("6.300", "6.340")]) == []  # within LOSS_TOL
    assert excerpt_drift([loss], [loss.replace("6.300", "6.360")])
    gate = "  extension@240: short-context gate passed against parent@800 (margin 5 pp at [128, 240])"
    assert excerpt_drift([gate], [gate.replace("passed", "FAILED")])  # another verdict
    assert excerpt_drift([gate], [gate.replace("240]", "248]")])  # another length
    assert excerpt_drift([gate], [gate, gate])
    assert readme_excerpt(ROOT.joinpath("README.md").read_text())[0].startswith("megablu quick start (CPU)")
