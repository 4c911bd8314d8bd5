"""experiments/ruler_baselines/rerun_join.py: cells measured again after a fix replace the first
measurement's in one compare; the first files stay as they were; a cell measured again with no first
measurement of its arm, or an --out onto the first files, is refused."""

import json
import sys
from pathlib import Path

import pytest

from megablu.config.schema import EvalConfig
from megablu.eval.report import make_result, markdown, merge_results, write_result
from megablu.eval.results import load_result

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "ruler_baselines"))


def _res(arm, acc_by_task, L=4096):
    cells = [
        {
            "task": t,
            "length": L,
            "n": 10,
            "correct": a // 10,
            "acc_pp": float(a),
            "ci_pp": [0, 100],
            "padded_len": L,
            "digest": "d",
            "seconds": 0,
            "by_depth": [],
        }
        for t, a in acc_by_task.items()
    ]
    samples = [{"task": t, "length": L, "correct": True} for t in acc_by_task]
    ev = EvalConfig(lengths=[L], tasks=list(acc_by_task))
    return make_result(
        cells,
        samples,
        arm=arm,
        step=0,
        window=8192,
        eval_cfg=ev,
        tokenizer_identity="t",
        sp=1,
        extra={"rope": {"theta": 1e4, "yarn": None}, "weights": "w"},
    )


def test_cells_measured_again_replace_the_first_ones(tmp_path):
    import rerun_join

    first = write_result(_res("native", {"passkey": 90, "vt": 40}), tmp_path / "eval/n_4096/step_0.json")
    other = write_result(_res("yarn4", {"passkey": 70}), tmp_path / "eval/y_4096/step_0.json")
    again = write_result(_res("native", {"passkey": 20}), tmp_path / "eval/n_fix_4096/step_0.json")
    before = first.read_text()
    out = tmp_path / "joined"
    written = rerun_join.join([str(first.parent), str(other.parent)], [str(again.parent)], str(out))
    assert [p.relative_to(out).as_posix() for p in written] == ["n_4096/step_0.json", "y_4096/step_0.json"]
    assert first.read_text() == before
    joined = json.loads((out / "n_4096/step_0.json").read_text())
    assert [c["task"] for c in joined["cells"]] == ["vt"] and [s["task"] for s in joined["samples"]] == ["vt"]
    assert joined["cells_measured_again"]["cells"] == ["passkey@4096"] and "ruler" not in joined
    # the other arm's passkey is its own: kept
    assert [c["task"] for c in json.loads((out / "y_4096/step_0.json").read_text())["cells"]] == ["passkey"]
    rows = merge_results([load_result(p) for p in [*written, again]])
    native = next(r for r in rows if r["arm"] == "native")
    assert {c["task"]: c["acc_pp"] for c in native["cells"]} == {"passkey": 20.0, "vt": 40.0}
    assert "| native@0 | 20.0 |" in markdown(rows)
    # without the join, compare refuses the two passkey cells of one arm
    with pytest.raises(Exception, match="two different results for passkey@4096"):
        merge_results([load_result(first.parent), load_result(again.parent)])


def test_refused_a_cell_without_a_first_measurement_and_an_out_onto_the_first(tmp_path):
    import rerun_join

    first = write_result(_res("native", {"passkey": 90}), tmp_path / "eval/n_4096/step_0.json")
    new = write_result(_res("native", {"vt": 40}), tmp_path / "eval/n_fix_4096/step_0.json")
    with pytest.raises(SystemExit, match=r"not in any --first result of its arm: vt@4096"):
        rerun_join.join([str(first.parent)], [str(new.parent)], str(tmp_path / "joined"))
    with pytest.raises(SystemExit, match="would overwrite"):
        rerun_join.join([str(first.parent)], [str(first.parent)], str(tmp_path / "eval"))
