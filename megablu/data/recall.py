"""Synthetic recall documents: real text with facts inserted, asked for again at the end.

A small model pretrained for minutes on code and manuals rarely learns to copy a number it
saw 1,000 tokens earlier, and without that skill a passkey evaluation of its long-context
extension measures nothing. These documents teach the skill directly: a span of the corpus's
own *train* text (never val: the needle eval's haystack is val text), 1-4 facts
("the locker code is 48213", `ORDER_ID = 48213`, ...) inserted at random line breaks, then a
question about one of them followed by its answer.

The eval's wording never appears: no "pass key", no "magic number", no "grass is green"
filler. Whether retrieval learnt on these templates transfers to the eval's prompts, and
to 4x longer contexts after a YaRN extension, is what the evaluation then measures.
Deterministic: document i depends only on (seed, i) and the train texts.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Optional

from .build import Source, list_inputs, split_of
from .shards import DataError

THINGS = (
    "locker",
    "invoice",
    "order",
    "ticket",
    "room",
    "account",
    "vault",
    "parcel",
    "batch",
    "station",
    "project",
    "license",
    "badge",
    "flight",
    "table",
    "cabinet",
    "server",
    "printer",
    "bridge",
    "garden",
)
KINDS = ("number", "code", "id", "pin", "reference")
LABELS = tuple(f"{t} {k}" for t in THINGS for k in KINDS)  # 100 labels, none of them the eval's

# (fact, question + answer) per style; {label}, {name} (LABEL_AS_IDENTIFIER), {value}
STYLES = {
    "prose": (
        (
            "The {label} is {value}.",
            "Note that the {label} is {value}.",
            "Please keep in mind: the {label} is {value}.",
        ),
        "\n\nQuestion: What is the {label}?\nAnswer: The {label} is {value}.\n",
    ),
    "code": (("{name} = {value}", "{name} = {value}  # keep this"), "\n\n>>> print({name})\n{value}\n"),
    "record": (("{label}: {value}", "[{label}] {value}"), "\n\nLookup {label}: {value}\n"),
}


def _rng(seed: int, *parts) -> random.Random:
    h = hashlib.sha256(repr((seed,) + parts).encode()).digest()
    return random.Random(int.from_bytes(h[:8], "little"))


def train_texts(sources: list[Source], val_fraction: float, split_seed: int = 0) -> list[str]:
    """The UTF-8 texts of the sources' train documents, split exactly as `build_dataset` splits."""
    texts = []
    for f in list_inputs(sources):
        if split_of(f.key, val_fraction, split_seed) != "train":
            continue
        try:
            t = Path(f.path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if t.strip():
            texts.append(t)
    if not texts:
        raise DataError("recall: no train text to draw filler from")
    return texts


def recall_document(texts: list[str], seed: int, index: int, min_chars: int = 400, max_chars: int = 4000) -> dict:
    """One document: {"text", "style", "n_facts", "asked"}."""
    rng = _rng(seed, "recall", index)
    want = rng.randint(min_chars, max_chars)
    # filler: a line-aligned span of one train text, continued by others when it is short
    parts, have = [], 0
    while have < want:
        t = texts[rng.randrange(len(texts))]
        start = rng.randrange(len(t))
        start = t.rfind("\n", 0, start) + 1
        piece = t[start : start + want - have]
        parts.append(piece)
        have += len(piece) + 2
    lines = "\n\n".join(parts).split("\n")
    style = rng.choice(sorted(STYLES))
    facts, question = STYLES[style]
    n_facts = rng.randint(1, 4)
    labels = rng.sample(LABELS, n_facts)
    values = [str(rng.randint(10 ** (d - 1), 10**d - 1)) for d in (rng.randint(3, 8) for _ in labels)]
    # insertion points: distinct line breaks, facts in random order along the text
    at = sorted(rng.sample(range(len(lines) + 1), min(n_facts, len(lines) + 1)))
    for j, pos in reversed(list(enumerate(at))):
        lab = labels[j]
        fact = rng.choice(facts).format(label=lab, name=lab.upper().replace(" ", "_"), value=values[j])
        lines.insert(pos, fact)
    q = rng.randrange(len(at))
    text = "\n".join(lines).rstrip() + question.format(
        label=labels[q], name=labels[q].upper().replace(" ", "_"), value=values[q]
    )
    return {"text": text, "style": style, "n_facts": len(at), "asked": labels[q]}


def write_recall_jsonl(
    sources: list[Source],
    out_dir,
    *,
    val_fraction: float,
    split_seed: int = 0,
    n_docs: int = 3000,
    seed: int = 0,
    min_chars: int = 400,
    max_chars: int = 4000,
) -> Path:
    """out_dir/recall-<hash>.jsonl (cached: the name hashes every input that shapes it)."""
    inputs = [(f.key, f.size) for f in list_inputs(sources)]
    tag = hashlib.sha256(
        json.dumps([inputs, val_fraction, split_seed, n_docs, seed, min_chars, max_chars, STYLES, LABELS]).encode()
    ).hexdigest()[:12]
    out = Path(out_dir) / f"recall-{tag}.jsonl"
    if out.is_file():
        return out
    texts = train_texts(sources, val_fraction, split_seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(n_docs):
            f.write(json.dumps(recall_document(texts, seed, i, min_chars, max_chars)) + "\n")
    os.replace(tmp, out)
    return out


def recall_source(
    sources: list[Source], work, val_fraction: float, split_seed: int = 0, n_docs: Optional[int] = None
) -> Source:
    path = write_recall_jsonl(
        sources, Path(work) / "recall", val_fraction=val_fraction, split_seed=split_seed, n_docs=n_docs or 3000
    )
    return Source(
        str(path),
        name="recall",
        license="derived from the other parts' train documents (their licences apply)",
        provenance="megablu.data.recall: train-text spans with inserted facts and a question at the end",
        meta_keys=["style", "n_facts", "asked"],
    )
