"""Dataset on disk: document-preserving token shards + a manifest.

Layout of a dataset directory (made by `megablu data build` / `import` / `demo-corpus`):

    manifest.json                      everything below is listed and hashed here
    <bucket>/<split>_<k:05d>.tok       tokens of whole documents, concatenated, no separator,
                                       little-endian uint16 (vocab <= 65536) or uint32
    <bucket>/<split>_<k:05d>.idx       uint64 document offsets into .tok, n_docs + 1 entries,
                                       first 0, last = token count (document i is [idx[i], idx[i+1]))
    <bucket>/<split>_<k:05d>.meta.jsonl  optional: one JSON line per document (source, path, licence)

A document is stored without EOT; the loader inserts EOT (tokenizer.eot_id) where it
needs a separator. manifest.json (format "megablu-shards", version 1):

    tokenizer   {identity, vocab_size, eot_id}
    dtype       "uint16" | "uint32"
    buckets     [{name, lo, hi}]   document length in tokens, lo <= n < hi (hi null = no bound)
    split       {val_fraction, seed, rule}
    shards      [{bucket, split, tokens, index, meta?, documents, n_tokens, sha256 {file: hex}}]
    counts      {bucket: {split: {documents, tokens}}}
    histogram   {edges, counts}    document lengths, power-of-two edges
    sources     [{name, license, provenance, documents, tokens}]

Writes go to a temp directory that is renamed into place only when complete, so a dataset
directory with a manifest.json is always whole.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Optional

import numpy as np

from ..utils.files import replace_problem, sha256_file, swap_in

log = logging.getLogger(__name__)

FORMAT = "megablu-shards"
VERSION = 1
MANIFEST = "manifest.json"
VERIFY_CACHE = ".verified.json"  # data/source.py: sha256s checked, by size + mtime + inode
DEFAULT_EDGES = (4096, 8192, 16384, 32768, 65536, 131072)  # b0 <4k, b1 4-8k, ..., b6 >= 128k
DEFAULT_SHARD_TOKENS = 1 << 28  # 256 Mi tokens: 512 MB at uint16


class DataError(Exception):
    """Any data problem; the message names the file / bucket and the numbers."""


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


def bucket_table(edges=DEFAULT_EDGES) -> list[dict]:
    """[{name: b0, lo: 0, hi: 4096}, ..., {name: b6, lo: 131072, hi: None}] from increasing edges."""
    edges = [int(e) for e in edges]
    if not edges or any(e <= 0 for e in edges) or any(b <= a for a, b in itertools.pairwise(edges)):
        raise DataError(f"bucket edges {edges} must be positive and strictly increasing")
    los = [0] + edges
    his = edges + [None]
    return [{"name": f"b{i}", "lo": lo, "hi": hi} for i, (lo, hi) in enumerate(zip(los, his, strict=True))]


def bucket_of(n_tokens: int, edges) -> int:
    """Index of the bucket holding a document of n_tokens (lo <= n < hi)."""
    return int(np.searchsorted(np.asarray(edges), n_tokens, side="right"))


def length_histogram(lengths) -> dict:
    lengths = np.asarray(lengths, dtype=np.int64)
    top = int(max(1, lengths.max(initial=1)))
    edges = [0] + [1 << k for k in range(0, int(np.ceil(np.log2(top + 1))) + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    return {"edges": edges, "counts": counts.tolist()}


# --------------------------------------------------------------------------- writing
class _Shard:
    def __init__(self, root: Path, bucket: str, split: str, k: int, dtype: str, with_meta: bool):
        self.rel = f"{bucket}/{split}_{k:05d}"
        (root / bucket).mkdir(parents=True, exist_ok=True)
        self.root, self.bucket, self.split, self.dtype = root, bucket, split, np.dtype(dtype)
        self.f_tok = open(root / f"{self.rel}.tok", "wb")
        self.f_meta = open(root / f"{self.rel}.meta.jsonl", "w", encoding="utf-8") if with_meta else None
        self.h_tok, self.h_meta = hashlib.sha256(), hashlib.sha256()
        self.offsets = [0]

    def add(self, tokens: np.ndarray, meta: Optional[dict]):
        b = np.ascontiguousarray(tokens, dtype=self.dtype).astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        self.f_tok.write(b)
        self.h_tok.update(b)
        self.offsets.append(self.offsets[-1] + len(tokens))
        if self.f_meta is not None:
            line = json.dumps(meta or {}, sort_keys=True, ensure_ascii=False) + "\n"
            self.f_meta.write(line)
            self.h_meta.update(line.encode("utf-8"))

    def close(self) -> dict:
        self.f_tok.close()
        idx = np.asarray(self.offsets, dtype="<u8").tobytes()
        (self.root / f"{self.rel}.idx").write_bytes(idx)
        entry: dict[str, Any] = {
            "bucket": self.bucket,
            "split": self.split,
            "tokens": f"{self.rel}.tok",
            "index": f"{self.rel}.idx",
            "documents": len(self.offsets) - 1,
            "n_tokens": self.offsets[-1],
            "sha256": {f"{self.rel}.tok": self.h_tok.hexdigest(), f"{self.rel}.idx": hashlib.sha256(idx).hexdigest()},
        }
        if self.f_meta is not None:
            self.f_meta.close()
            entry["meta"] = f"{self.rel}.meta.jsonl"
            entry["sha256"][f"{self.rel}.meta.jsonl"] = self.h_meta.hexdigest()
        return entry


class DatasetWriter:
    """Append documents (already tokenized) to bucketed shards; `finish` writes the manifest and
    renames the temp directory to `out`. Use as a context manager: on error the temp dir is removed.
    """

    def __init__(
        self,
        out: Path,
        tokenizer_info: dict,
        edges=DEFAULT_EDGES,
        split_info: Optional[dict] = None,
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        overwrite: bool = False,
        with_meta: bool = True,
        inputs: Iterable = (),
    ):
        self.out = Path(out)
        self.inputs = [Path(i) for i in inputs]
        self.overwrite = overwrite
        self._check_out()
        self.tmp = self.out.with_name(f".{self.out.name}.tmp-{os.getpid()}")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        stale = (
            sorted(p.name for p in self.out.parent.glob(f".{self.out.name}.tmp-*")) if self.out.parent.exists() else []
        )
        if stale:
            log.warning(
                "partial build(s) %s next to %s: an interrupted or concurrent build; delete them if no "
                "build is running",
                stale,
                self.out,
            )
        try:
            self.tmp.mkdir(parents=True)
        except OSError as e:  # checked above (replace_problem); the filesystem may still refuse
            raise DataError(
                f"--out {self.out}: cannot create {self.tmp} ({e.strerror or e}); give --out a place "
                f"this user can write"
            ) from None
        self.tok_info = dict(tokenizer_info)
        self.dtype = dtype_for_vocab(int(tokenizer_info["vocab_size"]))
        self.edges = list(edges)
        self.buckets = bucket_table(self.edges)
        self.split_info = split_info or {}
        self.shard_tokens = int(shard_tokens)
        self.with_meta = with_meta
        self.open: dict[tuple[str, str], _Shard] = {}
        self.count: dict[tuple[str, str], int] = {}
        self.entries: list[dict] = []
        self.lengths: list[int] = []
        self.sources: dict[str, dict] = {}

    def _check_out(self) -> None:
        check_dataset_out(self.out, self.overwrite, self.inputs)

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            return False
        self.abort()
        if issubclass(et, OSError):  # a full disk, a quota, a vanished mount: one line, nothing left behind
            fix = "; free space there or give --out on another disk" if ev.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise DataError(
                f"writing the dataset {self.out} failed: {ev.strerror or ev}"
                f"{f' ({ev.filename})' if ev.filename else ''}; nothing was written at {self.out} and the "
                f"partial build was removed{fix}"
            ) from ev
        return False

    def abort(self):
        """Close every open shard and remove the temp dir. Closing flushes a file's buffer, which fails again on
        a full disk: each close is tried once, and the temp dir is removed whatever they raise."""
        for s in self.open.values():
            for f in (s.f_tok, s.f_meta):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        self.open.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def add(self, tokens, split: str, meta: Optional[dict] = None) -> str:
        """Add one document; returns its bucket name."""
        tokens = np.asarray(tokens)
        n = int(tokens.shape[0])
        if n == 0:
            raise DataError("empty document passed to DatasetWriter.add (skip empty documents before)")
        if tokens.max() >= int(self.tok_info["vocab_size"]) or tokens.min() < 0:
            raise DataError(
                f"token id {int(tokens.max())} outside the tokenizer's vocab "
                f"{self.tok_info['vocab_size']} ({(meta or {}).get('path', 'document')})"
            )
        b = self.buckets[bucket_of(n, self.edges)]["name"]
        key = (b, split)
        sh = self.open.get(key)
        if sh is not None and sh.offsets[-1] > 0 and sh.offsets[-1] + n > self.shard_tokens:
            self.entries.append(sh.close())
            sh = None
        if sh is None:
            k = self.count.get(key, 0)
            self.count[key] = k + 1
            sh = self.open[key] = _Shard(self.tmp, b, split, k, self.dtype, self.with_meta)
        sh.add(tokens, meta)
        self.lengths.append(n)
        if meta and "source" in meta:
            s = self.sources.setdefault(
                meta["source"],
                {
                    "name": meta["source"],
                    "license": meta.get("license"),
                    "provenance": meta.get("provenance"),
                    "documents": 0,
                    "tokens": 0,
                },
            )
            s["documents"] += 1
            s["tokens"] += n
        return b

    def finish(self, extra: Optional[dict] = None) -> dict:
        for sh in self.open.values():
            self.entries.append(sh.close())
        self.open.clear()
        if not self.entries:
            self.abort()
            raise DataError("no documents were written (every input was empty or skipped)")
        self.entries.sort(key=lambda e: e["tokens"])
        counts: dict = {b["name"]: {} for b in self.buckets}
        for e in self.entries:
            c = counts[e["bucket"]].setdefault(e["split"], {"documents": 0, "tokens": 0})
            c["documents"] += e["documents"]
            c["tokens"] += e["n_tokens"]
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": self.tok_info,
            "dtype": self.dtype,
            "buckets": self.buckets,
            "split": self.split_info,
            "shards": self.entries,
            "counts": counts,
            "histogram": length_histogram(self.lengths),
            "sources": sorted(self.sources.values(), key=lambda s: s["name"]),
        }
        if extra:
            manifest.update(extra)
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
        try:  # again: the folder may have changed while this was building
            self._check_out()
        except DataError as e:
            self.abort()
            raise DataError(f"{e} (it changed while building; nothing replaced)") from None
        swap_in(self.tmp, self.out)
        return manifest


def dataset_files(root: Path) -> Optional[set[str]]:
    """Every relative path a megablu dataset at root consists of (its manifest, the shards it lists, their
    bucket folders, the verification cache), or None when root is not one (no readable manifest of this
    format): what `--overwrite` may replace."""
    try:
        m = json.loads((Path(root) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("shards"), list):
        return None
    files = {MANIFEST, VERIFY_CACHE}
    for e in m["shards"]:
        for k in ("tokens", "index", "meta"):
            rel = e.get(k) if isinstance(e, dict) else None
            if isinstance(rel, str):
                files.add(rel)
                files.update(p.as_posix() for p in PurePosixPath(rel).parents if p.as_posix() != ".")
    return files


def check_dataset_out(out, overwrite: bool, inputs: Iterable = ()) -> None:
    """DataError unless a dataset may be written at `out` (utils/files.py replace_problem): a new or empty
    folder, or with --overwrite a megablu dataset holding nothing else; never an input of the command."""
    why = replace_problem(
        Path(out), what="a megablu dataset", flag="--overwrite", replace=overwrite, owned=dataset_files, inputs=inputs
    )
    if why:
        raise DataError(why)


# --------------------------------------------------------------------------- reading
def read_manifest(root) -> dict:
    root = Path(root)
    mf = root / MANIFEST
    if not root.is_dir():
        raise DataError(f"dataset directory {root} does not exist (build it with `megablu data build`)")
    if not mf.is_file():
        raise DataError(
            f"{mf} is missing: {root} is not a complete megablu dataset (an interrupted build leaves "
            f"only a .tmp directory; rebuild it)"
        )
    try:
        m = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{mf}: not valid JSON ({e})") from None
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise DataError(
            f"{mf}: format {m.get('format')!r} version {m.get('version')!r}, expected {FORMAT!r} version {VERSION}"
        )
    for k in ("tokenizer", "dtype", "buckets", "shards"):
        if k not in m:
            raise DataError(f"{mf}: missing key {k!r}")
    if m["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"{mf}: dtype {m['dtype']!r} is not uint16 or uint32")
    return m


def select_shards(manifest: dict, bucket: str, split: str, root="") -> list[dict]:
    names = [b["name"] for b in manifest["buckets"]]
    want = names if bucket == "all" else bucket.split(",")
    bad = [b for b in want if b not in names]
    if bad:
        raise DataError(f"{Path(root) / MANIFEST}: bucket(s) {bad} not in this dataset (it has {names})")
    return [e for e in manifest["shards"] if e["bucket"] in want and e["split"] == split]


def _hash_problems(root: Path, entry: dict, named: list[str]) -> list[str]:
    """sha256 of each of the shard's files against the manifest, except files already in `named`."""
    errs = []
    for rel, want in entry.get("sha256", {}).items():
        f = root / rel
        if any(e.startswith(f"{f}: ") for e in named):
            continue
        if not f.is_file():
            errs.append(f"{f}: missing (listed in {root / MANIFEST})")
            continue
        got = sha256_file(f)
        if got != want:
            errs.append(f"{f}: sha256 {got[:16]}... != manifest {want[:16]}... (corrupted or modified)")
    return errs


