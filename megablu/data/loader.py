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
import logging
import queue
import threading
from typing import Optional

import numpy as np

from ..config.schema import DataConfig
from .mix import open_mixture, resolve_single
from .shards import DataError
from .source import epochs_problem, log_source, open_source

log = logging.getLogger(__name__)

IGNORE = -100


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
                doc[j, n:] = doc[j, n - 1]  # padding takes the last id
        lab[j, : n - 1] = buf[j, 1:n]
    out = {"input_ids": torch.from_numpy(buf[:, :T].copy()), "labels": torch.from_numpy(lab)}
    if doc is not None:
        out["doc_ids"] = torch.from_numpy(doc[:, :T].copy())  # (B, T) int32, aligned with input_ids
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
    def __init__(
        self,
        space,
        *,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        prefetch: int,
        identity: dict,
        stats: dict,
        doc_ids: bool = False,
        mixture: Optional[dict] = None,
    ):
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} outside 0..dp_size-1={dp_size - 1}")
        self.space, self.mb, self.rank, self.dp = space, int(micro_batch), int(dp_rank), int(dp_size)
        self.prefetch = int(prefetch)
        self.doc_ids = bool(doc_ids)
        self._identity = identity
        self.stats = stats
        self.mixture = mixture  # the resolved mixture (megablu.data.mix.resolve), written to mixture.json
        self._g0 = 0  # global sequences consumed before local batch 0
        self._k = 0  # local batches handed out since g0
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
                make = functools.partial(
                    _make_batch, self.space, self.mb, self.dp, self.rank, self._g0, doc_ids=self.doc_ids
                )
                self._thread = threading.Thread(
                    target=_prefetch,
                    args=(make, self._k, self._q, self._stop),
                    name="megablu-data-prefetch",
                    daemon=True,
                )
                self._thread.start()
            assert self._q is not None
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
        if positions is not None:  # a mixture: sequences read from each source (informative, checked at load)
            sd["source_positions"] = positions(self.sequences_consumed)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") != 1:
            raise DataError(f"loader state version {sd.get('version')!r} is not 1")
        diff = {k: (sd.get(k), v) for k, v in self._identity.items() if sd.get(k) != v}
        if diff:
            raise DataError(
                "loader state was saved for other data; resuming would change the sequences: "
                + ", ".join(f"{k}: saved {a!r} != now {b!r}" for k, (a, b) in diff.items())
            )
        positions = getattr(self.space, "positions", None)
        if positions is not None and sd.get("source_positions") != positions(int(sd["sequences_consumed"])):
            raise DataError(
                f"loader state: source positions {sd.get('source_positions')} != "
                f"{positions(int(sd['sequences_consumed']))} that this code maps "
                f"{sd['sequences_consumed']} sequences to; the mixture's order changed"
            )
        self._stop_thread()
        self._g0 = int(sd["sequences_consumed"])
        self._k = 0


def build_loader(
    cfg: DataConfig,
    tokenizer_identity: str,
    *,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
    total_sequences: Optional[int] = None,
) -> Loader:
    """Verify the dataset(s) and build this dp rank's loader (see the module docstring)."""
    if cfg.mix is not None:
        space, mixture, identity = open_mixture(cfg, tokenizer_identity, total_sequences, rank0=dp_rank == 0)
        return Loader(
            space,
            micro_batch=micro_batch,
            dp_rank=dp_rank,
            dp_size=dp_size,
            prefetch=cfg.prefetch,
            identity=identity,
            stats=mixture,
            doc_ids=cfg.doc_mask,
            mixture=mixture,
        )
    if not cfg.path:
        raise DataError(
            "data.path is not set: point it at a dataset made by `megablu data build`, or list sources under data.mix"
        )
    src = open_source(
        cfg.path,
        bucket=cfg.bucket,
        split=cfg.split,
        mode=cfg.mode,
        window=cfg.window,
        seed=cfg.seed,
        tokenizer_identity=tokenizer_identity,
    )
    epochs = None if total_sequences is None else total_sequences / src.space.n
    stats = {**src.stats, "planned_sequences": total_sequences, "planned_epochs": epochs, "max_epochs": cfg.max_epochs}
    if total_sequences is not None:
        err = epochs_problem(
            "data", src, total_sequences, cfg.max_epochs, "use more data, fewer steps, or raise data.max_epochs"
        )
        if err:
            raise DataError(err)
    log_source("data", src, epochs, cfg.max_epochs, dp_rank == 0)
    mixture = resolve_single(cfg, src, total_sequences)
    return Loader(
        src.space,
        micro_batch=micro_batch,
        dp_rank=dp_rank,
        dp_size=dp_size,
        prefetch=cfg.prefetch,
        identity=src.identity,
        stats=stats,
        doc_ids=cfg.doc_mask,
        mixture=mixture,
    )
