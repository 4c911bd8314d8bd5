"""`megablu data synth`: synthetic key-value retrieval documents of exact token lengths.

After "From artificial needles to real haystacks" (Xiong et al. 2024, arXiv 2406.19292): a
model fine-tuned on retrieving the value of a key from a long list of key-value pairs gets
better at long-context retrieval in real text. Every token of a training document is LM
loss, so the question and its answer close each document: the model is trained to
predict the answer tokens after reading the whole context.

A document (exactly `length` tokens in the target tokenizer, no EOT: the loader adds those):

    <header>                          filler kv only: the template's first line(s)
    <record> ... <record>             filler kv: distractor records, the asked one(s) at
                                      uniformly random depths; filler text: real TRAIN text
                                      with the asked and 0-6 distractor records inserted at
                                      uniformly random depths (snapped to a line end);
                                      filler repeat: 1-4 generated lines repeated, the
                                      records inserted the same way
    <footer>                          filler kv only
    <question><answer>                task kv: one key asked; multikv: 2-4 keys, values in order
    <question><answer> ...            task manyq: one asked key per `query_every` tokens (2-64), each
                                      its own question line answered at once, in shuffled order

`manyq` is the dense form: a `kv` document carries one retrieval answer (a few tokens of
the document's loss); a 32k `manyq` document at query_every=512 carries 64, each from a
uniformly random depth, so the same training tokens hold ~50x the retrieval signal.

Distances (--distances LO-HI, --distance-share S): uniform depths make every distance between
an asked record and the questions equally likely, so a band a model fails at (say 10-14k
tokens back, at 16k and 32k alike) is a small share of the answers. With --distances, each
asked record is, with probability S, placed so that its distance (tokens from its start to the
end of the context, where the questions begin) is uniform in [LO, HI] (HI clipped to the
document); the others keep uniform depths. The placement is exact to one record (kv filler)
or to the line-end snap (text filler); meta "distances" records what each document got.
Without --distances the documents' token ids are those of earlier versions, bit for bit.

Keys and values are numbers, UUID-like strings or three-word names (--key-types,
--value-types), unique within a document; templates (TEMPLATES) vary the record and question
wording. The text is composed in token space (each segment encoded once, the ids
concatenated, segments meeting at a newline), so the length is exact for any tokenizer; the
list of records ends in a cut record (a prefix of one more distractor) when the records
alone cannot meet the length exactly.

Filler text comes from a dataset's TRAIN split only: the eval's needle haystack is a val
split. The wording shares no word 6-gram with the eval harness's prompts
(tests/data/test_data_synth.py builds every eval task's prompts and checks). Document i
depends only on (seed, i, the options, the filler dataset): reproducible, and a larger
--docs extends a smaller set.

Profiles: everything above is the default profile, `kv`. `--profile disjoint` (synth_disjoint.py)
keeps the retrieval signal and drops every shape the eval uses (number/UUID keys, completion
questions of the eval's kind, repeated filler, key-value-list haystacks): structured records in
real train text, asked in their own formats' words. `--filler-exclude FILE` keeps filler documents
that share a word 8-gram with FILE (the eval's essay haystack) out of either profile's text filler.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..config.schema import TokenizerConfig
from .build import split_of
from .shards import DEFAULT_EDGES, DataError, DatasetWriter, DocTable, read_manifest, select_shards, verify_shard
from .tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

TASKS = ("kv", "multikv", "manyq")
MAX_QUERIES = 64  # manyq: questions per document at most
KEY_TYPES = ("numbers", "uuid", "words")
FILLERS = ("kv", "text", "repeat")
# filler `repeat`: a few generated lines, repeated to length (the regime of a repeated-filler haystack: the one
# unusual line must be found among thousands of identical ones); words from the lists below, no eval wording
_SENTENCES = (
    "A {w1} ledge runs under the {w3} hedge.",
    "The {w2} nests where the {w3} roots split the {w1}.",
    "Rain darkens the {w1} wall by the {w3} row.",
    "At dusk a {w2} calls twice from the {w3} stand.",
    "Old maps show {w1} beds east of the {w3} copse.",
    "Each spring the {w2} returns to the {w1} cliff.",
    "Moss covers the {w1} steps past the {w3} gate.",
    "The {w3} bark is pale where the {w2} perches.",
)
GENERATED_LICENSE = "generated by megablu data synth (no third-party text)"


@dataclass(frozen=True)
class Template:
    """One wording. {k}/{v}: a key/value; {ks}/{vs}: the asked keys/values, each quoted by `quote`."""

    name: str
    header: str  # first line(s) of a kv-filler document ('' for none)
    record: str  # one record, one line
    footer: str  # closes a kv-filler list ('' for none)
    ask_one: str  # question for one key, then answer_one
    answer_one: str
    ask_many: str
    answer_many: str
    quote: str = ""


TEMPLATES = (
    Template(
        "json",
        "inventory = [",
        '  {{"code": "{k}", "slot": "{v}"}},',
        "]",
        'Looking up code "{k}" in the inventory gives slot',
        ' "{v}".',
        "Looking up codes {ks} in the inventory gives slots",
        " {vs}.",
        quote='"',
    ),
    Template(
        "colon",
        "# registry dump, one entry per line as key: value",
        "{k}: {v}",
        "# end of dump",
        "# lookup {k}",
        "\n{k}: {v}",
        "# lookup {ks}, in this order",
        "\n{vs}",
    ),
    Template(
        "table",
        "| label | content |\n|---|---|",
        "| {k} | {v} |",
        "",
        "Row lookup: the content cell next to label {k} holds",
        " {v}.",
        "Row lookup: the content cells next to labels {ks} hold",
        " {vs}, in that order.",
    ),
    Template(
        "prose",
        "Field notes. Each line pairs an entry with its tag.",
        "Entry {k} carries the tag {v}.",
        "",
        "Recall check: entry {k} carries the tag",
        " {v}.",
        "Recall check: entries {ks} carry the tags",
        " {vs}, in that order.",
    ),
    Template(
        "python",
        "lookup = {}",
        'lookup["{k}"] = "{v}"',
        "",
        '>>> lookup["{k}"]',
        "\n'{v}'",
        ">>> [lookup[x] for x in ({ks})]",
        "\n[{vs}]",
        quote="'",
    ),
)
TEMPLATE_NAMES = tuple(t.name for t in TEMPLATES)

# three-word names: minerals, birds, trees (none of them the eval's adjective-noun keys)
_W1 = (
    "basalt",
    "cobalt",
    "garnet",
    "gypsum",
    "jasper",
    "marble",
    "onyx",
    "pumice",
    "quartz",
    "shale",
    "slate",
    "topaz",
    "zircon",
    "agate",
    "beryl",
    "flint",
    "mica",
    "opal",
    "pyrite",
    "talc",
    "chert",
    "galena",
    "jade",
    "ochre",
)
_W2 = (
    "heron",
    "finch",
    "plover",
    "egret",
    "wren",
    "osprey",
    "lark",
    "kestrel",
    "magpie",
    "puffin",
    "starling",
    "swift",
    "tern",
    "thrush",
    "curlew",
    "ibis",
    "linnet",
    "merlin",
    "oriole",
    "petrel",
    "rook",
    "snipe",
    "stork",
    "warbler",
)
_W3 = (
    "alder",
    "aspen",
    "birch",
    "cedar",
    "elm",
    "hazel",
    "larch",
    "maple",
    "rowan",
    "spruce",
    "willow",
    "yew",
    "juniper",
    "poplar",
    "sumac",
    "linden",
    "hawthorn",
    "holly",
    "laurel",
    "myrtle",
    "olive",
    "sequoia",
    "tamarack",
    "walnut",
)


# --------------------------------------------------------------------------- keys and values
class _Pool:
    """Unique items of one type for one document (keys and values draw from one pool per type).

    `protected` (shared by a document's pools) holds the asked keys and values: no later item may
    contain one or be contained in one, so an asked key occurs once in the context (a 5-digit key
    inside a distractor's 9-digit value would make the question ambiguous)."""

    def __init__(self, kind: str, rng: np.random.Generator, protected: list):
        self.kind, self.rng, self.seen, self.protected = kind, rng, set[str](), protected
        self.key_digits = int(rng.integers(5, 9))  # number keys: one length per document (no key is
        #                                                 a prefix of another)

    def _one(self, role: str) -> str:
        r = self.rng
        if self.kind == "numbers":
            d = self.key_digits if role == "key" else int(r.integers(4, 10))
            return str(int(r.integers(10 ** (d - 1), 10**d)))
        if self.kind == "uuid":
            h = r.bytes(16).hex()
            return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        return f"{_W1[r.integers(len(_W1))]}-{_W2[r.integers(len(_W2))]}-{_W3[r.integers(len(_W3))]}"

    def draw(self, role: str) -> str:
        for _ in range(1000):
            x = self._one(role)
            if x not in self.seen and not any(p in x or x in p for p in self.protected):
                self.seen.add(x)
                return x
        raise DataError(
            f"synth: ran out of distinct {self.kind} items ({len(self.seen):,} used in one document); "
            f"use shorter documents or another key/value type for them"
        )


# --------------------------------------------------------------------------- filler text
class TrainText:
    """Real text of a dataset's TRAIN split, in the target tokenizer's ids, with per-document licences."""

    def __init__(self, path, tokenizer: Tokenizer, bucket: str = "all", exclude: Optional[str] = None):
        root = Path(path)
        m = read_manifest(root)
        if m["tokenizer"]["identity"] != tokenizer.identity:
            raise DataError(
                f"--filler-data {root}: tokenized with {m['tokenizer']['identity']!r}, the synthetic set's "
                f"tokenizer is {tokenizer.identity!r}; build the filler dataset with the same tokenizer"
            )
        shards = select_shards(m, bucket, "train", root)
        errs = [e for s in shards for e in verify_shard(root, s, m["dtype"], check_hash=False)]
        if errs:
            raise DataError(f"--filler-data {root} failed verification:\n  " + "\n  ".join(errs))
        self.table = DocTable.open(root, shards, m["dtype"])
        if len(self.table) == 0:
            raise DataError(f"--filler-data {root}: bucket {bucket!r} has no train documents")
        self.root, self.bucket = root, bucket
        self.meta: list[dict] = []
        for s in shards:
            lines = (root / s["meta"]).read_text(encoding="utf-8").splitlines() if s.get("meta") else []
            got = [json.loads(x) for x in lines] or [{}] * int(s["documents"])
            self.meta += [
                {"source": g.get("source", "unknown"), "license": g.get("license", "unknown"), "key": g.get("key")}
                for g in got
            ]
        self.identity = hashlib.sha256(json.dumps([s["sha256"] for s in shards], sort_keys=True).encode()).hexdigest()[
            :16
        ]
        self.sep = tokenizer.encode("\n\n")
        # exclude: a text (the eval's essay haystack, say) no filler document may share a word 8-gram with
        self.tok, self.exclude = tokenizer, exclude
        self.excluded: dict = {}
        self._banned = _word_grams(_read_text(exclude)) if exclude else set()
        if exclude and not self._banned:
            raise DataError(
                f"--filler-exclude {exclude}: no run of {EXCLUDE_N} words in it; give the text whose "
                f"passages the filler must not contain"
            )

    def _allowed(self, d: int) -> bool:
        if not self._banned:
            return True
        got = self.excluded.get(d)
        if got is None:
            text = self.tok.decode(self.table.doc(d).tolist())
            got = self.excluded[d] = not self._banned.isdisjoint(_word_grams(text))
        return not got

    def span(self, rng: np.random.Generator, n: int, line_end) -> tuple[list[int], list[int]]:
        """Exactly n ids: a line-aligned span of a random train document, continued by other documents
        (joined by a blank line); and the documents used."""
        out: list[int] = []
        used: list[int] = []
        while len(out) < n:
            if out:
                out += self.sep[: n - len(out)]
            d = int(rng.integers(len(self.table)))
            for _ in range(10_000):  # a filler document sharing a passage with --filler-exclude: another one
                if self._allowed(d):
                    break
                d = int(rng.integers(len(self.table)))
            else:
                raise DataError(
                    f"--filler-exclude {self.exclude}: 10,000 draws in a row from {self.root} share a "
                    f"{EXCLUDE_N}-word passage with it; use filler data without that text"
                )
            L = int(self.table.doc_len[d])
            start = 0
            if not used and L > 1:  # the first piece starts at a random line of its document
                s0 = int(rng.integers(L))
                head = self.table.doc(d, s0, min(L, s0 + 256)).tolist()
                start = next((s0 + j + 1 for j, t in enumerate(head) if line_end(t) and s0 + j + 1 < L), s0)
            used.append(d)
            out += self.table.doc(d, start, start + n - len(out)).tolist()
        return out[:n], used


EXCLUDE_N = 8  # --filler-exclude: a shared run of this many words excludes a filler document


def _word_grams(text: str, n: int = EXCLUDE_N) -> set:
    w = re.findall(r"\w+", text.lower())
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def _read_text(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--filler-exclude {path}: no such file (a text file, or .gz of one)")
    if p.suffix == ".gz":
        import gzip

        with gzip.open(p, "rt", encoding="utf-8") as f:
            return f.read()
    return p.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- documents
class _TooShort(Exception):
    def __init__(self, need: int):
        self.need = need


class _Ambiguous(Exception):
    """An asked key occurs more than once in the context (e.g. inside the filler text): draw again."""


@dataclass
class SynthSpec:
    lengths: list  # ints and (lo, hi) ranges, document i takes lengths[i % len(lengths)]
    tasks: tuple = TASKS
    templates: tuple = TEMPLATE_NAMES
    key_types: tuple = KEY_TYPES
    value_types: tuple = KEY_TYPES
    fillers: tuple = ("kv",)
    seed: int = 0
    query_every: int = 1024  # manyq: one question per this many document tokens (at least 2, at most MAX_QUERIES)
    distances: Optional[tuple] = None  # (lo, hi) tokens back from the questions, for a share of the asked keys
    distance_share: float = 1.0


class Synthesizer:
    def __init__(self, tokenizer: Tokenizer, spec: SynthSpec, text: Optional[TrainText] = None):
        bad = {
            "tasks": [t for t in spec.tasks if t not in TASKS],
            "templates": [t for t in spec.templates if t not in TEMPLATE_NAMES],
            "key types": [t for t in spec.key_types + spec.value_types if t not in KEY_TYPES],
            "fillers": [t for t in spec.fillers if t not in FILLERS],
        }
        for what, b in bad.items():
            if b:
                known = {"tasks": TASKS, "templates": TEMPLATE_NAMES, "key types": KEY_TYPES, "fillers": FILLERS}[what]
                raise DataError(f"synth: unknown {what} {b}; known: {list(known)}")
        if "text" in spec.fillers and text is None:
            raise DataError(
                "synth: filler 'text' needs --filler-data DIR (a dataset in the same tokenizer; its "
                "train split is the filler)"
            )
        if not spec.lengths:
            raise DataError("synth: no --lengths")
        if spec.query_every < 1:
            raise DataError(f"synth: --query-every {spec.query_every}: must be a positive number of tokens")
        if spec.distances is not None:
            lo, hi = spec.distances
            shortest = min(x[0] if isinstance(x, tuple) else x for x in spec.lengths)
            if not 0 < lo <= hi:
                raise DataError(f"synth: --distances {lo}-{hi}: need 0 < LO <= HI tokens")
            if lo >= shortest:
                raise DataError(
                    f"synth: --distances {lo}-{hi}: LO must be below the shortest document ({shortest} "
                    f"tokens of --lengths), or no record can sit that far back; lower LO or raise "
                    f"--lengths"
                )
        if spec.distances is None and spec.distance_share != 1.0:
            raise DataError(
                f"synth: --distance-share {spec.distance_share} without --distances: the share of asked "
                f"records placed in which band? Add --distances LO-HI (e.g. 10k-20k) or drop the share"
            )
        if not 0.0 <= spec.distance_share <= 1.0:
            raise DataError(f"synth: --distance-share {spec.distance_share}: a fraction in [0, 1]")
        self.tok, self.spec, self.text = tokenizer, spec, text
        self.templates = {t.name: t for t in TEMPLATES}
        self.nl = tokenizer.encode("\n")
        self._line_end: dict[int, bool] = {}

    def line_end(self, t: int) -> bool:
        got = self._line_end.get(t)
        if got is None:
            got = self._line_end[t] = self.tok.decode([t]).endswith("\n")
        return got

    def length_of(self, i: int) -> int:
        item = self.spec.lengths[i % len(self.spec.lengths)]
        if isinstance(item, tuple):
            return int(np.random.default_rng([self.spec.seed, i, 1]).integers(item[0], item[1] + 1))
        return int(item)

    def document(self, i: int) -> tuple[list[int], dict]:
        """(ids of exactly length_of(i) tokens, meta) of synthetic document i.

        A draw that does not fit the length (4 asked UUIDs in a 300-token document) is drawn again
        from the next seeded attempt, so short lengths see fewer of the bulky combinations."""
        length = self.length_of(i)
        short = []
        for attempt in range(32):
            try:
                return self._document(i, length, np.random.default_rng([self.spec.seed, i, attempt]))
            except _TooShort as e:
                short.append(e.need)
            except _Ambiguous:
                continue
        if not short:
            raise DataError(
                f"synth: document {i}: every draw left an asked key more than once in the context (the "
                f"filler text holds it?); use another --key-types or --filler"
            )
        raise DataError(
            f"synth: document {i} of {length} tokens: no draw of task/template/key type fits (the "
            f"smallest needed {min(short)} tokens); use longer --lengths or fewer bulky types (uuid)"
        )

    def _document(self, i: int, length: int, rng: np.random.Generator) -> tuple[list[int], dict]:
        sp = self.spec
        task = sp.tasks[int(rng.integers(len(sp.tasks)))]
        tpl = self.templates[sp.templates[int(rng.integers(len(sp.templates)))]]
        kt = sp.key_types[int(rng.integers(len(sp.key_types)))]
        vt = sp.value_types[int(rng.integers(len(sp.value_types)))]
        filler = sp.fillers[int(rng.integers(len(sp.fillers)))]
        protected: list[str] = []
        pools = {t: _Pool(t, rng, protected) for t in sorted({kt, vt})}

        def record(asked: bool = False) -> tuple[str, str, list[int]]:
            k, v = pools[kt].draw("key"), pools[vt].draw("value")
            if asked:
                protected.extend((k, v))
            return k, v, self.tok.encode(tpl.record.format(k=k, v=v) + "\n")

        if task == "manyq":
            n_ask = min(MAX_QUERIES, max(2, length // sp.query_every))
        else:
            n_ask = 1 if task == "kv" else int(rng.integers(2, 5))
        asked = [record(asked=True) for _ in range(n_ask)]
        q = tpl.quote
        if task == "manyq":  # one question per key, each answered at once; the order is the draw's, not the depths'
            qa = "\n".join(tpl.ask_one.format(k=a[0]) + tpl.answer_one.format(k=a[0], v=a[1]) for a in asked)
        elif n_ask == 1:
            qa = tpl.ask_one.format(k=asked[0][0]) + tpl.answer_one.format(k=asked[0][0], v=asked[0][1])
        else:
            ks = ", ".join(f"{q}{a[0]}{q}" for a in asked)
            vs = ("\n" if tpl.name == "colon" else ", ").join(
                tpl.record.format(k=a[0], v=a[1]) if tpl.name == "colon" else f"{q}{a[1]}{q}" for a in asked
            )
            qa = tpl.ask_many.format(ks=ks) + tpl.answer_many.format(vs=vs)
        qa_ids = self.tok.encode(qa + "\n")
        meta = {
            "task": task,
            "template": tpl.name,
            "key_type": kt,
            "value_type": vt,
            "filler": filler,
            "asked": [a[0] for a in asked],
            "answer": [a[1] for a in asked],
            "qa_tokens": len(qa_ids),
        }
        if filler == "kv":
            ids, extra = self._kv_body(rng, length, tpl, asked, qa_ids, record)
        else:
            ids, extra = self._text_body(rng, length, asked, qa_ids, record, repeat=filler == "repeat")
        meta.update(extra)
        assert len(ids) == length, (len(ids), length)
        ctx = self.tok.decode(ids[: len(ids) - len(qa_ids)])
        if any(ctx.count(a[0]) != 1 for a in asked):
            raise _Ambiguous()
        return ids, meta

    def _kv_body(self, rng, length, tpl, asked, qa_ids, record):
        head = self.tok.encode(tpl.header + "\n") if tpl.header else []
        foot = self.tok.encode(tpl.footer + "\n") if tpl.footer else []
        fixed = len(head) + len(foot) + len(qa_ids) + sum(len(a[2]) for a in asked)
        if fixed > length:
            raise _TooShort(fixed)
        budget, rows, cut = length - fixed, [], []
        while True:
            r = record()
            if len(r[2]) > budget:
                # the list cannot meet the length with whole records: a prefix of this one closes it
                if budget:
                    cut = r[2][: budget - len(self.nl)] + self.nl if budget >= len(self.nl) else r[2][:budget]
                break
            rows.append(r[2])
            budget -= len(r[2])
        if self.spec.distances is not None:
            at = self._place_far(rng, rows, asked, len(head), length - len(qa_ids))
        else:
            # the asked records at uniformly random places among the rows so far (distractors and the asked
            # ones placed before): each one's share of the context before it is uniform
            at = []
            for a in asked:
                p = int(rng.integers(0, len(rows) + 1))
                at = [x + (x >= p) for x in at] + [p]
                rows.insert(p, a[2])
        body = list(head)
        start = {}
        for r, row in enumerate(rows):
            start[r] = len(body)
            body += row
        body += cut + foot
        ctx = len(body)
        depths = [start[p] / max(1, ctx - len(a[2])) for p, a in zip(at, asked, strict=True)]
        return body + qa_ids, {
            "records": len(rows),
            "cut_tokens": len(cut),
            "depths": [round(d, 4) for d in depths],
            "distances": [ctx - start[p] for p in at],
        }

    def _targets(self, rng, asked, ctx: int) -> list[int]:
        """Per asked record, the distance it should end up at (tokens from its start to the context's end)."""
        assert self.spec.distances is not None  # _place_far runs only with --distances
        lo, hi = self.spec.distances
        out = []
        for a in asked:
            if rng.random() < self.spec.distance_share:
                top = max(lo, min(hi, ctx - len(a[2])))
                out.append(int(rng.integers(lo, top + 1)))
            else:  # uniform depth, as without --distances
                out.append(ctx - int(rng.random() * (ctx - len(a[2]) + 1)))
        return out

    def _place_far(self, rng, rows: list, asked, head: int, ctx: int) -> list[int]:
        """Insert the asked records among the distractor `rows` at their target distances (kv filler): each
        goes before the first row whose midpoint is at or past its target start (so it starts within half
        a row of it); returns their row indices."""
        want = sorted((ctx - d, j) for j, d in enumerate(self._targets(rng, asked, ctx)))
        out_rows: list = []
        at, pos, w = [0] * len(asked), head, 0
        for row in rows + [None]:
            while w < len(want) and (row is None or pos + len(row) // 2 >= want[w][0]):
                j = want[w][1]
                at[j] = len(out_rows)
                out_rows.append(asked[j][2])
                pos += len(asked[j][2])
                w += 1
            if row is not None:
                out_rows.append(row)
                pos += len(row)
        rows[:] = out_rows
        return at

    def _snap(self, stream: list[int], want: int, inside: list[tuple[int, int]]) -> int:
        """The insertion point nearest `want` right after a line end (within 64 tokens), else nearest `want`;
        never strictly inside an inserted record."""

        def ok(p):
            return 0 <= p <= len(stream) and not any(s < p < e for s, e in inside)

        for d in range(65):
            for p in (want - d, want + d):
                if ok(p) and (p == 0 or self.line_end(stream[p - 1])):
                    return p
        for d in range(len(stream) + 1):
            for p in (want - d, want + d):
                if ok(p):
                    return p
        return 0

    def _repeat_span(self, rng, n: int) -> list[int]:
        """Exactly n ids: 1-4 generated lines (one block), repeated; cut wherever n ends."""
        lines = []
        for _ in range(int(rng.integers(1, 5))):
            t = _SENTENCES[int(rng.integers(len(_SENTENCES)))]
            lines.append(
                t.format(
                    w1=_W1[int(rng.integers(len(_W1)))],
                    w2=_W2[int(rng.integers(len(_W2)))],
                    w3=_W3[int(rng.integers(len(_W3)))],
                )
            )
        block = self.tok.encode(" ".join(lines) + "\n")
        return (block * (n // len(block) + 1))[:n]

    def _text_body(self, rng, length, asked, qa_ids, record, repeat: bool = False, n_dis: Optional[int] = None):
        dis = [record()[2] for _ in range(int(rng.integers(0, 7)) if n_dis is None else n_dis)]
        recs = dis + [a[2] for a in asked]
        n_text = length - len(qa_ids) - len(self.nl) - sum(len(self.nl) + len(r) for r in recs)
        if n_text < 1:
            raise _TooShort(length - n_text + 1)
        text = self.text
        if repeat:
            stream, used = self._repeat_span(rng, n_text), list[int]()
        else:
            assert text is not None, "a text filler needs the filler data (synth checks it first)"
            stream, used = text.span(rng, n_text, self.line_end)
        # distractors, then the asked records, each at a uniform point of the stream so far (snapped to a
        # line end): each asked record's share of the context before it is uniform
        inside: list[tuple[int, int]] = []  # [start, end) of every inserted record
        far = self.spec.distances is not None
        for r in dis if far else recs:
            ins = self.nl + r
            p = self._snap(stream, int(rng.random() * (len(stream) + 1)), inside)
            stream[p:p] = ins
            inside = [(s + len(ins), e + len(ins)) if s >= p else (s, e) for s, e in inside] + [(p, p + len(ins))]
        if far:
            # the asked records nearest the end first: each later one goes further back, so it moves none of them
            ctx = len(stream) + sum(len(self.nl) + len(a[2]) for a in asked) + len(self.nl)  # + the closing newline
            slot: dict[int, tuple[int, int]] = {}
            for d, j in sorted((d, j) for j, d in enumerate(self._targets(rng, asked, ctx))):
                ins = self.nl + asked[j][2]
                p = self._snap(stream, max(0, len(stream) + len(ins) - d), inside)
                stream[p:p] = ins
                inside = [(s + len(ins), e + len(ins)) if s >= p else (s, e) for s, e in inside] + [(p, p + len(ins))]
                slot = {k: ((s + len(ins), e + len(ins)) if s >= p else (s, e)) for k, (s, e) in slot.items()}
                slot[j] = (p, p + len(ins))
            inside = inside[: len(dis)] + [slot[j] for j in range(len(asked))]
        depths = [s / max(1, len(stream) - (e - s)) for s, e in inside[len(dis) :]]
        body = stream + self.nl + qa_ids
        meta = {
            "records": len(recs),
            "depths": [round(d, 4) for d in depths],
            "distances": [len(stream) - s for s, _ in inside[len(dis) :]],
        }  # record start -> context end
        if text is not None and not repeat:  # real text: where it came from, under which licences
            meta.update(
                filler_sources=sorted({text.meta[d]["source"] for d in used}),
                filler_licenses=sorted({f"{text.meta[d]['source']}: {text.meta[d]['license']}" for d in used}),
                filler_docs=[text.meta[d]["key"] for d in used],
            )
        return body, meta


# --------------------------------------------------------------------------- lengths
def _tokens(s: str) -> int:
    s = s.strip().lower()
    mult = 1024 if s.endswith("k") else 1
    try:
        return int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise DataError(f"--lengths item {s!r}: expected a token count like 4096 or 4k") from None


def parse_distances(spec: Optional[str]) -> Optional[tuple]:
    """'10k-20k' -> (10240, 20480); None -> None."""
    if spec is None:
        return None
    try:
        got = parse_lengths(spec)
    except DataError as e:
        raise DataError(f"--distances {spec!r}: {str(e).split(': ', 1)[-1]} (LO-HI tokens, like 10k-20k)") from None
    if len(got) != 1 or not isinstance(got[0], tuple):
        raise DataError(f"--distances {spec!r}: expected one range LO-HI in tokens, like 10k-20k")
    return got[0]


def parse_lengths(spec: str) -> list:
    """'4096,8192' -> [4096, 8192]; '4k-32k' -> [(4096, 32768)] (uniform per document); mixed lists too."""
    out: list[Union[int, tuple[int, int]]] = []
    for item in (x for x in spec.split(",") if x.strip()):
        if "-" in item.strip()[1:]:
            lo, hi = (_tokens(x) for x in re.split(r"(?<=.)-", item.strip(), maxsplit=1))
            if not 0 < lo <= hi:
                raise DataError(f"--lengths range {item!r}: need 0 < lo <= hi")
            out.append((lo, hi))
        else:
            n = _tokens(item)
            if n <= 0:
                raise DataError(f"--lengths {item!r}: must be positive")
            out.append(n)
    if not out:
        raise DataError(f"--lengths {spec!r}: no length given")
    return out


# --------------------------------------------------------------------------- dataset
def synth_dataset(
    out,
    tok_cfg: TokenizerConfig,
    *,
    lengths: list,
    docs: int,
    seed: int = 0,
    tasks=TASKS,
    query_every: int = 1024,
    distances: Optional[tuple] = None,
    distance_share: float = 1.0,
    templates=TEMPLATE_NAMES,
    key_types=KEY_TYPES,
    value_types=KEY_TYPES,
    fillers=("kv",),
    filler_data: Optional[str] = None,
    filler_bucket: str = "all",
    filler_exclude: Optional[str] = None,
    profile: str = "kv",
    make=None,
    wording=None,
    window: Optional[int] = None,
    val_fraction: float = 0.01,
    split_seed: int = 0,
    edges=DEFAULT_EDGES,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Write `docs` synthetic documents as a megablu dataset at `out`; returns its manifest.

    Another profile passes its name, its synthesizer class (`make`, a Synthesizer) and its wording (what
    the manifest's template digest hashes): synth_disjoint.disjoint_dataset."""
    from tqdm import tqdm

    if docs <= 0:
        raise DataError(f"--docs {docs}: must be positive")
    longest = max(x[1] if isinstance(x, tuple) else x for x in lengths)
    if window is not None and longest + 1 > window:
        raise DataError(
            f"--lengths: {longest} + its closing EOT does not fit --window {window} (a synthetic "
            f"document is read whole, in mode fit: its question must sit in the same row as its keys); "
            f"use lengths <= {window - 1}"
        )
    if (profile == "kv") != (make is None):
        raise DataError(
            f"synth: profile {profile!r} with synthesizer {make!r}: the default profile 'kv' takes the "
            f"default synthesizer, another profile its own (synth_disjoint.disjoint_dataset)"
        )
    if filler_exclude and not filler_data:
        raise DataError(
            f"--filler-exclude {filler_exclude}: excludes filler text, but there is none; add "
            f"--filler-data DIR with --filler text"
        )
    tok = load_tokenizer(tok_cfg)
    text = TrainText(filler_data, tok, filler_bucket, exclude=filler_exclude) if filler_data else None
    spec = SynthSpec(
        lengths=lengths,
        tasks=tuple(tasks),
        templates=tuple(templates),
        key_types=tuple(key_types),
        value_types=tuple(value_types),
        fillers=tuple(fillers),
        seed=seed,
        query_every=query_every,
        distances=None if distances is None else tuple(distances),
        distance_share=distance_share,
    )
    syn = (make or Synthesizer)(tok, spec, text)
    if wording is None:
        wording = [asdict(t) for t in TEMPLATES] + [_W1, _W2, _W3]
    tok_info = {
        "identity": tok.identity,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "config": tok_cfg.model_dump(exclude_none=True),
    }
    split_info = {
        "val_fraction": val_fraction,
        "seed": split_seed,
        "rule": "val iff sha256(f'{seed}:{key}')[:8] / 2**64 < val_fraction; key = synth/<seed>/<i>",
    }
    digest = hashlib.sha256(json.dumps(wording).encode()).hexdigest()[:16]
    with DatasetWriter(
        Path(out),
        tok_info,
        edges=edges,
        split_info=split_info,
        overwrite=overwrite,
        inputs=[filler_data] if filler_data else [],
    ) as w:
        band = [0, 0]  # asked records within --distances, all asked records
        for i in tqdm(range(docs), file=sys.stderr, disable=not progress, desc="synth", mininterval=1.0):
            ids, meta = syn.document(i)
            if distances is not None:
                band[0] += sum(distances[0] <= d <= distances[1] for d in meta["distances"])
                band[1] += len(meta["distances"])
            key = f"synth/{seed}/{i}"
            if meta["filler"] == "text" and text is not None:  # a text filler reads `text`
                src = "synth+" + "+".join(meta["filler_sources"])
                lic = f"{GENERATED_LICENSE}; filler text from {text.root} (train): " + "; ".join(
                    meta["filler_licenses"]
                )
            else:
                src, lic = "synth", GENERATED_LICENSE
            meta.update(
                source=src,
                license=lic,
                key=key,
                n_tokens=len(ids),
                provenance=f"megablu data synth seed={seed} doc={i} templates={digest}",
            )
            w.add(np.asarray(ids, dtype=np.int64), split_of(key, val_fraction, split_seed), meta)
        extra = {
            "synth": {
                "seed": seed,
                "docs": docs,
                "lengths": [list(x) if isinstance(x, tuple) else x for x in lengths],
                "tasks": list(tasks),
                "query_every": query_every,
                "distances": None if distances is None else list(distances),
                "distance_share": distance_share if distances is not None else None,
                "in_band": round(band[0] / band[1], 4) if band[1] else None,
                "templates": list(templates),
                "key_types": list(key_types),
                "value_types": list(value_types),
                "fillers": list(fillers),
                "template_digest": digest,
                "filler_data": None
                if text is None
                else {"path": str(text.root), "bucket": filler_bucket, "split": "train", "shards": text.identity},
            }
        }
        if profile != "kv" or filler_exclude:  # the default profile's manifest, without the new option, as it was
            extra["synth"].update(
                profile=profile,
                filler_exclude=filler_exclude,
                filler_excluded_docs=sum(text.excluded.values()) if text else 0,
            )
        if band[1] and distances is not None:  # crowding (more asked tokens than the band holds) spills records out
            log.info(
                "synth: %d of %d asked records (%.1f%%) sit %d-%d tokens before the questions (--distance-share "
                "%.2f asked for)",
                band[0],
                band[1],
                100 * band[0] / band[1],
                *distances,
                distance_share,
            )
        return w.finish(extra)
