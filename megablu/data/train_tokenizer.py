"""`megablu data train-tokenizer`: a small byte-level BPE for tiny models, as a tiktoken rank file.

rustbpe (MIT, the trainer nanochat uses) learns the merges; the result is a tiktoken rank
file (`base64(token) rank` per line) plus a sidecar `<file>.json` holding the pre-tokenizer
pattern and the EOT text, loaded by tokenizer.kind=tiktoken_file. vocab_size counts EOT:
ranks 0..vocab_size-2, EOT = vocab_size-1, so a model's embedding needs exactly vocab_size.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from pathlib import Path
from typing import Optional

from .build import Source, iter_documents
from .shards import DataError
from .tokenizer import DEFAULT_PATTERN, EOT_TEXT

log = logging.getLogger(__name__)


def _is_megablu_ranks(out: Path) -> bool:
    """out and its .json sidecar are a rank file this command wrote (the sidecar's trainer record)."""
    try:
        meta = json.loads(out.with_name(out.name + ".json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and {"pattern", "trainer", "trained_on"} <= set(meta) and out.is_file()


def check_rank_out(out: Path, overwrite: bool, inputs) -> None:
    """DataError unless the rank file may be written at out: never over or inside an input, never over a
    file this command did not write; over one it wrote only with --overwrite."""
    side = out.with_name(out.name + ".json")
    ro = out.resolve()
    for i in inputs:
        ri = Path(i).resolve()
        if ro == ri or ri in ro.parents or side.resolve() == ri:
            raise DataError(
                f"--out {out} is or lies inside the input {i}: the rank file would become training "
                f"text; give --out a path outside the input"
            )
    taken = [p for p in (out, side) if p.exists() or p.is_symlink()]
    if not taken:
        return
    if not _is_megablu_ranks(out):
        raise DataError(
            f"--out {out}: {', '.join(map(str, taken))} exist(s) and are not a rank file megablu "
            f"trained; give --out a new path"
        )
    if not overwrite:
        raise DataError(
            f"--out {out} is a rank file megablu trained; pass --overwrite to replace it and its "
            f"sidecar (datasets built with it name its identity and refuse the new one)"
        )


def train_bpe(
    sources: list[Source],
    out,
    vocab_size: int = 4096,
    max_bytes: Optional[int] = 64 << 20,
    skip_bad_utf8: bool = False,
    pattern: str = DEFAULT_PATTERN,
    overwrite: bool = False,
) -> Path:
    try:
        import rustbpe
    except ImportError:
        raise DataError("train-tokenizer needs rustbpe: `pip install rustbpe==0.1.0`") from None
    if vocab_size < 258:
        raise DataError(f"--vocab-size {vocab_size} must be >= 258 (256 bytes + 1 merge + EOT)")
    out = Path(out)
    check_rank_out(out, overwrite, [s.path for s in sources])
    seen = {"docs": 0, "bytes": 0, "skipped": 0}

    def texts():
        for d in iter_documents(sources, max_bytes=max_bytes):
            if d.text is not None:
                t = d.text
            else:
                raw = Path(d.path).read_bytes()
                try:
                    t = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    if skip_bad_utf8:
                        seen["skipped"] += 1
                        continue
                    raise DataError(f"{d.path}: not UTF-8 ({e.reason} at byte {e.start}); pass --skip-bad-utf8") from e
            seen["docs"] += 1
            seen["bytes"] += len(t)
            yield t

    logging.getLogger("rustbpe").setLevel(logging.WARNING)  # it logs every 1% of merges
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(texts(), vocab_size - 1, pattern=pattern)
    ranks = sorted(tok.get_mergeable_ranks(), key=lambda x: x[1])
    if [r for _, r in ranks] != list(range(len(ranks))):
        raise DataError("rustbpe returned non-contiguous ranks")
    if len(ranks) + 1 < vocab_size:
        log.warning(
            "the text allows only %d merges: vocab_size is %d, not %d", len(ranks) - 256, len(ranks) + 1, vocab_size
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    tmp.write_text("".join(f"{base64.b64encode(b).decode()} {r}\n" for b, r in ranks))
    side = out.with_name(out.name + ".json")
    meta = {
        "pattern": pattern,
        "eot": EOT_TEXT,
        "vocab_size": len(ranks) + 1,
        "trainer": "rustbpe 0.1.0",
        "trained_on": [{"path": s.path, "include": s.include, "exclude": s.exclude} for s in sources],
        "documents": seen["docs"],
        "chars": seen["bytes"],
        "skipped_not_utf8": seen["skipped"],
    }
    stmp = side.with_name(side.name + f".{os.getpid()}.tmp")
    stmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(stmp, side)
    os.replace(tmp, out)
    log.info("trained %d-token BPE on %d documents (%d chars) -> %s", len(ranks) + 1, seen["docs"], seen["bytes"], out)
    return out
