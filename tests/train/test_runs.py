"""Run ids: exclusive, monotonic, never reused, safe under concurrent launches."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil

import pytest

from megablu.train.runs import RunError, allocate_run, find_run, list_runs


def _alloc_many(args):
    runs_dir, name, n, start = args
    start.wait()  # all processes race from the same instant
    return [allocate_run(runs_dir, name).name for _ in range(n)]


def test_concurrent_launches_get_distinct_ids(tmp_path):
    procs, per = 8, 6
    ctx = mp.get_context("fork")
    with ctx.Manager() as m:
        start = m.Event()
        with ctx.Pool(procs) as pool:
            res = pool.map_async(_alloc_many, [(str(tmp_path), "ext", per, start)] * procs)
            start.set()
            ids = [i for chunk in res.get(60) for i in chunk]
    assert len(ids) == procs * per
    assert len(set(ids)) == len(ids), sorted(ids)  # no two launches share an id
    assert sorted(ids) == [f"ext-{n:04d}" for n in range(1, procs * per + 1)]
    for i in ids:  # each dir exists and names itself
        assert json.loads((tmp_path / i / "run.json").read_text())["run_id"] == i


def test_ids_never_reused_after_deletion(tmp_path):
    a = allocate_run(tmp_path, "x")
    b = allocate_run(tmp_path, "x")
    shutil.rmtree(b)
    shutil.rmtree(a)
    c = allocate_run(tmp_path, "x")
    assert (a.name, b.name, c.name) == ("x-0001", "x-0002", "x-0003")


def test_hand_made_dir_is_skipped_not_shared(tmp_path):
    (tmp_path / "y-0001").mkdir()  # e.g. created by hand or an older tool
    (tmp_path / "y-0001" / "keepme").write_text("1")
    r = allocate_run(tmp_path, "y")
    assert r.name == "y-0002"
    assert (tmp_path / "y-0001" / "keepme").read_text() == "1"


def test_names_do_not_collide_by_prefix(tmp_path):
    a = allocate_run(tmp_path, "run")
    b = allocate_run(tmp_path, "run-0001")  # a name that looks like another run's id
    assert a.name == "run-0001" and b.name == "run-0001-0001"
    assert a != b and list_runs(tmp_path) == sorted([a, b])


@pytest.mark.parametrize("bad", ["", "a/b", "a b", ".hidden"])
def test_bad_names_refused(tmp_path, bad):
    with pytest.raises(RunError):
        allocate_run(tmp_path, bad)


def test_find_run(tmp_path):
    r = allocate_run(tmp_path, "z")
    assert find_run(tmp_path, "z-0001") == tmp_path / "z-0001"
    assert find_run(tmp_path, r) == r
    with pytest.raises(RunError, match="z-0001"):
        find_run(tmp_path, "z-0009")
