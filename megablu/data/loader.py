"""Deterministic, resumable, dp-aware loader over one dataset bucket.

Sequences. Every sequence is T+1 tokens s[0..T]; input_ids = s[:T], labels = s[1:T+1] with
-100 where s has no token (padding). Documents are preceded by EOT (the document
separator doubles as BOS) and followed by EOT:
  fit       one document per sequence, [EOT] + doc + [EOT] padded; only documents with
            len(doc) + 1 <= T (every doc token and the closing EOT is a label); others are
            dropped and counted in stats["dropped_fraction"].
  truncate  one document per sequence, the first T+1 tokens of [EOT] + doc + [EOT]; the
            doc tokens past the window are counted in stats["truncated_fraction"].
  pack      per epoch the documents are shuffled and concatenated as
            EOT d1 EOT d2 ... dn EOT; window w is stream[w*T : w*T+T+1] (consecutive windows
            share one token); the incomplete last window is dropped.
Document ids (data.doc_mask). Each batch also carries doc_ids (B, T) int32: the index, within
its row, of the document each input token belongs to. Rule: every EOT of the pack stream
except the row's first token starts a new id (the EOT before a document is its BOS), so the
ids start at 0 and never decrease; the token before an EOT predicts that EOT inside its own
document, and the EOT predicts the next document's first token seeing only itself. fit and
truncate rows hold one document: all 0 (padding included).
Order. Sequence space of N sequences per epoch; epoch e visits them in the order of
rng(seed, e).permutation(N). Global sequence g is (epoch, i) = divmod(g, N). Local batch k
of dp rank r holds global sequences g0 + (k*dp_size + r)*micro_batch + j, j < micro_batch,
so dp ranks read disjoint sequences and every sp rank of a dp group (same dp_rank) reads
the same batch. The state is the number of global sequences consumed; a resumed loader
continues exactly (and without repeats or gaps even when dp_size or micro_batch changed).
A mixture (data.mix, megablu/data/mix.py) maps each global sequence to one source's own
sequence space; the state is the same count, so every source keeps its position.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..config.schema import DataConfig
from ..utils.files import sha256_file
from .shards import MANIFEST, DataError, DocTable, read_manifest, select_shards, verify_shard

log = logging.getLogger(__name__)

IGNORE = -100


# --------------------------------------------------------------------------- verification cache
def _cache_file(root: Path) -> Path:
    if os.access(root, os.W_OK):
        return root / ".verified.json"
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
            if (verify == "cache" and c and c["size"] == st.st_size and c["mtime_ns"] == st.st_mtime_ns
                    and c.get("ino") == st.st_ino and c["sha256"] == want):
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
            self.seq_labels = L[self.docs] + 1   # doc tokens + the closing EOT
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
        return {"mode": self.mode, "window": self.T, "seed": self.seed, "sequences_per_epoch": self.n,
                "documents": len(self.t), "doc_tokens": self.total_doc_tokens}

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
            out[1:1 + m] = toks
            if doc is not None:
                doc[:] = 0          # one document per row
            if 1 + m <= T:
                out[1 + m] = self.eot
                return m + 2
            return m + 1
        order, docs, starts = ep
        a = int(order[i]) * T  # stream window [a, a + T + 1)
        b = a + T + 1
        j = int(np.searchsorted(starts, a, side="right")) - 1
        pos = 0
        opens = []   # positions > 0 of an EOT: each starts the next document id
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
                out[pos:pos + hi - lo] = self.t.doc(d, lo - s0 - 1, hi - s0 - 1)
                pos += hi - lo
            j += 1
        if doc is not None:
            mark = np.zeros(T + 1, dtype=np.int32)
            mark[[p for p in opens if p > 0]] = 1
            np.cumsum(mark, out=doc)
        return pos


# --------------------------------------------------------------------------- loader
def _make_batch(space, mb: int, dp: int, rank: int, g0: int, k: int, doc_ids: bool = False) -> dict:
    """Local batch k of dp rank `rank`: global sequences g0 + (k*dp + rank)*mb + j, j < mb.

    `space` is a SequenceSpace or a mixture's MixedSpace (T, eot, sequence(g, out[, doc]))."""
    import torch

    T = space.T
    buf = np.zeros((mb, T + 1), dtype=np.int64)
    lab = np.full((mb, T), IGNORE, dtype=np.int64)
    doc = np.zeros((mb, T + 1), dtype=np.int32) if doc_ids else None
    base = g0 + (k * dp + rank) * mb
    for j in range(mb):
        n = space.sequence(base + j, buf[j]) if doc is None else space.sequence(base + j, buf[j], doc[j])
        if n < T + 1:
            buf[j, n:] = space.eot  # a valid id under the padding; labels there are IGNORE
            if doc is not None:
                doc[j, n:] = doc[j, n - 1]   # padding takes the last id
        lab[j, :n - 1] = buf[j, 1:n]
    out = {"input_ids": torch.from_numpy(buf[:, :T].copy()), "labels": torch.from_numpy(lab)}
    if doc is not None:
        out["doc_ids"] = torch.from_numpy(doc[:, :T].copy())   # (B, T) int32, aligned with input_ids
    return out


