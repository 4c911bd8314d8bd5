"""`megablu data import`: flat token shards (the cp_data_by_length format) -> megablu shards.

Those files (e.g. `cp_data_by_length/b3_16384_32768/train_shard_00000.bin`) are a flat
little-endian uint16 or uint32 token stream with an end-of-text id between documents and
no header. Import splits the stream at EOT into documents (empty ones dropped), re-buckets
them by length and writes a dataset with a manifest, so verify / loader / haystack work on it.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .shards import DEFAULT_EDGES, DEFAULT_SHARD_TOKENS, DataError, DatasetWriter
from .tokenizer import load_tokenizer, parse_tokenizer_spec

log = logging.getLogger(__name__)
_BLOCK = 1 << 26  # tokens scanned at a time


def _split_from_name(p: Path) -> str:
    n = p.name.lower()
    if n.startswith("val"):
        return "val"
    if n.startswith("train"):
        return "train"
    raise DataError(f"{p}: cannot tell train from val by its name (train_* / val_*); pass --split train|val")


def _tokenizer_info(
    tokenizer: Optional[str], identity: Optional[str], vocab_size: Optional[int], eot: int
) -> dict[str, Any]:
    """The manifest's tokenizer record: from --tokenizer, or --identity with --vocab-size."""
    if tokenizer:
        tok = load_tokenizer(parse_tokenizer_spec(tokenizer))
        if identity and identity != tok.identity:
            raise DataError(f"--identity {identity!r} contradicts --tokenizer {tokenizer} ({tok.identity})")
        if eot != tok.eot_id:
            raise DataError(f"--eot {eot} but tokenizer {tok.identity} has eot_id {tok.eot_id}")
        info: dict[str, Any] = {"identity": tok.identity, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}
    elif identity and vocab_size:
        info = {"identity": identity, "vocab_size": int(vocab_size), "eot_id": int(eot)}
    else:
        raise DataError("import needs --tokenizer, or --identity with --vocab-size, to record the data's tokenizer")
    if not 0 <= eot < info["vocab_size"]:
        raise DataError(f"--eot {eot} is outside the vocab (size {info['vocab_size']})")
    return info


def _check_tokens(p: Path, toks: np.ndarray, dtype: str, vocab_size: int) -> None:
    """A file's tokens fit the vocab and do not look like another dtype (DataError naming the fix)."""
    if len(toks) == 0:
        raise DataError(f"{p}: empty file")
    mx = max(int(toks[i : i + _BLOCK].max()) for i in range(0, len(toks), _BLOCK))
    if mx >= vocab_size:
        raise DataError(f"{p}: token id {mx} >= vocab size {vocab_size}: wrong --dtype ({dtype}) or wrong tokenizer")
    if toks.dtype.itemsize == 2 and len(toks) >= 64:
        head = np.asarray(toks[: min(len(toks), 1 << 20) // 2 * 2]).reshape(-1, 2)
        if (head[:, 1] == 0).mean() > 0.9 and (head[:, 0] == 0).mean() < 0.5:
            raise DataError(f"{p}: every second uint16 is 0, so the file looks like uint32 tokens; pass --dtype uint32")


def import_flat(
    inputs: list[str],
    out,
    *,
    dtype: str,
    eot: int,
    tokenizer: Optional[str] = None,
    identity: Optional[str] = None,
    vocab_size: Optional[int] = None,
    split: str = "auto",
    edges=DEFAULT_EDGES,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    license: str = "unknown",
    provenance: Optional[str] = None,
) -> dict:
    """Import flat token files; returns the manifest. Nothing is left at `out` on error."""
    info = _tokenizer_info(tokenizer, identity, vocab_size, eot)
    dt = np.dtype(dtype).newbyteorder("<")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise DataError(f"input {p} does not exist")
        if p.stat().st_size % dt.itemsize:
            raise DataError(
                f"{p}: {p.stat().st_size} bytes is not a whole number of {dtype} tokens (truncated, or not {dtype})"
            )
    info["imported"] = {"dtype": dtype, "eot": int(eot)}
    with DatasetWriter(
        Path(out),
        info,
        edges=edges,
        split_info={"rule": "from the imported file names/--split"},
        shard_tokens=shard_tokens,
        overwrite=overwrite,
        inputs=paths,
    ) as w:
        for p in paths:
            sp = _split_from_name(p) if split == "auto" else split
            toks = np.memmap(p, dtype=dt, mode="r")
            _check_tokens(p, toks, dtype, info["vocab_size"])
            # EOT positions, found block by block (a 1 GB shard never becomes a 1 GB bool array)
            cuts = np.concatenate([np.nonzero(toks[i : i + _BLOCK] == eot)[0] + i for i in range(0, len(toks), _BLOCK)])
            if len(cuts) == 0 and len(toks) > 1 << 20:
                raise DataError(f"{p}: no EOT id {eot} in {len(toks):,} tokens: wrong --eot or --dtype")
            bounds = np.concatenate([[-1], cuts, [len(toks)]])
            n = 0
            for a, b in itertools.pairwise(bounds):
                if b - a <= 1:
                    continue
                w.add(
                    np.asarray(toks[a + 1 : b]),
                    sp,
                    {
                        "source": p.name,
                        "license": license,
                        "provenance": provenance or str(p.resolve()),
                        "path": f"{p.name}@{a + 1}",
                    },
                )
                n += 1
            log.info("%s: %d documents, %d tokens -> split %s", p, n, len(toks) - len(cuts), sp)
        return w.finish({"build": {"imported_from": [str(p) for p in paths]}})
