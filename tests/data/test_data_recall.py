"""Synthetic recall documents (demo-corpus part `recall`): deterministic, answerable from
their own text, never in the eval's wording, filler only from train documents."""

import json

from megablu.data.build import Source, split_of
from megablu.data.recall import LABELS, recall_document, train_texts, write_recall_jsonl

TEXTS = ["line one of a document\n" * 40, "def f(x):\n    return x\n" * 30, "To be, or not to be\n" * 50]


def test_deterministic_and_answerable():
    for i in range(40):
        d = recall_document(TEXTS, seed=3, index=i, min_chars=200, max_chars=800)
        assert d == recall_document(TEXTS, seed=3, index=i, min_chars=200, max_chars=800)
        body, _, qa = d["text"].rpartition("\n\n")
        value = qa.strip().split()[-1].rstrip(".")
        assert value.isdigit() and 3 <= len(value) <= 8
        assert value in body  # the answer was stated earlier in the document
        assert d["asked"] in LABELS and 1 <= d["n_facts"] <= 4
    assert recall_document(TEXTS, 3, 0) != recall_document(TEXTS, 4, 0)


def test_never_the_eval_wording():
    for i in range(200):
        t = recall_document(TEXTS, 0, i, 200, 600)["text"].lower()
        assert "pass key" not in t and "passkey" not in t and "magic number" not in t
        assert "the grass is green" not in t


def test_filler_comes_from_train_documents_only(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for k in range(40):
        (src / f"doc{k}.txt").write_text(f"TEXT-{k} " * 50)
    sources = [Source(str(src), name="s")]
    val = {k for k in range(40) if split_of(f"s/doc{k}.txt", 0.3, 0) == "val"}
    assert val  # the fixture has val documents at all
    assert not any(f"TEXT-{k} " in t for t in train_texts(sources, 0.3) for k in val)
    out = write_recall_jsonl(sources, tmp_path / "r", val_fraction=0.3, n_docs=30, min_chars=100, max_chars=400)
    assert (
        write_recall_jsonl(sources, tmp_path / "r", val_fraction=0.3, n_docs=30, min_chars=100, max_chars=400) == out
    )  # cached by its inputs
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(docs) == 30
    assert not any(f"TEXT-{k} " in d["text"] for d in docs for k in val)


def test_demo_corpus_recall_part_and_min_tokens(tmp_path, monkeypatch):
    """--parts ...,recall adds the recall source after the others; --min-tokens drops short documents."""
    from megablu.config.schema import TokenizerConfig
    from megablu.data import demo

    src = tmp_path / "src"
    src.mkdir()
    for k in range(30):
        (src / f"doc{k}.txt").write_text(f"line {k} of some text\n" * (5 + 20 * k))
    seen = {}

    def fake_sources(work, parts):
        seen["parts"] = parts
        return [Source(str(src), name="fake")], {"stdlib": "fake"}

    monkeypatch.setattr(demo, "demo_sources", fake_sources)
    m = demo.build_demo_corpus(
        tmp_path / "out",
        TokenizerConfig(kind="byte"),
        work=tmp_path / "w",
        parts="stdlib,recall",
        val_fraction=0.2,
        progress=False,
        min_tokens=500,
    )
    assert seen["parts"] == ["stdlib"]  # recall is not a download part
    names = {s["name"]: s["documents"] for s in m["sources"]}
    assert set(names) == {"fake", "recall"} and names["recall"] > 0
    assert m["build"]["skipped_short"] > 0  # the short fake documents and recall ones
    for e in m["shards"]:
        lines = (tmp_path / "out" / e["meta"]).read_text().splitlines()
        assert all(json.loads(line)["n_tokens"] >= 500 for line in lines)