def _prefetch(make, k0: int, q: queue.Queue, stop: threading.Event) -> None:
    """Background producer: batches k0, k0+1, ... into q until stop is set (an exception is queued and ends it)."""
    k = k0
    while not stop.is_set():
        try:
            item = make(k)
        except BaseException as e:  # surfaced by next_batch
            item = e
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        if isinstance(item, BaseException):
            return
        k += 1


class Loader:
    def __init__(self, space, *, micro_batch: int, dp_rank: int, dp_size: int, prefetch: int,
                 identity: dict, stats: dict, doc_ids: bool = False, mixture: Optional[dict] = None):
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} outside 0..dp_size-1={dp_size - 1}")
        self.space, self.mb, self.rank, self.dp = space, int(micro_batch), int(dp_rank), int(dp_size)
        self.prefetch = int(prefetch)
        self.doc_ids = bool(doc_ids)
        self._identity = identity
        self.stats = stats
        self.mixture = mixture   # the resolved mixture (megablu.data.mix.resolve), written to mixture.json
        self._g0 = 0      # global sequences consumed before local batch 0
        self._k = 0       # local batches handed out since g0
        self._thread: Optional[threading.Thread] = None
        self._q: Optional[queue.Queue] = None
        self._stop: Optional[threading.Event] = None

    # -- batches
    def _make(self, k: int) -> dict:
        return _make_batch(self.space, self.mb, self.dp, self.rank, self._g0, k, self.doc_ids)

    def _stop_thread(self):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = self._q = self._stop = None

    def next_batch(self) -> dict:
        if self.prefetch <= 0:
            b = self._make(self._k)
        else:
            if self._thread is None:
                self._q, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
                # the thread holds no reference to self, so a dropped Loader is collected and stops it
                make = functools.partial(_make_batch, self.space, self.mb, self.dp, self.rank, self._g0,
                                         doc_ids=self.doc_ids)
                self._thread = threading.Thread(target=_prefetch, args=(make, self._k, self._q, self._stop),
                                                name="megablu-data-prefetch", daemon=True)
                self._thread.start()
            b = self._q.get()
            if isinstance(b, BaseException):
                self._stop_thread()
                raise b
        self._k += 1
        return b

    def __iter__(self):
        while True:
            yield self.next_batch()

    def close(self):
        self._stop_thread()

    def __del__(self):
        try:
            self._stop_thread()
        except Exception:
            pass

    # -- position
    @property
    def sequences_consumed(self) -> int:
        """Global sequences (all dp ranks) consumed through this loader's last batch."""
        return self._g0 + self._k * self.dp * self.mb

    def state_dict(self) -> dict:
        sd = {"version": 1, "sequences_consumed": self.sequences_consumed, **self._identity}
        positions = getattr(self.space, "positions", None)
        if positions is not None:   # a mixture: sequences read from each source (informative, checked at load)
            sd["source_positions"] = positions(self.sequences_consumed)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") != 1:
            raise DataError(f"loader state version {sd.get('version')!r} is not 1")
        diff = {k: (sd.get(k), v) for k, v in self._identity.items() if sd.get(k) != v}
        if diff:
            raise DataError("loader state was saved for other data; resuming would change the sequences: "
                            + ", ".join(f"{k}: saved {a!r} != now {b!r}" for k, (a, b) in diff.items()))
        positions = getattr(self.space, "positions", None)
        if positions is not None and sd.get("source_positions") != positions(int(sd["sequences_consumed"])):
            raise DataError(f"loader state: source positions {sd.get('source_positions')} != "
                            f"{positions(int(sd['sequences_consumed']))} that this code maps "
                            f"{sd['sequences_consumed']} sequences to; the mixture's order changed")
        self._stop_thread()
        self._g0 = int(sd["sequences_consumed"])
        self._k = 0


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
    stats: dict      # documents, tokens, sequences_per_epoch, truncated/dropped/padding/pack_tail fractions
    identity: dict   # what a saved loader state must match: dataset hash, bucket, split, space fingerprint


