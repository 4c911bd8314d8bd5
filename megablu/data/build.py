"""`megablu data build`: text files / directories / JSONL -> tokenized, bucketed shards.

One input file is one document, except JSONL where each line is one document (its
`--text-key` field). Documents are tokenized in worker processes (order preserved, so the
output is identical for any worker count), split train/val by a hash of their key (stable
when other documents are added or removed), and bucketed by token count.
"""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import json
import logging
import multiprocessing as mp
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ..config.schema import TokenizerConfig
from .shards import DEFAULT_EDGES, DEFAULT_SHARD_TOKENS, DataError, DatasetWriter
from .tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Doc:
    key: str  # stable id: "<source>/<relative path>[:line]"; decides the split
    path: str  # file the text comes from
    text: Optional[str] = None  # None: the worker reads `path`
    meta: dict = field(default_factory=dict)


@dataclass
class Source:
    """One --input: a file, a directory, or a JSONL file, with provenance."""

    path: str
    name: Optional[str] = None
    license: str = "unknown"
    provenance: Optional[str] = None
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    text_key: str = "text"
    meta_keys: list[str] = field(default_factory=list)  # JSONL fields copied into per-doc meta


def split_of(key: str, val_fraction: float, seed: int) -> str:
    """'val' for a stable pseudo-random val_fraction of keys, else 'train'."""
    if val_fraction <= 0:
        return "train"
    h = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big")
    return "val" if h / 2.0**64 < val_fraction else "train"


def _match(rel: str, pats: list[str]) -> bool:
    base = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(rel, p) or fnmatch.fnmatchcase(base, p) for p in pats)


@dataclass
class InputFile:
    src: Source
    key: str  # "<source>/<relative path>"
    path: str
    rel: str
    meta: dict  # source, license, provenance
    size: int


def list_inputs(sources: list[Source]) -> list[InputFile]:
    """Every input file, in a deterministic order, before anything is read. Raises DataError for a
    missing input or an --include pattern that matches no file (so a bad command fails at once)."""
    out = []
    for src in sources:
        p = Path(src.path)
        name = src.name or p.name or str(p)
        base_meta = {"source": name, "license": src.license, "provenance": src.provenance or str(p.resolve())}
        if not p.exists():
            raise DataError(f"input {p} does not exist")
        if p.is_dir():
            files, used = [], {pat: 0 for pat in src.include}
            for dirpath, dirnames, filenames in os.walk(p):
                # hidden directories (.git, .venv) and __pycache__ are never documents
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
                for fn in sorted(filenames):
                    if fn.startswith("."):
                        continue
                    rel = os.path.relpath(os.path.join(dirpath, fn), p).replace(os.sep, "/")
                    if src.include:
                        hits = [pat for pat in src.include if _match(rel, [pat])]
                        if not hits:
                            continue
                        for pat in hits:
                            used[pat] += 1
                    if src.exclude and _match(rel, src.exclude):
                        continue
                    files.append(rel)
            unused = [pat for pat, n in used.items() if n == 0]
            if unused:
                raise DataError(f"--include {unused} matched no file under {p}")
            if not files:
                raise DataError(f"no files under {p} (after --include {src.include} / --exclude {src.exclude})")
            items = [(f"{name}/{rel}", str(p / rel), rel) for rel in files]
        else:
            if src.include and not _match(p.name, src.include):
                raise DataError(f"--include {src.include} does not match the input file {p}")
            items = [(f"{name}/{p.name}", str(p), p.name)]
        out += [InputFile(src, key, path, rel, base_meta, os.path.getsize(path)) for key, path, rel in items]
    return out


def _is_jsonl(path: str) -> bool:
    return path.endswith(".jsonl") or path.endswith(".jsonl.gz")


def iter_documents(
    sources: list[Source],
    max_docs: Optional[int] = None,
    max_bytes: Optional[int] = None,
    inputs: Optional[list[InputFile]] = None,
) -> Iterator[Doc]:
    """Documents of all sources in a deterministic order (JSONL read lazily, line by line)."""
    n_docs = n_bytes = 0
    for f in inputs if inputs is not None else list_inputs(sources):
        if _is_jsonl(f.path):
            docs = _iter_jsonl(f.path, f.key, f.src, f.meta)
        else:
            docs = iter([Doc(key=f.key, path=f.path, meta={**f.meta, "path": f.rel})])
        for d in docs:
            yield d
            n_docs += 1
            n_bytes += len(d.text.encode("utf-8", errors="surrogatepass")) if d.text is not None else f.size
            if (max_docs and n_docs >= max_docs) or (max_bytes and n_bytes >= max_bytes):
                return


def _iter_jsonl(path: str, key: str, src: Source, base_meta: dict) -> Iterator[Doc]:
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n}: not UTF-8 ({e.reason} at byte {e.start})") from None
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not a JSON object ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(src.text_key), str):
                raise DataError(f"{path}:{n}: no string field {src.text_key!r} (set --text-key)")
            meta = {**base_meta, "path": f"{os.path.basename(path)}:{n}"}
            meta.update({k: obj[k] for k in src.meta_keys if k in obj})
            yield Doc(key=f"{key}:{n}", path=path, text=obj[src.text_key], meta=meta)


# --------------------------------------------------------------------------- workers
_TOK = None


def _init_worker(tok_cfg: dict):
    global _TOK
    _TOK = load_tokenizer(TokenizerConfig(**tok_cfg))


