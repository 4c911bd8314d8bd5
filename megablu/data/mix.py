"""Data mixtures (`data.mix`): several sources, each sequence of the global order drawn from one.

Weights are shares of LOSS TOKENS (labels that are not padding), not of sequences: a `fit`
row carries its document plus the closing EOT as labels and padding after it, a `pack` row
carries T labels, so "long 0.6 / short 0.4" means 60% / 40% of the tokens the model is
trained on, whatever the modes. Source k's share of sequences is therefore
p_k ~ w_k / r_k, with r_k its mean labels per sequence over an epoch.

Order (deterministic, seeded, O(1) per sequence). The global sequence order is cut into
blocks of BLOCK sequences; every block holds exactly q_k sequences of source k (q_k: p_k *
BLOCK rounded by largest remainder, at least 1 for a positive weight), interleaved evenly
with seeded offsets (MixedSpace._block), so any stretch of the order, a short run or one
step's batch, holds each source within about one sequence of its share. The c-th sequence
of source k in block b is that
source's own global sequence b*q_k + c, read from its own SequenceSpace (its epochs, its
shuffles, its seed derived from data.seed and the source's name). So g -> (k, g_k) is a pure
function of g: dp ranks read disjoint sequences exactly as with one source, and a loader
resumed at g continues every source where it was (Loader.state_dict keeps g, plus the
per-source positions as a check).

Config-time checks (`mix_problems`, called from megablu.train.trainer.preflight before any
rank starts): each path is a dataset, its bucket exists and is not empty, every source has
the run's tokenizer, and no source would be cycled more than its max_epochs by the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import Optional

import numpy as np

from .shards import MANIFEST, DataError, read_manifest
from .source import OpenedSource, epochs_problem, log_source, open_source

log = logging.getLogger(__name__)

BLOCK = 1024  # sequences per block of the global order; each block holds every source's exact quota
WEIGHTS_ARE = "shares of loss tokens (labels that are not padding), per source"


def planned_sequences(cfg) -> int:
    """Global sequences a run of cfg (the whole Config) consumes: max_steps x tokens_per_step / window."""
    return cfg.train.max_steps * cfg.train.tokens_per_step // cfg.data.window


def source_seed(seed: int, name: str) -> int:
    """A source's own shuffling seed: distinct per name, so one dataset listed twice is read in two orders."""
    return int.from_bytes(hashlib.sha256(f"megablu-mix-source:{seed}:{name}".encode()).digest()[:8], "little") >> 1


def block_quotas(weights: list[float], labels_per_seq: list[float], block: int = BLOCK) -> list[int]:
    """Sequences per block for each source so that the token shares follow the weights.

    p_k ~ w_k / r_k (r_k: mean labels per sequence); largest-remainder rounding of p_k * block,
    and a source with a positive weight gets at least one sequence per block."""
    w = np.asarray(weights, dtype=np.float64)
    r = np.asarray(labels_per_seq, dtype=np.float64)
    pos = w > 0
    if int(pos.sum()) > block:
        raise DataError(f"data.mix: {int(pos.sum())} sources with a positive weight > {block} sequences per block")
    p = np.where(pos, w / np.maximum(r, 1e-12), 0.0)
    exact = p / p.sum() * block
    q = np.floor(exact).astype(np.int64)
    short = block - int(q.sum())
    order = sorted(range(len(w)), key=lambda k: (-(exact[k] - q[k]), k))
    for k in order[:short]:
        q[k] += 1
    for j in np.nonzero(pos & (q == 0))[0]:  # a few percent of a huge-row source still appears
        q[int(np.argmax(q))] -= 1
        q[j] = 1
    return [int(x) for x in q]