def open_source(path: str, *, bucket: str, split: str, mode: str, window: int, seed: int,
                tokenizer_identity: Optional[str], verify: bool = True, field: str = "data") -> OpenedSource:
    """Read and check one dataset selection (sha256 too when verify); DataError names the problem.

    `field` names the config entry in messages ("data", or "data.mix[1] (short)" for a source)."""
    root = Path(path).expanduser()
    m = read_manifest(root)
    have = m["tokenizer"].get("identity")
    if tokenizer_identity is not None and have != tokenizer_identity:
        raise DataError(f"{root / MANIFEST}: data tokenized with {have!r} but the run's tokenizer is "
                        f"{tokenizer_identity!r}; rebuild the data with this tokenizer or fix tokenizer:")
    shards = select_shards(m, bucket, split, root)
    docs = sum(int(e["documents"]) for e in shards)
    if not shards or docs == 0:
        counts = {b: {s: c.get("documents", 0) for s, c in v.items()} for b, v in m.get("counts", {}).items()}
        raise DataError(f"{root}: bucket {bucket!r} split {split!r} is empty (documents per bucket/split: "
                        f"{counts}); choose another {field}.bucket/{field}.split")
    if verify:
        verify_for_training(root, m, shards)
    else:   # sizes and offsets only: a config-time check must not hash gigabytes
        errs = [e for sh in shards for e in verify_shard(root, sh, m["dtype"], check_hash=False)]
        if errs:
            raise DataError(f"dataset {root} failed verification:\n  " + "\n  ".join(errs))
    table = DocTable.open(root, shards, m["dtype"])
    space = SequenceSpace(table, mode, window, int(m["tokenizer"]["eot_id"]), seed)
    if space.n == 0:
        why = (f"no document is shorter than the window {window} (longest fitting length {window - 1})"
               if mode == "fit" else f"{space.total_doc_tokens} tokens do not fill one window of {window}")
        raise DataError(f"{root}: bucket {bucket!r} split {split!r} has no sequence in mode {mode}: {why}")
    total = max(1, space.total_doc_tokens)
    stats = {"path": str(root), "bucket": bucket, "split": split, "mode": mode, "window": window,
             "documents": len(table), "tokens": space.total_doc_tokens, "sequences_per_epoch": space.n,
             "truncated_fraction": space.truncated_tokens / total, "dropped_fraction": space.dropped_tokens / total,
             "pack_tail_fraction": space.tail_tokens / total, "padding_fraction": space.pad_fraction}
    identity = {"dataset": hashlib.sha256(json.dumps([e["sha256"] for e in shards], sort_keys=True).encode())
                .hexdigest()[:16], "bucket": bucket, "split": split, **space.fingerprint()}
    return OpenedSource(root, space, stats, identity)


