"""Each bad input is a clear error naming the file, exit 2 from the CLI, and nothing half-written."""

import json
import os

import numpy as np
import pytest

from megablu.cli import main
from megablu.config.schema import DataConfig, TokenizerConfig
from megablu.data.build import Source, build_dataset
from megablu.data.loader import build_loader
from megablu.data.shards import DataError, verify_dataset

from .conftest import IDENT, unique_docs, write_dataset

BYTE = TokenizerConfig(kind="byte")


@pytest.fixture
def ds(tmp_path):
    root = tmp_path / "ds"
    write_dataset(root, unique_docs([30, 40, 70, 90, 200, 300]))
    return root


def _shard(root, bucket="b1"):
    m = json.loads((root / "manifest.json").read_text())
    return next(e for e in m["shards"] if e["bucket"] == bucket)


def _verify_cli(root, capsys):
    rc = main(["data", "verify", str(root)])
    return rc, capsys.readouterr().err


def test_truncated_shard(ds, capsys):
    e = _shard(ds)
    f = ds / e["tokens"]
    f.write_bytes(f.read_bytes()[:-3])
    errs = verify_dataset(ds)
    assert len(errs) == 1 and str(f) in errs[0] and "truncated or corrupted" in errs[0]
    rc, err = _verify_cli(ds, capsys)
    assert rc == 2 and str(f) in err
    with pytest.raises(DataError, match=str(f)):
        build_loader(DataConfig(path=str(ds), window=64), IDENT, micro_batch=1, dp_rank=0, dp_size=1)


def test_corrupted_shard_same_size(ds, capsys):
    e = _shard(ds)
    f = ds / e["tokens"]
    b = bytearray(f.read_bytes())
    b[5] ^= 0xFF
    f.write_bytes(bytes(b))
    errs = verify_dataset(ds)
    assert len(errs) == 1 and str(f) in errs[0] and "sha256" in errs[0]
    assert verify_dataset(ds, check_hash=False) == []  # only the hash can see it
    rc, err = _verify_cli(ds, capsys)
    assert rc == 2 and str(f) in err
    with pytest.raises(DataError, match="sha256"):
        build_loader(DataConfig(path=str(ds), window=64), IDENT, micro_batch=1, dp_rank=0, dp_size=1)