def _tokenize(doc: Doc):
    """-> (tokens uint32 array | None, error message | None, n_bytes)."""
    text = doc.text
    if text is None:
        try:
            raw = Path(doc.path).read_bytes()
        except OSError as e:
            return None, f"{doc.path}: cannot read ({e.strerror})", 0
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, f"{doc.path}: not UTF-8 ({e.reason} at byte {e.start})", len(raw)
    if text.startswith("\ufeff"):
        text = text[1:]
    assert _TOK is not None, "_init_worker sets the tokenizer first"
    ids = _TOK.encode(text)
    return np.asarray(ids, dtype=np.uint32), None, len(text.encode("utf-8", errors="surrogatepass"))


def tokenize_stream(
    docs: Iterable[Doc], tok_cfg: TokenizerConfig, workers: int, chunksize: int = 4, block: int = 512
) -> Iterator[tuple[Doc, np.ndarray, Optional[str], int]]:
    """(doc, tokens, error, n_bytes) in input order, tokenized by `workers` processes.

    Documents are taken `block` at a time, so a large JSONL never sits in memory whole."""
    cfg = tok_cfg.model_dump()
    if workers <= 1:
        _init_worker(cfg)
        for d in docs:
            yield (d, *_tokenize(d))
        return
    it = iter(docs)
    ctx = mp.get_context("fork")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(cfg,)) as pool:
        while True:
            chunk = list(itertools.islice(it, block))
            if not chunk:
                return
            for d, r in zip(chunk, pool.imap(_tokenize, chunk, chunksize=chunksize), strict=True):
                yield (d, *r)


def build_dataset(
    sources: list[Source],
    tok_cfg: TokenizerConfig,
    out,
    *,
    edges=DEFAULT_EDGES,
    val_fraction: float = 0.01,
    split_seed: int = 0,
    workers: Optional[int] = None,
    max_docs: Optional[int] = None,
    max_bytes: Optional[int] = None,
    skip_bad_utf8: bool = False,
    min_tokens: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
    extra_manifest: Optional[dict] = None,
) -> dict:
    """Build the dataset at `out`; returns its manifest. Nothing is left at `out` on error."""
    from tqdm import tqdm

    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction} must be in [0, 1)")
    tok = load_tokenizer(tok_cfg)
    inputs = list_inputs(sources)
    total = sum(f.size for f in inputs)
    if max_bytes:
        total = min(total, max_bytes)
    workers = workers or max(1, min(os.cpu_count() or 1, 8))
    if len(inputs) < 4 * workers and not any(_is_jsonl(f.path) for f in inputs):
        workers = max(1, len(inputs) // 4)  # a handful of files: process start-up would dominate
    tok_info = {
        "identity": tok.identity,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "config": tok_cfg.model_dump(exclude_none=True),
    }
    split_info = {
        "val_fraction": val_fraction,
        "seed": split_seed,
        "rule": "val iff sha256(f'{seed}:{key}')[:8] / 2**64 < val_fraction; key = <source>/<path>[:line]",
    }
    skipped_utf8, skipped_short, n_bytes = [], 0, 0
    log.info(
        "tokenizing %d input file(s), %.1f MB, with %s on %d worker(s)", len(inputs), total / 1e6, tok.identity, workers
    )
    n_docs = 0
    with DatasetWriter(
        Path(out),
        tok_info,
        edges=edges,
        split_info=split_info,
        shard_tokens=shard_tokens,
        overwrite=overwrite,
        inputs=[s.path for s in sources],
    ) as w:
        bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            file=sys.stderr,
            disable=not progress,
            mininterval=1.0,
            desc="tokenize",
        )
        docs = iter_documents(sources, max_docs=max_docs, max_bytes=max_bytes, inputs=inputs)
        for d, ids, err, nb in tokenize_stream(docs, tok_cfg, workers):
            bar.update(nb)
            n_bytes += nb
            n_docs += 1
            if err is not None:
                if skip_bad_utf8 and "not UTF-8" in err:
                    skipped_utf8.append(err)
                    continue
                raise DataError(err + ("; pass --skip-bad-utf8 to skip such files" if "not UTF-8" in err else ""))
            if len(ids) < min_tokens:
                skipped_short += 1
                continue
            meta = dict(d.meta)
            meta["key"] = d.key
            meta["n_tokens"] = int(len(ids))
            w.add(ids, split_of(d.key, val_fraction, split_seed), meta)
        bar.close()
        if n_docs == 0:
            raise DataError(f"no documents in {[s.path for s in sources]}")
        for e in skipped_utf8:
            log.warning("skipped %s", e)
        extra = {
            "build": {
                "inputs": [s.path for s in sources],
                "documents_seen": n_docs,
                "skipped_not_utf8": len(skipped_utf8),
                "skipped_short": skipped_short,
                "text_bytes": n_bytes,
                "min_tokens": min_tokens,
            }
        }
        extra.update(extra_manifest or {})
        return w.finish(extra)


def stats_table(manifest: dict) -> str:
    """Documents and tokens per bucket and split, as a Markdown table."""
    rows = [
        "| bucket | doc tokens | train docs | train tokens | val docs | val tokens |",
        "|---|---|---:|---:|---:|---:|",
    ]
    tot = {"train": [0, 0], "val": [0, 0]}

    def k(n):
        return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)

    for b in manifest["buckets"]:
        c = manifest["counts"].get(b["name"], {})
        rng = f"{k(b['lo'])}-{k(b['hi'])}" if b["hi"] is not None else f">= {k(b['lo'])}"
        cells = []
        for s in ("train", "val"):
            d = c.get(s, {"documents": 0, "tokens": 0})
            tot[s][0] += d["documents"]
            tot[s][1] += d["tokens"]
            cells += [f"{d['documents']:,}", f"{d['tokens']:,}"]
        rows.append(f"| {b['name']} | {rng} | " + " | ".join(cells) + " |")
    rows.append(f"| all | | {tot['train'][0]:,} | {tot['train'][1]:,} | {tot['val'][0]:,} | {tot['val'][1]:,} |")
    return "\n".join(rows)