def verify_shard(
    root: Path, entry: dict, dtype: str, check_hash: bool = True, vocab_size: Optional[int] = None
) -> list[str]:
    """Problems with one shard, each naming the file; [] if it is sound."""
    errs = []
    item = np.dtype(dtype).itemsize
    tok, idx = root / entry["tokens"], root / entry["index"]
    for f in (tok, idx):
        if not f.is_file():
            errs.append(f"{f}: missing (listed in {root / MANIFEST})")
    if errs:  # the shard's other files are still checked, so every bad file is named
        return errs + (_hash_problems(root, entry, errs) if check_hash else [])
    n_tok, n_doc = int(entry["n_tokens"]), int(entry["documents"])
    size = tok.stat().st_size
    if size != n_tok * item:
        hint = ""
        if size == n_tok * (6 - item):  # 2 <-> 4
            hint = f" (that is {n_tok} tokens of {'uint32' if item == 2 else 'uint16'}: wrong dtype)"
        elif size % item:
            hint = f" (not a whole number of {dtype} tokens: truncated or corrupted)"
        errs.append(f"{tok}: {size} bytes, manifest says {n_tok} tokens x {item} B ({dtype}) = {n_tok * item}{hint}")
    isize = idx.stat().st_size
    if isize != (n_doc + 1) * 8:
        errs.append(
            f"{idx}: {isize} bytes, manifest says {n_doc} documents -> {(n_doc + 1) * 8} bytes of uint64 offsets"
        )
    else:
        off = np.fromfile(idx, dtype="<u8")
        if off[0] != 0 or off[-1] != n_tok:
            errs.append(f"{idx}: offsets run {int(off[0])}..{int(off[-1])}, expected 0..{n_tok} (index/token mismatch)")
        elif n_doc and np.any(np.diff(off.astype(np.int64)) <= 0):
            errs.append(f"{idx}: offsets are not strictly increasing (an empty or negative-length document)")
    if check_hash:
        errs += _hash_problems(root, entry, errs)
    else:  # no hashing, but every listed file (the .meta.jsonl provenance too) must be there
        errs += [
            f"{root / rel}: missing (listed in {root / MANIFEST})"
            for rel in entry.get("sha256", {})
            if not (root / rel).is_file() and not any(e.startswith(f"{root / rel}: ") for e in errs)
        ]
    if vocab_size is not None and not errs and n_tok:
        mx = int(np.memmap(tok, dtype=np.dtype(dtype).newbyteorder("<"), mode="r").max())
        if mx >= vocab_size:
            errs.append(f"{tok}: token id {mx} >= tokenizer vocab_size {vocab_size} (wrong dtype or tokenizer)")
    return errs


