import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megablu.cli import main
from megablu.config.schema import TokenizerConfig
from megablu.data.build import Source, build_dataset, split_of
from megablu.data.shards import DataError, bucket_of, bucket_table, read_manifest, verify_dataset

BYTE = TokenizerConfig(kind="byte")


def make_tree(root: Path, n=30, seed=0):
    """n text files of varied sizes (bytes = byte-tokenizer tokens), plus noise files."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "ünïcode", "✓"]
    for i in range(n):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        k = int(rng.integers(2, 120))
        (sub / f"m{i:02d}.py").write_text(" ".join(rng.choice(words, size=k)) + f"\n# file {i}\n")
    (root / "README.txt").write_text("not python\n")
    (root / ".git").mkdir()
    (root / ".git" / "objects.py").write_bytes(b"\xff\x00 binary")  # hidden dirs are skipped
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "m00.cpython-311.py").write_bytes(b"\xff")
    return root


def test_build_buckets_split_and_manifest(tmp_path):
    src = make_tree(tmp_path / "src")
    out = tmp_path / "ds"
    m = build_dataset(
        [Source(str(src), include=["*.py"], license="CC0")],
        BYTE,
        out,
        edges=[128, 256, 512],
        val_fraction=0.2,
        workers=1,
        progress=False,
    )
    assert m == read_manifest(out)
    files = sorted(f for f in src.rglob("*.py") if ".git" not in f.parts and "__pycache__" not in f.parts)
    assert m["build"]["documents_seen"] == len(files) == 30
    # every document's bucket follows its byte length; the split follows the hash rule
    for e in m["shards"]:
        b = next(x for x in m["buckets"] if x["name"] == e["bucket"])
        off = np.fromfile(out / e["index"], dtype="<u8")
        lens = np.diff(off)
        assert (lens >= b["lo"]).all() and (b["hi"] is None or (lens < b["hi"]).all())
        for line in (out / e["meta"]).read_text().splitlines():
            meta = json.loads(line)
            assert split_of(meta["key"], 0.2, 0) == e["split"]
            assert meta["license"] == "CC0" and meta["source"] == "src"
            assert meta["n_tokens"] == len((src / meta["path"]).read_bytes())
    counts = m["counts"]
    assert sum(c["documents"] for b in counts.values() for c in b.values()) == len(files)
    assert sum(c["tokens"] for b in counts.values() for c in b.values()) == sum(len(f.read_bytes()) for f in files)
    assert {s for b in counts.values() for s in b} == {"train", "val"}
    assert m["sources"] == [
        {
            "name": "src",
            "license": "CC0",
            "provenance": str(src.resolve()),
            "documents": len(files),
            "tokens": sum(len(f.read_bytes()) for f in files),
        }
    ]
    assert m["dtype"] == "uint16" and m["tokenizer"]["eot_id"] == 256
    assert verify_dataset(out) == []


def test_tokens_roundtrip(tmp_path):
    src = make_tree(tmp_path / "src", n=5)
    out = tmp_path / "ds"
    m = build_dataset([Source(str(src), include=["*.py"])], BYTE, out, workers=1, progress=False, val_fraction=0)
    assert m["build"]["documents_seen"] == 5
    e = m["shards"][0]
    toks = np.fromfile(out / e["tokens"], dtype="<u2")
    off = np.fromfile(out / e["index"], dtype="<u8")
    metas = [json.loads(x) for x in (out / e["meta"]).read_text().splitlines()]
    for i, meta in enumerate(metas):
        assert bytes(toks[off[i] : off[i + 1]].astype(np.uint8)) == (src / meta["path"]).read_bytes()


def test_workers_do_not_change_output(tmp_path):
    src = make_tree(tmp_path / "src", n=40)
    m1 = build_dataset([Source(str(src))], BYTE, tmp_path / "a", workers=1, progress=False)
    m2 = build_dataset([Source(str(src))], BYTE, tmp_path / "b", workers=2, progress=False)
    assert [e["sha256"] for e in m1["shards"]] == [e["sha256"] for e in m2["shards"]]


def test_split_is_stable_and_proportional():
    keys = [f"src/f{i}.py" for i in range(20000)]
    val = [k for k in keys if split_of(k, 0.05, 0) == "val"]
    assert 0.04 < len(val) / len(keys) < 0.06
    assert val == [k for k in keys if split_of(k, 0.05, 0) == "val"]  # deterministic
    assert val != [k for k in keys if split_of(k, 0.05, 1) == "val"]  # seed matters
    assert set(val) <= {k for k in keys if split_of(k, 0.10, 0) == "val"}  # monotone in the fraction


def test_bucket_edges():
    edges = [4096, 8192, 16384, 32768, 65536, 131072]
    t = bucket_table(edges)
    assert [b["name"] for b in t] == [f"b{i}" for i in range(7)]
    assert t[0] == {"name": "b0", "lo": 0, "hi": 4096} and t[6] == {"name": "b6", "lo": 131072, "hi": None}
    assert bucket_of(4095, edges) == 0 and bucket_of(4096, edges) == 1 and bucket_of(8191, edges) == 1
    assert bucket_of(131071, edges) == 5 and bucket_of(131072, edges) == 6 and bucket_of(10**7, edges) == 6
    with pytest.raises(DataError, match="strictly increasing"):
        bucket_table([10, 10])


def test_jsonl(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": "x" * (i * 10 + 1), "id": i}) for i in range(12)) + "\n")
    m = build_dataset([Source(str(p))], BYTE, tmp_path / "ds", workers=1, progress=False, val_fraction=0, edges=[50])
    assert m["counts"]["b0"]["train"]["documents"] == 5 and m["counts"]["b1"]["train"]["documents"] == 7
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no string field 'text'"):
        build_dataset([Source(str(bad))], BYTE, tmp_path / "ds2", workers=1, progress=False)
    assert not (tmp_path / "ds2").exists()


def test_max_docs_and_bytes(tmp_path):
    src = make_tree(tmp_path / "src", n=30)
    m = build_dataset([Source(str(src), include=["*.py"])], BYTE, tmp_path / "a", workers=1, progress=False, max_docs=7)
    assert m["build"]["documents_seen"] == 7
    m = build_dataset(
        [Source(str(src), include=["*.py"])], BYTE, tmp_path / "b", workers=1, progress=False, max_bytes=1000
    )
    assert sum(c["tokens"] for b in m["counts"].values() for c in b.values()) < 1000 + 1000


def run_cli(*argv):
    return main(list(argv))


def test_cli_build_verify_stats(tmp_path, capsys):
    src = make_tree(tmp_path / "src")
    out = tmp_path / "ds"
    assert (
        run_cli(
            "data",
            "build",
            "--input",
            str(src),
            "--include",
            "*.py",
            "--tokenizer",
            "byte",
            "--out",
            str(out),
            "--bucket-edges",
            "128,256",
            "--workers",
            "2",
            "--no-progress",
        )
        == 0
    )
    o = capsys.readouterr().out
    assert "| b0 | 0-128 |" in o and "| b2 | >= 256 |" in o and "| all |" in o
    assert run_cli("data", "verify", str(out), "--tokenizer", "byte", "--check-ids") == 0
    assert capsys.readouterr().out.startswith(f"ok {out}")
    assert run_cli("data", "stats", str(out)) == 0
    assert "| src | unknown |" in capsys.readouterr().out
    # exists -> refuse without --overwrite
    assert run_cli("data", "build", "--input", str(src), "--tokenizer", "byte", "--out", str(out)) == 2
    assert "already holds a megablu dataset; pass --overwrite" in capsys.readouterr().err


def test_cli_subprocess_exit_codes(tmp_path):
    """The real `python -m megablu.cli` process: stdout holds the table only, errors exit 2."""
    src = make_tree(tmp_path / "src", n=6)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megablu.cli",
            "data",
            "build",
            "--input",
            str(src),
            "--tokenizer",
            "byte",
            "--out",
            str(tmp_path / "ds"),
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# ") and "INFO" not in r.stdout and "tokenize" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "megablu.cli", "data", "verify", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert r.returncode == 2 and "nope" in r.stderr and r.stdout == ""


def test_cli_sample_shows_documents_and_eot(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("first document")
    (src / "b.txt").write_text("second document")
    out = tmp_path / "ds"
    assert (
        run_cli(
            "data",
            "build",
            "--input",
            str(src),
            "--tokenizer",
            "byte",
            "--out",
            str(out),
            "--val-fraction",
            "0",
            "--no-progress",
        )
        == 0
    )
    capsys.readouterr()
    assert run_cli("data", "sample", str(out), "--tokenizer", "byte", "--mode", "fit", "--window", "64", "-n", "2") == 0
    o = capsys.readouterr().out
    assert "<|EOT|>first document<|EOT|>" in o and "<|EOT|>second document<|EOT|>" in o
    # [EOT] doc [EOT]: len(doc) + 1 labelled positions
    assert {
        "=== sequence 0: 15 labelled of 64 positions, 2 EOT ===",
        "=== sequence 1: 16 labelled of 64 positions, 2 EOT ===",
    } <= set(o.splitlines()) or {
        "=== sequence 0: 16 labelled of 64 positions, 2 EOT ===",
        "=== sequence 1: 15 labelled of 64 positions, 2 EOT ===",
    } <= set(o.splitlines())


FIXTURE = Path(__file__).parent / "fixtures" / "corpus"


def test_fixture_corpus_end_to_end(tmp_path):
    """CI's end-to-end run: `megablu data build` + `verify` + `sample` as processes on the shipped fixture.
    The exact table pins the split rule and the bucketing (a change to either shows up here)."""
    out = tmp_path / "fx"
    cmd = [sys.executable, "-m", "megablu.cli", "data"]
    r = subprocess.run(
        cmd
        + [
            "build",
            "--input",
            str(FIXTURE),
            "--tokenizer",
            "byte",
            "--bucket-edges",
            "512,1024",
            "--val-fraction",
            "0.3",
            "--out",
            str(out),
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[3:] == [
        "| b0 | 0-512 | 8 | 1,720 | 5 | 927 |",
        "| b1 | 512-1k | 1 | 841 | 1 | 892 |",
        "| b2 | >= 1k | 1 | 2,022 | 0 | 0 |",
        "| all | | 10 | 4,583 | 6 | 1,819 |",
    ]
    r = subprocess.run(cmd + ["verify", str(out), "--tokenizer", "byte", "--check-ids"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stderr
    r = subprocess.run(
        cmd + ["sample", str(out), "--tokenizer", "byte", "--window", "1024", "--mode", "fit", "--split", "val"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "<|EOT|>" in r.stdout, r.stderr
    m = read_manifest(out)
    metas = [json.loads(x) for e in m["shards"] for x in (out / e["meta"]).read_text().splitlines()]
    notes = sorted(x["path"] for x in metas if x["path"].startswith("notes"))
    assert notes == [f"notes.jsonl:{i}" for i in range(1, 9)]
    assert any(x["path"] == "prose/ünïcode.txt" for x in metas)
