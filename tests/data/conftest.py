"""Small generated datasets for the data tests (no network, all under tmp_path)."""

from __future__ import annotations

import numpy as np
import pytest

from megablu.data.shards import DatasetWriter

EOT = 99_999
VOCAB = 100_000
IDENT = "test:v100000:0123456789abcdef"


def unique_docs(lengths, seed=0):
    """Documents whose every token is unique: doc i, position p -> 1 + i*1000 + p (so a token says where it
    came from)."""
    return [np.arange(n, dtype=np.int64) + 1 + i * 1000 for i, n in enumerate(lengths)]


def write_dataset(
    root, docs, edges=(64, 128, 256), splits=None, vocab=VOCAB, eot=EOT, ident=IDENT, shard_tokens=1 << 20
):
    splits = splits or ["train"] * len(docs)
    with DatasetWriter(
        root, {"identity": ident, "vocab_size": vocab, "eot_id": eot}, edges=edges, shard_tokens=shard_tokens
    ) as w:
        for i, (d, s) in enumerate(zip(docs, splits)):
            w.add(d, s, {"source": "gen", "license": "CC0", "key": f"gen/{i}"})
        return w.finish()


@pytest.fixture
def doc_lengths():
    rng = np.random.default_rng(7)
    # spans b0 (<64), b1 (64-128), b2 (128-256), b3 (>=256), with exact edge values
    return [int(x) for x in rng.integers(5, 400, size=60)] + [63, 64, 127, 128, 255, 256]


@pytest.fixture
def dataset(tmp_path, doc_lengths):
    docs = unique_docs(doc_lengths)
    root = tmp_path / "ds"
    write_dataset(root, docs, shard_tokens=3000)  # several shards per bucket
    return root, docs