def verify_dataset(
    root,
    tokenizer_identity: Optional[str] = None,
    check_hash: bool = True,
    check_ids: bool = False,
    bucket: str = "all",
    split: Optional[str] = None,
) -> list[str]:
    """Every problem in the dataset at `root` (restricted to bucket/split when given)."""
    root = Path(root)
    try:
        m = read_manifest(root)
    except DataError as e:
        return [str(e)]
    errs = []
    have = m["tokenizer"].get("identity")
    if tokenizer_identity is not None and have != tokenizer_identity:
        errs.append(
            f"{root / MANIFEST}: tokenizer identity {have!r} != {tokenizer_identity!r}: the data was "
            f"tokenized with another tokenizer; rebuild it or use the matching tokenizer"
        )
    splits = ["train", "val"] if split is None else [split]
    vocab = int(m["tokenizer"]["vocab_size"]) if check_ids else None
    try:
        entries = [e for s in splits for e in select_shards(m, bucket, s, root)]
    except DataError as e:
        return errs + [str(e)]
    for entry in entries:
        errs += verify_shard(root, entry, m["dtype"], check_hash=check_hash, vocab_size=vocab)
    return errs


@dataclass
class DocTable:
    """All documents of some shards: token memmaps + per-document (shard, start, length)."""

    root: Path
    dtype: str
    shards: list[dict]
    tokens: list = field(default_factory=list)  # np.memmap per shard
    # per document (open() fills them): its shard, its first token there, its length
    doc_shard: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    doc_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    doc_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def open(cls, root, shards: list[dict], dtype: str) -> DocTable:
        root = Path(root)
        t = cls(root, dtype, shards)
        dt = np.dtype(dtype).newbyteorder("<")
        ds, st, ln = [], [], []
        for i, e in enumerate(shards):
            off = np.fromfile(root / e["index"], dtype="<u8").astype(np.int64)
            n = int(e["n_tokens"])
            t.tokens.append(np.memmap(root / e["tokens"], dtype=dt, mode="r", shape=(n,)) if n else np.zeros(0, dt))
            ds.append(np.full(len(off) - 1, i, dtype=np.int32))
            st.append(off[:-1])
            ln.append(np.diff(off))
        t.doc_shard = np.concatenate(ds) if ds else np.zeros(0, np.int32)
        t.doc_start = np.concatenate(st) if st else np.zeros(0, np.int64)
        t.doc_len = np.concatenate(ln) if ln else np.zeros(0, np.int64)
        return t

    def __len__(self) -> int:
        return int(self.doc_len.shape[0])

    def doc(self, i: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Tokens [start, stop) of document i."""
        n = int(self.doc_len[i])
        stop = n if stop is None else min(stop, n)
        s0 = int(self.doc_start[i])
        return np.asarray(self.tokens[int(self.doc_shard[i])][s0 + start : s0 + stop])
