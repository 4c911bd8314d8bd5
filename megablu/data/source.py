"""One dataset selection opened for training: verified (sha256 through a cache), its sequence
space (fit | truncate | pack, the order per epoch), stats and fingerprint.

The loader (loader.py) and a mixture (mix.py) both read sources through `open_source`; this
file imports neither, so the two do not import each other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..utils.files import sha256_file
from .shards import MANIFEST, VERIFY_CACHE, DataError, DocTable, read_manifest, select_shards, verify_shard

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- verification cache
def _cache_file(root: Path) -> Path:
    if os.access(root, os.W_OK):
        return root / VERIFY_CACHE
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return Path(os.path.expanduser("~/.cache/megablu/verified")) / f"{key}.json"


def verify_for_training(root: Path, manifest: dict, shards: list[dict], verify: str = "cache") -> None:
    """Structure of every selected shard, then sha256 of its files by `verify`:
    cache: a file is hashed once and trusted while its size + mtime + inode are unchanged (a byte
           flipped in place with the mtime kept passes: `megablu data verify` hashes everything);
    full:  every file is hashed now, whatever the cache says (the cache is refreshed);
    structure: no hashing (sizes and index only).
    Raises DataError listing every bad file."""
    if verify not in ("cache", "full", "structure"):
        raise ValueError(f"verify={verify!r}: expected cache, full or structure")
    cf = _cache_file(root)
    try:
        cache = json.loads(cf.read_text()) if cf.exists() else {}
    except (OSError, json.JSONDecodeError):
        cache = {}
    errs, changed = [], False
    for e in shards:
        errs += verify_shard(root, e, manifest["dtype"], check_hash=False)
    if errs:
        raise DataError(f"dataset {root} failed verification:\n  " + "\n  ".join(errs))
    if verify == "structure":
        return
    for e in shards:
        for rel, want in e.get("sha256", {}).items():
            f = root / rel
            st = f.stat()
            c = cache.get(rel)
            # a copied file (new inode, even with its mtime kept) or a rewritten one is hashed again
            if (
                verify == "cache"
                and c
                and c["size"] == st.st_size
                and c["mtime_ns"] == st.st_mtime_ns
                and c.get("ino") == st.st_ino
                and c["sha256"] == want
            ):
                continue
            got = sha256_file(f)
            if got != want:
                errs.append(f"{f}: sha256 {got[:16]}... != manifest {want[:16]}... (corrupted or modified)")
                continue
            cache[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "sha256": got}
            changed = True
    if errs:
        raise DataError(f"dataset {root} failed verification:\n  " + "\n  ".join(errs))
    if changed:
        try:
            cf.parent.mkdir(parents=True, exist_ok=True)
            tmp = cf.with_name(f"{cf.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=0, sort_keys=True))
            os.replace(tmp, cf)
        except OSError as ex:  # an unwritable cache only costs re-hashing next time
            log.debug("cannot write verification cache %s: %s", cf, ex)


# --------------------------------------------------------------------------- sequence space
class SequenceSpace:
    """Maps (epoch, i) -> the T+1 tokens of sequence i of that epoch (fixed content per epoch)."""

    def __init__(self, table: DocTable, mode: str, window: int, eot: int, seed: int):
        self.t, self.mode, self.T, self.eot, self.seed = table, mode, window, int(eot), int(seed)
        L = table.doc_len
        total = int(L.sum())
        self.total_doc_tokens = total
        self.truncated_tokens = self.dropped_tokens = self.tail_tokens = 0
        if mode == "fit":
            self.docs = np.nonzero(L + 1 <= window)[0]
            self.dropped_tokens = int(L[L + 1 > window].sum())
            self.n = int(self.docs.shape[0])
            self.pad_fraction = 1 - float((L[self.docs] + 1).sum()) / max(1, self.n * window)
            self.seq_labels = L[self.docs] + 1  # doc tokens + the closing EOT
        elif mode == "truncate":
            self.docs = np.arange(len(table))
            self.truncated_tokens = int(np.maximum(L - window, 0).sum())
            self.n = len(table)
            self.pad_fraction = 1 - float(np.minimum(L + 1, window).sum()) / max(1, self.n * window)
            self.seq_labels = np.minimum(L + 1, window)
        elif mode == "pack":
            self.stream_len = int((L + 1).sum()) + 1  # EOT before each doc, one after the last
            self.n = (self.stream_len - 1) // window
            self.tail_tokens = (self.stream_len - 1) - self.n * window
            self.pad_fraction = 0.0
            self.seq_labels = np.full(self.n, window, dtype=np.int64)
        else:
            raise DataError(f"data.mode={mode!r}: expected fit, truncate or pack")
        # seq_labels[i]: labelled (non-padding) targets of sequence i of the space, before the epoch's
        # permutation; a mixture weighs its sources by these (weights are shares of loss tokens)
        self._epochs: dict[int, tuple] = {}

    def labels_through(self, g: int) -> int:
        """Labelled (non-padding) targets in this space's global sequences [0, g)."""
        e, r = divmod(int(g), self.n)
        total = e * int(self.seq_labels.sum())
        if r:
            total += int(self.seq_labels[self._epoch(e)[0][:r]].sum())
        return total

    def fingerprint(self) -> dict:
        return {
            "mode": self.mode,
            "window": self.T,
            "seed": self.seed,
            "sequences_per_epoch": self.n,
            "documents": len(self.t),
            "doc_tokens": self.total_doc_tokens,
        }

    def _epoch(self, e: int):
        got = self._epochs.get(e)
        if got is None:
            order = np.random.default_rng([self.seed, e, 0]).permutation(self.n)
            if self.mode == "pack":
                docs = np.random.default_rng([self.seed, e, 1]).permutation(len(self.t))
                # stream position of the EOT that opens each (permuted) document
                starts = np.zeros(len(docs), dtype=np.int64)
                np.cumsum(self.t.doc_len[docs][:-1] + 1, out=starts[1:])
                got = (order, docs, starts)
            else:
                got = (order,)
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[e] = got
        return got

    def sequence(self, g: int, out: np.ndarray, doc: Optional[np.ndarray] = None) -> int:
        """Write global sequence g into out[:T+1]; return how many tokens are real (rest: padding).

        With doc (T+1 int32), also the document id of every position (module docstring's rule)."""
        e, i = divmod(g, self.n)
        ep = self._epoch(e)
        T = self.T
        if self.mode in ("fit", "truncate"):
            d = int(self.docs[ep[0][i]])
            toks = self.t.doc(d, 0, T)  # at most T doc tokens fit after the opening EOT
            m = len(toks)
            out[0] = self.eot
            out[1 : 1 + m] = toks
            if doc is not None:
                doc[:] = 0  # one document per row
            if 1 + m <= T:
                out[1 + m] = self.eot
                return m + 2
            return m + 1
        order, docs, starts = ep
        a = int(order[i]) * T  # stream window [a, a + T + 1)
        b = a + T + 1
        j = int(np.searchsorted(starts, a, side="right")) - 1
        pos = 0
        opens = []  # positions > 0 of an EOT: each starts the next document id
        while pos < T + 1:
            if j >= len(docs):  # the closing EOT after the last document (at most the last target)
                opens.append(pos)
                out[pos] = self.eot
                pos += 1
                break
            s0, d = int(starts[j]), int(docs[j])
            n = int(self.t.doc_len[d])
            lo = max(a, s0)
            if lo == s0:  # the EOT opening document j
                opens.append(pos)
                out[pos] = self.eot
                pos += 1
                lo += 1
            hi = min(b, s0 + 1 + n)
            if hi > lo:
                out[pos : pos + hi - lo] = self.t.doc(d, lo - s0 - 1, hi - s0 - 1)
                pos += hi - lo
            j += 1
        if doc is not None:
            mark = np.zeros(T + 1, dtype=np.int32)
            mark[[p for p in opens if p > 0]] = 1
            np.cumsum(mark, out=doc)
        return pos


