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


def train_bpe(sources: list[Source], out, vocab_size: int = 4096, max_bytes: Optional[int] = 64 << 20,
              skip_bad_utf8: bool = False, pattern: str = DEFAULT_PATTERN) -> Path:
    try:
        import rustbpe
    except ImportError:
        raise DataError("train-tokenizer needs rustbpe: `pip install rustbpe==0.1.0`") from None
    if vocab_size < 258:
        raise DataError(f"--vocab-size {vocab_size} must be >= 258 (256 bytes + 1 merge + EOT)")
    out = Path(out)
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
                    raise DataError(f"{d.path}: not UTF-8 ({e.reason} at byte {e.start}); pass --skip-bad-utf8")
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
        log.warning("the text allows only %d merges: vocab_size is %d, not %d", len(ranks) - 256, len(ranks) + 1,
                    vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    tmp.write_text("".join(f"{base64.b64encode(b).decode()} {r}\n" for b, r in ranks))
    side = out.with_name(out.name + ".json")
    meta = {"pattern": pattern, "eot": EOT_TEXT, "vocab_size": len(ranks) + 1, "trainer": "rustbpe 0.1.0",
            "trained_on": [{"path": s.path, "include": s.include, "exclude": s.exclude} for s in sources],
            "documents": seen["docs"], "chars": seen["bytes"],
            "skipped_not_utf8": seen["skipped"]}
    stmp = side.with_name(side.name + f".{os.getpid()}.tmp")
    stmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(stmp, side)
    os.replace(tmp, out)
    log.info("trained %d-token BPE on %d documents (%d chars) -> %s", len(ranks) + 1, seen["docs"], seen["bytes"], out)
    return out
