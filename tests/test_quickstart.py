"""The README's first command, end to end on CPU: data, a tiny parent (window 256, 1 rank) that
learns a retrieval task, its YaRN x4 extension (window 1024, sp=2 on 2 ranks), the three evals,
compare with the gate, the summary. The summary's claims are checked here against the run files
(the eval JSONs), recomputed from their numbers, not read back from the summary."""
import json
import math
import subprocess
from pathlib import Path

import pytest
from scipy import stats as sps

from megablu.eval.stats import newcombe_paired, t_quantile

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


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
    r = subprocess.run(["bash", str(ROOT / "launch" / "quickstart.sh"), "--runs-dir", str(runs)],
                       capture_output=True, text=True, cwd=ROOT, timeout=1800)
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
    for L in loss["E"]:   # loss per length: n val sequences of exactly L tokens, the same for both arms
        assert loss["E"][L]["digest"] == loss["U"][L]["digest"] and len(loss["E"][L]["per_seq"]) == loss["E"][L]["n"]
        assert abs(sum(loss["E"][L]["per_seq"]) / loss["E"][L]["n"] - loss["E"][L]["loss"]) < 1e-6   # equal lengths

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
        got = {name: {s["index"]: bool(s["correct"]) for s in res["samples"] if (s["task"], s["length"]) == key}
               for name, res in (("E", E), ("U", U))}
        assert got["E"].keys() == got["U"].keys() and len(got["E"]) == acc["E"][key]["n"]
        t = [sum(1 for i in got["E"] if (got["E"][i], got["U"][i]) == k)
             for k in ((True, True), (True, False), (False, True), (False, False))]
        d = newcombe_paired(*t)
        p = sps.binomtest(t[1], t[1] + t[2]).pvalue if t[1] + t[2] else 1.0     # exact McNemar
        return 100 * d.diff, 100 * d.lo, 100 * d.hi, p

    tasks = ("passkey_1digit", "passkey_1digit_far")      # the far one: every key in the first 30%
    assert {t for t, _ in acc["E"]} == set(tasks)
    diffs = {(t, L): retrieval(t, L) for t in tasks for L in (128, 240, 480, 992)}
    diffs.update({("loss", L): _paired(loss["E"][L]["per_seq"], loss["U"][L]["per_seq"]) for L in (128, 240, 480, 992)})
    # the stars: Holm's step-down over the 12 p values, at 0.05
    order, adj, run = sorted(diffs, key=lambda k: diffs[k][3]), {}, 0.0
    for i, k in enumerate(order):
        run = max(run, min(1.0, (len(order) - i) * diffs[k][3]))
        adj[k] = run
    gain = lambda k: diffs[k][0] if k[0] != "loss" else -diffs[k][0]                 # noqa: E731
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