def verify_selection(path: str, bucket: str, split: str, verify: str = "cache") -> None:
    """sha256 of one dataset selection's shards by `verify` (cache | full), as the training
    preflight runs it on rank 0 before the ranks open the data (they then hit the cache)."""
    root = Path(path).expanduser()
    m = read_manifest(root)
    verify_for_training(root, m, select_shards(m, bucket, split, root), verify)


@dataclass
class OpenedSource:
    """One dataset bucket/split opened in one mode: its sequence space, stats and fingerprint."""

    root: Path
    space: SequenceSpace
    stats: dict  # documents, tokens, sequences_per_epoch, truncated/dropped/padding/pack_tail fractions
    identity: dict  # what a saved loader state must match: dataset hash, bucket, split, space fingerprint


def open_source(
    path: str,
    *,
    bucket: str,
    split: str,
    mode: str,
    window: int,
    seed: int,
    tokenizer_identity: Optional[str],
    verify: bool = True,
    field: str = "data",
) -> OpenedSource:
    """Read and check one dataset selection (sha256 too when verify); DataError names the problem.

    `field` names the config entry in messages ("data", or "data.mix[1] (short)" for a source)."""
    root = Path(path).expanduser()
    m = read_manifest(root)
    have = m["tokenizer"].get("identity")
    if tokenizer_identity is not None and have != tokenizer_identity:
        raise DataError(
            f"{root / MANIFEST}: data tokenized with {have!r} but the run's tokenizer is "
            f"{tokenizer_identity!r}; rebuild the data with this tokenizer or fix tokenizer:"
        )
    shards = select_shards(m, bucket, split, root)
    docs = sum(int(e["documents"]) for e in shards)
    if not shards or docs == 0:
        counts = {b: {s: c.get("documents", 0) for s, c in v.items()} for b, v in m.get("counts", {}).items()}
        raise DataError(
            f"{root}: bucket {bucket!r} split {split!r} is empty (documents per bucket/split: "
            f"{counts}); choose another {field}.bucket/{field}.split"
        )
    if verify:
        verify_for_training(root, m, shards)
    else:  # sizes and offsets only: a config-time check must not hash gigabytes
        errs = [e for sh in shards for e in verify_shard(root, sh, m["dtype"], check_hash=False)]
        if errs:
            raise DataError(f"dataset {root} failed verification:\n  " + "\n  ".join(errs))
    table = DocTable.open(root, shards, m["dtype"])
    space = SequenceSpace(table, mode, window, int(m["tokenizer"]["eot_id"]), seed)
    if space.n == 0:
        why = (
            f"no document is shorter than the window {window} (longest fitting length {window - 1})"
            if mode == "fit"
            else f"{space.total_doc_tokens} tokens do not fill one window of {window}"
        )
        raise DataError(f"{root}: bucket {bucket!r} split {split!r} has no sequence in mode {mode}: {why}")
    total = max(1, space.total_doc_tokens)
    stats = {
        "path": str(root),
        "bucket": bucket,
        "split": split,
        "mode": mode,
        "window": window,
        "documents": len(table),
        "tokens": space.total_doc_tokens,
        "sequences_per_epoch": space.n,
        "truncated_fraction": space.truncated_tokens / total,
        "dropped_fraction": space.dropped_tokens / total,
        "pack_tail_fraction": space.tail_tokens / total,
        "padding_fraction": space.pad_fraction,
    }
    identity = {
        "dataset": hashlib.sha256(json.dumps([e["sha256"] for e in shards], sort_keys=True).encode()).hexdigest()[:16],
        "bucket": bucket,
        "split": split,
        **space.fingerprint(),
    }
    return OpenedSource(root, space, stats, identity)