def test_corruption_after_cached_verification_is_seen(ds):
    """The sha256 cache is keyed by size and mtime: a rewritten file is hashed again."""
    cfg = DataConfig(path=str(ds), window=64)
    build_loader(cfg, IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    assert (ds / ".verified.json").exists()
    f = ds / _shard(ds)["tokens"]
    b = bytearray(f.read_bytes())
    b[0] ^= 1
    f.write_bytes(bytes(b))
    os.utime(f, ns=(1, 1))
    with pytest.raises(DataError, match="sha256"):
        build_loader(cfg, IDENT, micro_batch=1, dp_rank=0, dp_size=1)


def test_wrong_dtype(ds):
    e = _shard(ds)
    f = ds / e["tokens"]
    toks = np.fromfile(f, dtype="<u4")
    f.write_bytes(toks.astype("<u2").tobytes())  # same tokens written as uint16
    errs = verify_dataset(ds)
    assert len(errs) == 1 and str(f) in errs[0] and "wrong dtype" in errs[0]


def test_index_token_mismatch(ds):
    e = _shard(ds)
    idx = ds / e["index"]
    off = np.fromfile(idx, dtype="<u8")
    off[-1] -= 1
    off.tofile(idx)
    errs = verify_dataset(ds)
    assert any(str(idx) in x and "index/token mismatch" in x for x in errs)
    off = np.fromfile(idx, dtype="<u8")
    np.append(off, off[-1]).tofile(idx)  # one offset too many
    assert any(str(idx) in x and "documents" in x for x in verify_dataset(ds))


def test_missing_shard_and_tokenizer_mismatch(ds, capsys):
    e = _shard(ds, "b2")
    (ds / e["tokens"]).unlink()
    errs = verify_dataset(ds, tokenizer_identity="byte:v257:01927f6dec51a9dd")
    assert any("tokenizer identity" in x for x in errs)
    assert any(str(ds / e["tokens"]) in x and "missing" in x for x in errs)
    rc = main(["data", "verify", str(ds), "--tokenizer", "byte"])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer identity" in err and e["tokens"] in err


def test_token_ids_out_of_vocab(tmp_path):
    root = tmp_path / "d"
    write_dataset(root, unique_docs([30, 40]), vocab=70_000, ident="t:v70000:x")
    e = json.loads((root / "manifest.json").read_text())["shards"][0]
    m = json.loads((root / "manifest.json").read_text())
    m["tokenizer"]["vocab_size"] = 1000  # ids go up to ~1040
    (root / "manifest.json").write_text(json.dumps(m))
    errs = verify_dataset(root, check_ids=True)
    assert any(str(root / e["tokens"]) in x and ">= tokenizer vocab_size 1000" in x for x in errs)


def test_non_utf8_input(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "good.txt").write_text("fine text\n")
    (src / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    out = tmp_path / "ds"
    with pytest.raises(DataError, match=r"latin1.txt: not UTF-8 .*--skip-bad-utf8"):
        build_dataset([Source(str(src))], BYTE, out, workers=1, progress=False)
    assert not out.exists() and not any(p.name.startswith(".ds.tmp") for p in tmp_path.iterdir())
    rc = main(["data", "build", "--input", str(src), "--tokenizer", "byte", "--out", str(out), "--no-progress"])
    assert rc == 2 and "latin1.txt" in capsys.readouterr().err and not out.exists()
    m = build_dataset([Source(str(src))], BYTE, out, workers=1, progress=False, skip_bad_utf8=True, val_fraction=0)
    assert m["build"]["skipped_not_utf8"] == 1 and m["counts"]["b0"]["train"]["documents"] == 1


def test_include_matches_nothing(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("x = 1\n")
    rc = main(
        [
            "data",
            "build",
            "--input",
            str(src),
            "--include",
            "*.py",
            "--include",
            "*.rst",
            "--tokenizer",
            "byte",
            "--out",
            str(tmp_path / "ds"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "'*.rst'" in err and str(src) in err and not (tmp_path / "ds").exists()


def test_missing_input(tmp_path, capsys):
    rc = main(
        ["data", "build", "--input", str(tmp_path / "nope"), "--tokenizer", "byte", "--out", str(tmp_path / "ds")]
    )
    assert rc == 2 and "nope does not exist" in capsys.readouterr().err


def test_failed_build_keeps_previous_dataset(tmp_path):
    """--overwrite replaces a dataset only once the new one is complete."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello\n")
    out = tmp_path / "ds"
    build_dataset([Source(str(src))], BYTE, out, workers=1, progress=False)
    before = (out / "manifest.json").read_text()
    (src / "b.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(DataError, match="b.txt"):
        build_dataset([Source(str(src))], BYTE, out, workers=1, progress=False, overwrite=True)
    assert (out / "manifest.json").read_text() == before and verify_dataset(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "src"]


def test_bad_manifest(tmp_path, capsys):
    root = tmp_path / "d"
    root.mkdir()
    (root / "manifest.json").write_text("{not json")
    rc, err = _verify_cli(root, capsys)
    assert rc == 2 and "manifest.json: not valid JSON" in err


def test_corrupted_copy_with_preserved_mtime_is_seen(ds):
    """`cp -p` keeps size and mtime; the new inode still forces a re-hash."""
    import shutil

    cfg = DataConfig(path=str(ds), window=64)
    build_loader(cfg, IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    f = ds / _shard(ds)["tokens"]
    b = bytearray(f.read_bytes())
    b[1] ^= 1
    tmp = f.with_name("x.tmp")
    tmp.write_bytes(bytes(b))
    shutil.copystat(f, tmp)
    os.replace(tmp, f)
    with pytest.raises(DataError, match=f"{f}: sha256"):
        build_loader(cfg, IDENT, micro_batch=1, dp_rank=0, dp_size=1)


def test_jsonl_not_utf8_and_gzip(tmp_path):
    import gzip

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not UTF-8"):
        build_dataset([Source(str(bad))], BYTE, tmp_path / "o", workers=1, progress=False)
    assert not (tmp_path / "o").exists()
    good = tmp_path / "good.jsonl.gz"
    with gzip.open(good, "wt", encoding="utf-8") as f:
        f.write('{"text": "héllo"}\n\n{"text": "wörld!"}\n')
    m = build_dataset([Source(str(good))], BYTE, tmp_path / "o", workers=1, progress=False, val_fraction=0)
    assert m["counts"]["b0"]["train"] == {"documents": 2, "tokens": len("héllo".encode()) + len("wörld!".encode())}


def test_verify_names_every_bad_file_of_a_shard(ds, capsys):
    """A truncated .tok does not hide a damaged .meta.jsonl of the same shard, nor a missing .tok
    its damaged .idx: `data verify` lists every bad file (exit 2)."""
    a, b = _shard(ds, "b1"), _shard(ds, "b2")
    (ds / a["tokens"]).write_bytes((ds / a["tokens"]).read_bytes()[:-4])
    (ds / a["meta"]).write_text((ds / a["meta"]).read_text().replace("CC0", "CC1"))
    (ds / b["tokens"]).unlink()
    off = np.fromfile(ds / b["index"], dtype="<u8")
    off[0] = 1
    off.tofile(ds / b["index"])
    bad = [ds / a["tokens"], ds / a["meta"], ds / b["tokens"], ds / b["index"]]
    errs = verify_dataset(ds)
    assert len(errs) == 4 and all(any(x.startswith(f"{f}: ") for x in errs) for f in bad), errs
    rc, err = _verify_cli(ds, capsys)
    assert rc == 2 and all(str(f) in err for f in bad) and "4 problem(s)" in err


def test_missing_provenance_file_found_without_hashing(ds):
    """`verify --no-hash` still names a listed file that is gone (the per-document .meta.jsonl)."""
    e = _shard(ds)
    metas = [ds / rel for rel in e["sha256"] if rel not in (e["tokens"], e["index"])]
    assert metas, e
    metas[0].unlink()
    for check_hash in (True, False):
        errs = verify_dataset(ds, check_hash=check_hash)
        assert len(errs) == 1 and f"{metas[0]}: missing" in errs[0], (check_hash, errs)
