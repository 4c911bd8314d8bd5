"""Haystack for the eval harness: a dataset's val bucket read as a stream of real text.

    from megablu.data.haystack import Haystack
    hs = Haystack("data_cache/demo", tokenizer, bucket="b2", split="val")
    ids = hs.tokens(16000, seed=3)     # exactly 16000 token ids of real text
    txt = hs.text(16000, seed=3)       # the same, decoded

The stream is the bucket's documents joined by a blank line ("\n\n" encoded), in a
seed-dependent order starting at a seed-dependent document, so different seeds give
different haystacks and the same seed always the same one. A request longer than the
bucket's text is an error (a haystack that repeats itself is easy to search).

For the eval harness (megablu.eval.harness.load_haystack), which re-tokenizes text itself:

    src = haystack_source("data_cache/demo_cl100k@b2", tokenizer)   # "DIR" = all buckets
    for doc in src(): ...                                            # val documents as str, stable order
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Optional, Protocol

import numpy as np

from .shards import MANIFEST, DataError, DocTable, read_manifest, select_shards, verify_shard


class Codec(Protocol):
    """What a haystack needs of a tokenizer (data.tokenizer.Tokenizer, eval.prompts.TokenizerLike)."""

    identity: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Haystack:
    def __init__(self, path, tokenizer: Codec, bucket: str = "all", split: str = "val"):
        root = Path(path)
        m = read_manifest(root)
        if m["tokenizer"]["identity"] != tokenizer.identity:
            raise DataError(
                f"{root / MANIFEST}: haystack data tokenized with {m['tokenizer']['identity']!r}, the "
                f"model's tokenizer is {tokenizer.identity!r}"
            )
        shards = select_shards(m, bucket, split, root)
        errs = [e for s in shards for e in verify_shard(root, s, m["dtype"], check_hash=False)]
        if errs:
            raise DataError(f"haystack {root} failed verification:\n  " + "\n  ".join(errs))
        self.table = DocTable.open(root, shards, m["dtype"])
        if len(self.table) == 0:
            raise DataError(f"{root}: bucket {bucket!r} split {split!r} has no documents for a haystack")
        self.tokenizer, self.bucket, self.split, self.root = tokenizer, bucket, split, root
        self.sep = np.asarray(tokenizer.encode("\n\n"), dtype=np.int64)
        self.n_tokens = int(self.table.doc_len.sum())

    def tokens(self, n_tokens: int, seed: int = 0) -> list[int]:
        """Exactly n_tokens ids of real text (document boundaries become blank lines)."""
        cap = self.n_tokens + len(self.sep) * (len(self.table) - 1)
        if n_tokens > cap:
            raise DataError(
                f"haystack {self.root} bucket {self.bucket!r} split {self.split!r} holds {cap:,} tokens, "
                f"{n_tokens:,} requested; use a larger bucket (or 'all') for the haystack"
            )
        order = np.random.default_rng([seed, 7]).permutation(len(self.table))
        parts, have = [], 0
        for i, d in enumerate(order):
            if i:
                parts.append(self.sep)
                have += len(self.sep)
            take = min(int(self.table.doc_len[d]), n_tokens - have)
            parts.append(self.table.doc(int(d), 0, take).astype(np.int64))
            have += take
            if have >= n_tokens:
                break
        return np.concatenate(parts)[:n_tokens].tolist()

    def text(self, n_tokens: int, seed: int = 0) -> str:
        return self.tokenizer.decode(self.tokens(n_tokens, seed))

    def documents(self) -> Iterable[str]:
        """The bucket's documents as text, in manifest order (stable)."""
        for d in range(len(self.table)):
            yield self.tokenizer.decode(self.table.doc(d).tolist())


def split_spec(path: str) -> tuple[str, str]:
    """'DIR@b2' -> ('DIR', 'b2'); 'DIR' -> ('DIR', 'all')."""
    if "@" in path and not Path(path).exists():
        root, _, bucket = path.rpartition("@")
        return root, bucket
    return path, "all"


def haystack_source(
    path: str, tokenizer: Codec, bucket: Optional[str] = None, split: str = "val"
) -> Callable[[], Iterable[str]]:
    """A callable yielding the val documents of `path` ('DIR' or 'DIR@b2') as text; checked now
    (tokenizer identity, non-empty bucket, shard sizes), read lazily."""
    root, b = split_spec(path)
    hs = Haystack(root, tokenizer, bucket=bucket or b, split=split)
    return hs.documents