def epochs_problem(field: str, src: OpenedSource, planned: int, max_epochs: float, fix: str) -> Optional[str]:
    """The message for a run that would cycle a source more than max_epochs times (None if it does not)."""
    n = src.space.n
    epochs = planned / n
    if epochs <= max_epochs:
        return None
    s = src.stats
    return (f"{src.root}: the run consumes {planned:,} sequences of T={s['window']} but bucket {s['bucket']!r} "
            f"split {s['split']!r} (mode {s['mode']}) holds {n:,} per epoch: {epochs:.2f} epochs > "
            f"{field}.max_epochs={max_epochs:g}; {fix}")


def log_source(field: str, src: OpenedSource, epochs: Optional[float], max_epochs: float, rank0: bool) -> None:
    s, T = src.stats, src.stats["window"]
    say = log.info if rank0 else log.debug
    say("%s %s bucket=%s split=%s mode=%s T=%d: %d documents, %d tokens, %d sequences/epoch; truncated %.1f%%, "
        "dropped %.1f%%, padding %.1f%% of tokens; planned epochs %s (max %g)", field, src.root, s["bucket"],
        s["split"], s["mode"], T, s["documents"], s["tokens"], s["sequences_per_epoch"],
        100 * s["truncated_fraction"], 100 * s["dropped_fraction"], 100 * s["padding_fraction"],
        "unknown" if epochs is None else f"{epochs:.3f}", max_epochs)
    if s["truncated_fraction"] > 0.01 and rank0:
        log.warning("%s: %.1f%% of the bucket's tokens are truncated away at T=%d (the seed's l3 arm trained on "
                    "truncated documents and gained nothing)", field, 100 * s["truncated_fraction"], T)
    if s["dropped_fraction"] > 0.01 and rank0:
        log.warning("%s: mode=fit drops %.1f%% of the bucket's tokens (documents longer than T-1=%d)", field,
                    100 * s["dropped_fraction"], T - 1)


def build_loader(cfg: DataConfig, tokenizer_identity: str, *, micro_batch: int, dp_rank: int, dp_size: int,
                 total_sequences: Optional[int] = None) -> Loader:
    """Verify the dataset(s) and build this dp rank's loader (see the module docstring)."""
    if cfg.mix is not None:
        from .mix import open_mixture

        space, mixture, identity = open_mixture(cfg, tokenizer_identity, total_sequences, rank0=dp_rank == 0)
        return Loader(space, micro_batch=micro_batch, dp_rank=dp_rank, dp_size=dp_size, prefetch=cfg.prefetch,
                      identity=identity, stats=mixture, doc_ids=cfg.doc_mask, mixture=mixture)
    if not cfg.path:
        raise DataError("data.path is not set: point it at a dataset made by `megablu data build`, or list "
                        "sources under data.mix")
    src = open_source(cfg.path, bucket=cfg.bucket, split=cfg.split, mode=cfg.mode, window=cfg.window,
                      seed=cfg.seed, tokenizer_identity=tokenizer_identity)
    epochs = None if total_sequences is None else total_sequences / src.space.n
    stats = {**src.stats, "planned_sequences": total_sequences, "planned_epochs": epochs,
             "max_epochs": cfg.max_epochs}
    if total_sequences is not None:
        err = epochs_problem("data", src, total_sequences, cfg.max_epochs,
                             "use more data, fewer steps, or raise data.max_epochs")
        if err:
            raise DataError(err)
    log_source("data", src, epochs, cfg.max_epochs, dp_rank == 0)
    from .mix import resolve_single

    mixture = resolve_single(cfg, src, total_sequences)
    return Loader(src.space, micro_batch=micro_batch, dp_rank=dp_rank, dp_size=dp_size, prefetch=cfg.prefetch,
                  identity=src.identity, stats=stats, doc_ids=cfg.doc_mask, mixture=mixture)