class MixedSpace:
    """Global sequence g -> (source k, that source's sequence g_k) by blocks (module docstring)."""

    def __init__(self, names: list[str], spaces: list, quotas: list[int], seed: int):
        self.names, self.spaces, self.q = names, spaces, np.asarray(quotas, dtype=np.int64)
        self.T, self.eot = spaces[0].T, spaces[0].eot
        if any(s.T != self.T or s.eot != self.eot for s in spaces):
            raise DataError("data.mix: sources disagree on the window or the EOT id")
        self.block = int(self.q.sum())
        self.seed = int.from_bytes(hashlib.sha256(f"megablu-mix-order:{seed}".encode()).digest()[:8], "little") >> 1
        self._base = np.repeat(np.arange(len(spaces), dtype=np.int64), self.q)
        self._blocks: dict[int, tuple] = {}
        self._lock = threading.Lock()

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position in block b, its rank among that source's positions in the block).

        Stratified, not shuffled: the j-th of source k's q_k sequences has the ideal position
        (j + u_k) * block / q_k (u_k a seeded offset per block and source), and the block is
        sorted by ideal position (ties broken by a seeded draw). Every prefix of a block, so
        every stretch of a short run and every step's batch, then holds each source within
        about one sequence of its quota's proportion."""
        with self._lock:  # the prefetch thread reads sequences while state_dict counts positions
            return self._block_locked(b)

    def _block_locked(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        got = self._blocks.get(b)
        if got is None:
            rng = np.random.default_rng([self.seed, b])
            u = rng.random(len(self.q))
            ideal = np.concatenate([(np.arange(q) + u[k]) * (self.block / q) for k, q in enumerate(self.q) if q])
            rank = np.concatenate([np.arange(q) for q in self.q if q])
            order = np.lexsort((rng.random(self.block), ideal))
            got = (self._base[order], rank[order])
            if len(self._blocks) >= 2:
                self._blocks.pop(min(self._blocks))
            self._blocks[b] = got
        return got

    def locate(self, g: int) -> tuple[int, int]:
        b, r = divmod(int(g), self.block)
        src, rank = self._block(b)
        k = int(src[r])
        return k, b * int(self.q[k]) + int(rank[r])

    def sequence(self, g: int, out: np.ndarray, doc: Optional[np.ndarray] = None) -> int:
        k, gk = self.locate(g)
        return self.spaces[k].sequence(gk, out) if doc is None else self.spaces[k].sequence(gk, out, doc)

    def counts(self, g: int) -> list[int]:
        """Sequences of each source among global sequences [0, g)."""
        b, r = divmod(int(g), self.block)
        c = b * self.q
        if r:
            c = c + np.bincount(self._block(b)[0][:r], minlength=len(self.spaces))
        return [int(x) for x in c]

    def positions(self, g: int) -> dict:
        """{source name: sequences read from it} after global sequences [0, g) (kept in the loader state)."""
        return dict(zip(self.names, self.counts(g), strict=True))


# --------------------------------------------------------------------------- opening and checking
def _field(i: int, name: str) -> str:
    return f"data.mix[{i}] ({name})"


def _open_sources(d, run_identity: Optional[str], verify: bool) -> tuple[list[Optional[OpenedSource]], list[str]]:
    """Open every source of d.mix; (opened or None per source, every problem found)."""
    problems: list[str] = []
    idents: dict[str, str] = {}
    manifests: list[Optional[dict]] = []
    for i, s in enumerate(d.mix):
        f = _field(i, s.name)
        try:
            m = read_manifest(Path(s.path).expanduser())
        except DataError as e:
            problems.append(f"{f}.path: {s.path} is not a megablu dataset: {e}")
            manifests.append(None)
            continue
        manifests.append(m)
        idents[f] = m["tokenizer"].get("identity")
        names = [b["name"] for b in m["buckets"]]
        bad = [b for b in (names if s.bucket == "all" else s.bucket.split(",")) if b not in names]
        if bad:
            problems.append(
                f"{f}.bucket={s.bucket!r}: {bad} not in {s.path} (its buckets: {names}); choose from those or 'all'"
            )
            manifests[-1] = None
    if len(set(idents.values())) > 1:
        problems.append(
            "data.mix: the sources are tokenized with different tokenizers ("
            + ", ".join(f"{f}: {v}" for f, v in idents.items())
            + "): one run has one vocabulary; "
            "rebuild them with one tokenizer (`megablu data build --tokenizer ...`)"
        )
    if run_identity is not None:
        for i, s in enumerate(d.mix):
            f = _field(i, s.name)
            if f in idents and idents[f] != run_identity:
                problems.append(
                    f"{f}.path: {s.path} is tokenized with {idents[f]!r} but the run's tokenizer is "
                    f"{run_identity!r}; rebuild it with the run's tokenizer or fix tokenizer:"
                )
    opened: list[Optional[OpenedSource]] = []
    for i, (s, man) in enumerate(zip(d.mix, manifests, strict=True)):
        if man is None:
            opened.append(None)
            continue
        f = _field(i, s.name)
        try:
            opened.append(
                open_source(
                    s.path,
                    bucket=s.bucket,
                    split=s.split,
                    mode=s.mode,
                    window=d.window,
                    seed=source_seed(d.seed, s.name),
                    tokenizer_identity=None,
                    verify=verify,
                    field=f"data.mix[{i}]",
                )
            )
        except DataError as e:
            problems.append(f"{f}: {e}")
            opened.append(None)
    return opened, problems


def _resolve(
    d,
    entries: list[dict],
    opened: list[OpenedSource],
    quotas: list[int],
    counts: Optional[list[int]],
    total: Optional[int],
    block: int,
) -> dict:
    """The resolved mixture: what each source contributes, by design and over the planned run."""
    T = d.window
    rbar = [float(o.space.seq_labels.mean()) for o in opened]
    wsum = sum(e["weight"] for e in entries)
    per_block = [q * r for q, r in zip(quotas, rbar, strict=True)]
    planned_tok = None
    if counts is not None:
        planned_tok = [o.space.labels_through(n) for o, n in zip(opened, counts, strict=True)]
    sources = []
    for k, (e, o, q) in enumerate(zip(entries, opened, quotas, strict=True)):
        st = o.stats
        row = {
            **e,
            "target_token_share": e["weight"] / wsum,
            "sequences_per_block": q,
            "sequence_share": q / block,
            "token_share_per_block": per_block[k] / max(1e-12, sum(per_block)),
            "labels_per_sequence": rbar[k],
            "sequences_per_epoch": st["sequences_per_epoch"],
            "documents": st["documents"],
            "tokens": st["tokens"],
            "truncated_fraction": st["truncated_fraction"],
            "dropped_fraction": st["dropped_fraction"],
            "padding_fraction": st["padding_fraction"],
            "pack_tail_fraction": st["pack_tail_fraction"],
            "dataset": o.identity["dataset"],
        }
        if counts is not None and planned_tok is not None:  # both or neither
            row.update(
                planned_sequences=counts[k],
                planned_tokens=planned_tok[k],
                planned_token_share=planned_tok[k] / max(1, sum(planned_tok)),
                planned_epochs=counts[k] / st["sequences_per_epoch"],
            )
        sources.append(row)
    return {
        "window": T,
        "seed": d.seed,
        "block": block,
        "weights_are": WEIGHTS_ARE,
        "planned_sequences": total,
        "planned_tokens": None if planned_tok is None else sum(planned_tok),
        "doc_mask": d.doc_mask,
        "sources": sources,
    }


def _entries(d) -> list[dict]:
    return [
        {
            "name": s.name,
            "path": s.path,
            "bucket": s.bucket,
            "split": s.split,
            "mode": s.mode,
            "weight": float(s.weight),
            "max_epochs": s.max_epochs if s.max_epochs is not None else d.max_epochs,
        }
        for s in d.mix
    ]


def _plan(d, opened: list[OpenedSource], total: Optional[int]):
    entries = _entries(d)
    quotas = block_quotas([e["weight"] for e in entries], [float(o.space.seq_labels.mean()) for o in opened])
    space = MixedSpace([e["name"] for e in entries], [o.space for o in opened], quotas, d.seed)
    counts = space.counts(total) if total is not None else None
    mixture = _resolve(d, entries, opened, quotas, counts, total, space.block)
    problems = []
    for i, row in enumerate(mixture["sources"]):
        if counts is None or row["planned_epochs"] <= row["max_epochs"]:
            continue
        need = math.ceil(row["planned_epochs"] * 100) / 100
        problems.append(
            f"{_field(i, row['name'])}: the run draws {row['planned_sequences']:,} sequences of T={d.window} from "
            f"it ({row['planned_token_share']:.1%} of the run's loss tokens) but {row['path']} bucket "
            f"{row['bucket']!r} split {row['split']!r} (mode {row['mode']}) holds {row['sequences_per_epoch']:,} "
            f"per epoch: {row['planned_epochs']:.2f} epochs > max_epochs={row['max_epochs']:g}; to repeat it set "
            f"data.mix[{i}].max_epochs >= {need:g}, else lower its weight, add data, or train fewer steps"
        )
    return space, mixture, problems


def _all_open(opened: list[Optional[OpenedSource]]) -> list[OpenedSource]:
    """_open_sources' list when it reported no problem: every source opened."""
    out = [o for o in opened if o is not None]
    assert len(out) == len(opened), "a source that failed to open has a problem reported"
    return out


def open_mixture(d, tokenizer_identity: str, total_sequences: Optional[int], rank0: bool = True, verify: bool = True):
    """(MixedSpace, resolved mixture, state identity) for data.mix; DataError listing every problem."""
    maybe, problems = _open_sources(d, tokenizer_identity, verify=verify)
    if problems:
        raise DataError("data.mix:\n  " + "\n  ".join(problems))
    opened = _all_open(maybe)
    space, mixture, problems = _plan(d, opened, total_sequences)
    if problems:
        raise DataError("data.mix:\n  " + "\n  ".join(problems))
    for i, (o, row) in enumerate(zip(opened, mixture["sources"], strict=True)):
        log_source(_field(i, row["name"]), o, row.get("planned_epochs"), row["max_epochs"], rank0)
    if rank0:
        log.info("data mixture (weights are %s):\n%s", WEIGHTS_ARE, format_mixture(mixture))
    identity = {
        "mixture": [
            {"name": r["name"], "weight": r["weight"], "sequences_per_block": r["sequences_per_block"], **o.identity}
            for r, o in zip(mixture["sources"], opened, strict=True)
        ],
        "block": space.block,
        "mix_seed": d.seed,
    }
    return space, mixture, identity


def resolve_single(d, src: OpenedSource, total: Optional[int]) -> dict:
    """The one-source spelling (data.path) as a mixture of one, for mixture.json."""
    entry = {
        "name": "data",
        "path": str(src.root),
        "bucket": d.bucket,
        "split": d.split,
        "mode": d.mode,
        "weight": 1.0,
        "max_epochs": d.max_epochs,
    }
    counts = None if total is None else [total]
    return _resolve(d, [entry], [src], [BLOCK], counts, total, BLOCK)


def mix_problems(cfg, tokenizer_identity: Optional[str] = None) -> list[str]:
    """Every data problem of a training config found by reading the datasets (no hashing): missing or
    partial datasets, unknown buckets, tokenizer mismatches, sources the run would exhaust, a source
    that trains on eval.loss's val split, rope.yarn.apply=beyond_original over data with no sequence
    longer than original_max_position.

    For data.mix and for the one-source spelling (data.path); [] when the data can feed the run."""
    d = cfg.data
    total = planned_sequences(cfg)
    held_out = held_out_problems(cfg)
    if d.mix is None:
        if not d.path:
            return [
                "data.path: not set and no data.mix: point data.path at a dataset made by `megablu data "
                "build`, or list sources under data.mix"
            ]
        if not Path(d.path, MANIFEST).is_file():
            return [
                f"data.path: {d.path} has no manifest.json; build it with `megablu data build` or `megablu data import`"
            ]
        try:
            src = open_source(
                d.path,
                bucket=d.bucket,
                split=d.split,
                mode=d.mode,
                window=d.window,
                seed=d.seed,
                tokenizer_identity=tokenizer_identity,
                verify=False,
            )
        except DataError as e:
            return held_out + [f"data: {e}"]
        p = epochs_problem("data", src, total, d.max_epochs, "use more data, fewer steps, or raise data.max_epochs")
        return held_out + ([f"data: {p}"] if p else []) + beyond_original_problems(cfg, [("data", src)])
    from ..config.schema import mix_invariants

    if mix_invariants(d):  # reported by check_invariants; the plan needs valid weights
        return held_out
    maybe, problems = _open_sources(d, tokenizer_identity, verify=False)
    if problems:
        return held_out + problems
    opened = _all_open(maybe)
    used = [(_field(i, s.name), o) for i, (s, o) in enumerate(zip(d.mix, opened, strict=True)) if s.weight > 0]
    return held_out + _plan(d, opened, total)[2] + beyond_original_problems(cfg, used)


def held_out_problems(cfg) -> list[str]:
    """A training source that reads the val split eval.loss scores (the same dataset, split val, a bucket in
    common: a document sits in one bucket): the held-out loss would score text the run trains on."""
    ev = getattr(cfg, "eval", None)  # a caller may pass only data and train (the sections the plan reads)
    lo = ev.loss.data if ev is not None else None
    if not lo:
        return []
    from .haystack import split_spec

    root, bucket = split_spec(lo)
    d = cfg.data
    srcs = (
        [("data.split=val", d.path, d.bucket, d.split)]
        if d.mix is None
        else [(_field(i, s.name), s.path, s.bucket, s.split) for i, s in enumerate(d.mix) if s.weight > 0]
    )
    out = []
    for where, path, b, split in srcs:
        if (
            split != "val"
            or not path
            or os.path.realpath(os.path.expanduser(path)) != os.path.realpath(os.path.expanduser(root))
        ):
            continue
        if "all" in (b, bucket) or set(b.split(",")) & set(bucket.split(",")):
            common = (
                "every bucket"
                if b == bucket == "all"
                else (
                    f"bucket(s) {b}"
                    if bucket == "all"
                    else f"bucket(s) {bucket}"
                    if b == "all"
                    else f"bucket(s) {','.join(sorted(set(b.split(',')) & set(bucket.split(','))))}"
                )
            )
            out.append(
                f"{where}: the run trains on the val split of {path} ({common}), the split eval.loss.data="
                f"{lo!r} scores as held-out text: the held-out loss would score text the model was trained "
                f"on; train on split train, or point eval.loss.data at another dataset"
            )
    return out


def longest_sequence(src: OpenedSource, doc_mask: bool) -> int:
    """The longest "sequence" of a source that rope.yarn.apply=beyond_original compares with
    original_max_position (model/packing.py): a row's real length, or under data.doc_mask a document's
    in-row length. A packed row without doc_mask is full (T); otherwise a sequence is one document and the
    EOT that closes it (fit, truncate) or opens it (pack), at most T: its length + 1."""
    sp = src.space
    if sp.mode == "pack" and not doc_mask:
        return sp.T
    lengths = sp.t.doc_len[sp.docs] if sp.mode == "fit" else sp.t.doc_len
    return min(int(lengths.max()) + 1, sp.T) if len(lengths) else 0


def beyond_original_problems(cfg, sources: list[tuple[str, OpenedSource]]) -> list[str]:
    """rope.yarn.apply=beyond_original trains YaRN only on sequences longer than original_max_position: a
    run whose sources can give none never trains it (decided from each source's document lengths, its mode
    and data.doc_mask: longest_sequence)."""
    y = getattr(getattr(cfg, "rope", None), "yarn", None)
    if y is None or y.apply != "beyond_original" or not sources:
        return []
    orig, mask = y.original_max_position, cfg.data.doc_mask
    longest = [(where, src, longest_sequence(src, mask)) for where, src in sources]
    if max(n for _, _, n in longest) > orig:
        return []
    how = "; ".join(
        f"{where}: {s.root} bucket {s.stats['bucket']!r} split {s.stats['split']!r} in mode {s.space.mode}"
        + (", with data.doc_mask each document is its own sequence" if mask and s.space.mode == "pack" else "")
        + f": its longest document has {n - 1} tokens, so its longest sequence (the document and its EOT) is {n}"
        for where, s, n in longest
    )
    return [
        f"rope.yarn.apply=beyond_original: no training sequence is longer than original_max_position {orig}, so "
        f"every one uses the original RoPE and YaRN is never trained ({how}); train on documents longer than "
        f"{orig} tokens (a bucket above it), or set rope.yarn.apply=always"
    ]


# --------------------------------------------------------------------------- reporting
def format_mixture(mixture: dict) -> str:
    """The resolved mixture as a Markdown table (stderr at start; mixture.json holds every number)."""
    planned = mixture.get("planned_sequences") is not None
    head = ["source", "mode", "bucket", "weight", "target tok", "seq/block", "block tok"]
    if planned:
        head += ["run seqs", "run tok", "epochs", "max"]
    head += ["trunc", "drop", "pad"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in mixture["sources"]:
        cells = [
            s["name"],
            s["mode"],
            s["bucket"],
            f"{s['weight']:g}",
            f"{s['target_token_share']:.1%}",
            str(s["sequences_per_block"]),
            f"{s['token_share_per_block']:.1%}",
        ]
        if planned:
            cells += [
                f"{s['planned_sequences']:,}",
                f"{s['planned_token_share']:.1%}",
                f"{s['planned_epochs']:.2f}",
                f"{s['max_epochs']:g}",
            ]
        cells += [f"{s['truncated_fraction']:.1%}", f"{s['dropped_fraction']:.1%}", f"{s['padding_fraction']:.1%}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_mixture(run_dir, mixture: Optional[dict]) -> Path:
    out = Path(run_dir) / "mixture.json"
    out.write_text(json.dumps(mixture, indent=1) + "\n")
    return out
