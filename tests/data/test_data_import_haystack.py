import json

import numpy as np
import pytest

from megablu.cli import main
from megablu.config.schema import DataConfig, TokenizerConfig
from megablu.data.build import Source, build_dataset
from megablu.data.haystack import Haystack
from megablu.data.importer import import_flat
from megablu.data.loader import build_loader
from megablu.data.shards import DataError, verify_dataset
from megablu.data.tokenizer import ByteTokenizer, load_tokenizer, parse_tokenizer_spec

from .conftest import unique_docs

EOT = 50256


def flat_file(path, docs, dtype="<u2", lead_eot=False):
    parts = [[EOT]] if lead_eot else []
    for d in docs:
        parts += [d, [EOT]]
    np.concatenate(parts).astype(dtype).tofile(path)
    return path


def test_import_seed_format(tmp_path, capsys):
    docs = unique_docs([10, 70, 300, 5, 130])
    seed = tmp_path / "b3_16384_32768"
    seed.mkdir()
    tr = flat_file(seed / "train_shard_00000.bin", docs[:3], lead_eot=True)
    va = flat_file(seed / "val_shard_00000.bin", docs[3:])
    out = tmp_path / "ds"
    rc = main(
        [
            "data",
            "import",
            "--input",
            str(tr),
            "--input",
            str(va),
            "--dtype",
            "uint16",
            "--eot",
            str(EOT),
            "--identity",
            "tiktoken:gpt2:seed",
            "--vocab-size",
            "50257",
            "--bucket-edges",
            "64,128,256",
            "--out",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert "| b3 | >= 256 | 1 | 300 |" in capsys.readouterr().out
    assert verify_dataset(out) == []
    m = json.loads((out / "manifest.json").read_text())
    assert m["tokenizer"]["identity"] == "tiktoken:gpt2:seed" and m["dtype"] == "uint16"
    assert m["counts"]["b0"] == {"train": {"documents": 1, "tokens": 10}, "val": {"documents": 1, "tokens": 5}}
    assert m["counts"]["b2"]["val"] == {"documents": 1, "tokens": 130}
    # the imported documents read back through the loader are the originals
    L = build_loader(
        DataConfig(path=str(out), window=400, mode="fit", bucket="b3"),
        "tiktoken:gpt2:seed",
        micro_batch=1,
        dp_rank=0,
        dp_size=1,
    )
    x = L.next_batch()["input_ids"][0].numpy()
    assert x[0] == EOT and (x[1:301] == docs[2]).all() and x[301] == EOT


def test_import_wrong_dtype_and_eot(tmp_path):
    docs = unique_docs([10, 20])
    f = flat_file(tmp_path / "train_0.bin", docs, dtype="<u4")
    # uint32 read as uint16: ids are still < vocab, but every high half is 0
    with pytest.raises(DataError, match="train_0.bin: every second uint16 is 0.*--dtype uint32"):
        import_flat([str(f)], tmp_path / "o1", dtype="uint16", eot=EOT, identity="x", vocab_size=70000)
    g = tmp_path / "train_1.bin"
    g.write_bytes(f.read_bytes()[:-1])
    with pytest.raises(DataError, match=r"train_1.bin: 127 bytes is not a whole number of uint16 tokens"):
        import_flat([str(g)], tmp_path / "o2", dtype="uint16", eot=EOT, identity="x", vocab_size=70000)
    h = flat_file(tmp_path / "train_2.bin", [np.array([60000, 1])])
    with pytest.raises(DataError, match="train_2.bin: token id 60000 >= vocab size 50257"):
        import_flat([str(h)], tmp_path / "o3", dtype="uint16", eot=EOT, identity="x", vocab_size=50257)
    with pytest.raises(DataError, match="cannot tell train from val"):
        import_flat(
            [str(flat_file(tmp_path / "shard.bin", docs))],
            tmp_path / "o4",
            dtype="uint16",
            eot=EOT,
            identity="x",
            vocab_size=50257,
        )
    with pytest.raises(DataError, match="--eot 50256 but tokenizer byte"):
        import_flat([str(h)], tmp_path / "o5", dtype="uint16", eot=EOT, tokenizer="byte")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == []  # nothing half-written


def _haystack_ds(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"d{i:02d}.txt").write_text(f"Document {i}. " + "lorem ipsum dolor sit amet " * (10 + 7 * i))
    build_dataset(
        [Source(str(src))],
        TokenizerConfig(kind="byte"),
        tmp_path / "ds",
        workers=1,
        progress=False,
        val_fraction=0.5,
        edges=[1000],
    )
    return tmp_path / "ds"


def test_haystack(tmp_path):
    root = _haystack_ds(tmp_path)
    tok = ByteTokenizer()
    hs = Haystack(root, tok, bucket="all", split="val")
    ids = hs.tokens(500, seed=1)
    assert len(ids) == 500 and EOT not in ids and tok.eot_id not in ids
    assert ids == hs.tokens(500, seed=1)
    assert hs.tokens(500, seed=2) != ids or len(hs.table) == 1
    txt = hs.text(500, seed=1)
    assert txt.startswith("Document ") and "lorem ipsum" in txt
    with pytest.raises(DataError, match="requested"):
        hs.tokens(10**6)


def test_haystack_source_for_eval_harness(tmp_path):
    from megablu.data.haystack import haystack_source

    root = _haystack_ds(tmp_path)
    tok = ByteTokenizer()
    src = haystack_source(str(root), tok)
    docs = list(src())
    texts = {p.read_text() for p in (tmp_path / "src").iterdir()}
    assert docs and set(docs) <= texts and docs == list(src())  # real documents, stable order
    m = json.loads((root / "manifest.json").read_text())
    assert len(docs) == sum(c.get("val", {}).get("documents", 0) for c in m["counts"].values())
    b1 = list(haystack_source(f"{root}@b1", tok)())
    assert b1 and all(len(d) >= 1000 for d in b1)
    with pytest.raises(DataError, match="not in this dataset"):
        haystack_source(f"{root}@b7", tok)


def test_haystack_tokenizer_mismatch(tmp_path, monkeypatch):
    root = _haystack_ds(tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tk"))
    with pytest.raises(DataError, match="haystack data tokenized with 'byte"):
        Haystack(root, load_tokenizer(TokenizerConfig(kind="tiktoken", name="cl100k_base")))


def test_train_tokenizer_and_use_it(tmp_path, capsys):
    pytest.importorskip("rustbpe")
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    words = ["def", "passkey", "return", "value", "self", "import", "class", "lambda", "yield", "print"]
    (src / "a.py").write_text("\n".join(" ".join(rng.choice(words, 6)) + f" {i}" for i in range(3000)))
    rank = tmp_path / "tok" / "t.tiktoken"
    assert main(["data", "train-tokenizer", "--input", str(src), "--vocab-size", "300", "--out", str(rank)]) == 0
    t = load_tokenizer(parse_tokenizer_spec(f"tiktoken_file:{rank}"))
    assert (t.vocab_size, t.eot_id) == (300, 299)
    s = "def passkey self return value 7\n"
    ids = t.encode(s)
    assert t.decode(ids) == s and len(ids) < len(s) / 2  # merges learnt
    assert json.loads(rank.with_name("t.tiktoken.json").read_text())["vocab_size"] == 300


def test_shipped_stdlib4k():
    t = load_tokenizer(parse_tokenizer_spec("tiktoken_file:megablu:stdlib4k"))
    assert (t.vocab_size, t.eot_id) == (4096, 4095)
    assert t.identity == "tiktoken_file:v4096:33b169a4741adc73"
    s = "import os\n\ndef main():\n    print('passkey 90210')\n"
    assert t.decode(t.encode(s)) == s
    assert len(t.encode("90210")) == 5  # one digit per token


def test_eval_harness_reads_the_haystack(tmp_path):
    """The handshake with megablu.eval: load_haystack(path, tokenizer) -> the needle Haystack."""
    harness = pytest.importorskip("megablu.eval.harness")
    needle = pytest.importorskip("megablu.eval.needle")
    root = _haystack_ds(tmp_path)
    tok = ByteTokenizer()
    src = harness.load_haystack(f"{root}@b1", tok)
    hay = needle.Haystack(src, tok, 1500)
    assert len(hay.ids) >= 1500 and "lorem ipsum" in tok.decode(hay.ids[:400])