def epochs_problem(field: str, src: OpenedSource, planned: int, max_epochs: float, fix: str) -> Optional[str]:
    """The message for a run that would cycle a source more than max_epochs times (None if it does not)."""
    n = src.space.n
    epochs = planned / n
    if epochs <= max_epochs:
        return None
    s = src.stats
    return (
        f"{src.root}: the run consumes {planned:,} sequences of T={s['window']} but bucket {s['bucket']!r} "
        f"split {s['split']!r} (mode {s['mode']}) holds {n:,} per epoch: {epochs:.2f} epochs > "
        f"{field}.max_epochs={max_epochs:g}; {fix}"
    )


def log_source(field: str, src: OpenedSource, epochs: Optional[float], max_epochs: float, rank0: bool) -> None:
    s, T = src.stats, src.stats["window"]
    say = log.info if rank0 else log.debug
    say(
        "%s %s bucket=%s split=%s mode=%s T=%d: %d documents, %d tokens, %d sequences/epoch; truncated %.1f%%, "
        "dropped %.1f%%, padding %.1f%% of tokens; planned epochs %s (max %g)",
        field,
        src.root,
        s["bucket"],
        s["split"],
        s["mode"],
        T,
        s["documents"],
        s["tokens"],
        s["sequences_per_epoch"],
        100 * s["truncated_fraction"],
        100 * s["dropped_fraction"],
        100 * s["padding_fraction"],
        "unknown" if epochs is None else f"{epochs:.3f}",
        max_epochs,
    )
    if s["truncated_fraction"] > 0.01 and rank0:
        log.warning(
            "%s: %.1f%% of the bucket's tokens are truncated away at T=%d (a truncated "
            "document teaches no distance beyond T)",
            field,
            100 * s["truncated_fraction"],
            T,
        )
    if s["dropped_fraction"] > 0.01 and rank0:
        log.warning(
            "%s: mode=fit drops %.1f%% of the bucket's tokens (documents longer than T-1=%d)",
            field,
            100 * s["dropped_fraction"],
            T - 1,
        )
