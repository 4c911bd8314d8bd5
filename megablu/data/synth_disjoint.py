"""`megablu data synth --profile disjoint`: retrieval training documents that share no shape with the eval.

The default profile (megablu/data/synth.py) writes key-value lists whose shapes resemble the eval's
retrieval tests: number and UUID keys, a completion question at the end, a repeated-filler haystack, a
haystack made of other key-value lines. A model trained on them learns the test's format as well as
retrieval, and its passkey score says how well it learned both. This profile keeps the training
signal (find something read far back; gather several things read far apart) and changes everything
the eval fixes:

    haystack     real TRAIN text only (no key-value list, no repeated filler); with --filler-exclude
                 FILE, filler documents sharing a word 8-gram with FILE (the eval's essay haystack)
                 are never drawn
    records      multi-field structured records, one of five formats (FORMATS: an INI section, a
                 glossary entry, a Python signature, a two-column table, a YAML mapping),
                 inserted at line ends of the text
    keys         coined pronounceable names ("tarvolin"), snake_case or title-case pairs of them
                 (NAME_KINDS); never digits, UUIDs or dictionary words
    values       coined words, letter codes ("KRV-TALM") or paths ("/srv/tarvolin/keshmal")
                 (VALUE_KINDS); never digits, UUIDs or dictionary words
    tasks        lookup   one record's field, asked by the record's name and its field's name
                 lookups  one such question per --query-every tokens, each answered at once
                 collect  every record whose given field holds a given value (2-5 of them, among
                          distractors), their names in the order they appear

Each format has its own question and answer wording (none of it the eval's: tests/data/
test_data_synth_disjoint.py collects the eval's templates and prompts and checks every word 4-gram).
As in the default profile, the text is composed in token space (exact lengths), the answers close
the document (every token is LM loss), document i depends only on (seed, i, the options, the filler
dataset), and --distances places a share of the asked records in a band of distances.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .shards import DataError
from .synth import Synthesizer, SynthSpec, _Ambiguous, synth_dataset

DISJOINT_TASKS = ("lookup", "lookups", "collect")
NAME_KINDS = ("coined", "snake", "title")
VALUE_KINDS = ("coined", "code", "path")
MAX_LOOKUPS = 64  # lookups: questions per document at most

# coined words: CVC-CV-CVC syllables from these inventories (7-10 letters; a real English word of this
# shape is one draw in millions, and the tests check the draws against the eval's word lists)
_ONSET = (
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gl",
    "kr",
    "pl",
    "st",
    "tr",
    "sh",
    "th",
)
_VOWEL = ("a", "e", "i", "o", "u", "ai", "ou")
_CODA = ("n", "r", "l", "s", "m", "sk", "rn")
_CAPS = "BCDFGHJKLMNPQRSTVWXZ"


@dataclass(frozen=True)
class Format:
    """One record format. {name}: the record's name; {f0}..{f2}: its fields' values; {a}: a field's name;
    {v}: its value; {names}: the collected names joined by `join`; {x}: the value asked for."""

    name: str
    fields: tuple  # the three fields' names
    record: str  # one record (one or more lines, no final newline)
    ask: str  # lookup question (then `answer`)
    answer: str
    ask_all: str  # collect question (then `answer_all`)
    answer_all: str
    join: str = ", "


FORMATS = (
    Format(
        "ini",
        ("upstream", "archive", "steward"),
        "[{name}]\nupstream = {f0}\narchive = {f1}\nsteward = {f2}",
        "; audit: section [{name}] sets {a} to",
        " {v}",
        "; audit: sections with {a} = {x}, top to bottom:",
        " {names}",
    ),
    Format(
        "glossary",
        ("origin", "variant", "register"),
        "{name}, noun. Origin: {f0}. Variant spelling: {f1}. Register: {f2}.",
        "Glossary drill. Headword {name} -- {a}:",
        " {v}.",
        "Glossary drill. Headwords whose {a} is {x}, as listed:",
        " {names}.",
    ),
    Format(
        "signature",
        ("source", "target", "owner"),
        'def {name}(source="{f0}", target="{f1}", owner="{f2}"):',
        "# inspect.signature({name}).parameters['{a}'].default ->",
        ' "{v}"',
        '# functions defined with {a}="{x}", in definition order ->',
        " [{names}]",
    ),
    # one small table per record, fields as rows (a header row repeated before every record would be
    # a repeated line, the filler shape this profile avoids)
    Format(
        "table",
        ("depot", "route", "keeper"),
        "| unit | {name} |\n| --- | --- |\n| depot | {f0} |\n| route | {f1} |\n| keeper | {f2} |",
        "Cross-reference: unit {name}, {a} cell =",
        " {v}",
        "Cross-reference: units whose {a} cell = {x}, in table order =",
        " {names}",
    ),
    Format(
        "yaml",
        ("parent", "mirror", "curator"),
        "{name}:\n  parent: {f0}\n  mirror: {f1}\n  curator: {f2}",
        "$ yq '.{name}.{a}' registry.yaml\n",
        "{v}",
        "$ yq 'to_entries | map(select(.value.{a} == \"{x}\")) | .[].key' registry.yaml\n",
        "{names}",
        join="\n",
    ),
)
FORMAT_NAMES = tuple(f.name for f in FORMATS)


def coined(rng: np.random.Generator) -> str:
    """A pronounceable non-word: CVC-CV-CVC."""

    def pick(xs):
        return xs[int(rng.integers(len(xs)))]

    return (
        pick(_ONSET)
        + pick(_VOWEL)
        + pick(_CODA)
        + pick(_ONSET)
        + pick(_VOWEL)
        + pick(_ONSET)
        + pick(_VOWEL)
        + pick(_CODA)
    )


class _Names:
    """Distinct names and values of one document; `protected` (the asked records' strings) never occurs inside
    a later item nor contains one, so every asked name occurs once in the context."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.seen, self.protected = rng, set[str](), list[str]()

    def _one(self, kind: str) -> str:
        r = self.rng
        if kind == "coined":
            return coined(r)
        if kind == "snake":
            return f"{coined(r)}_{coined(r)}"
        if kind == "title":
            return f"{coined(r).title()} {coined(r).title()}"
        if kind == "code":
            return "-".join("".join(_CAPS[int(r.integers(len(_CAPS)))] for _ in range(n)) for n in (3, 4))
        return f"/srv/{coined(r)}/{coined(r)}"  # path

    def draw(self, kind: str) -> str:
        for _ in range(1000):
            x = self._one(kind)
            if x not in self.seen and not any(p in x or x in p for p in self.protected):
                self.seen.add(x)
                return x
        raise DataError(
            f"synth --profile disjoint: ran out of distinct {kind} items ({len(self.seen):,} used in one "
            f"document); use shorter documents"
        )


class DisjointSynthesizer(Synthesizer):
    """Documents of the disjoint profile. spec.tasks from DISJOINT_TASKS, spec.templates from FORMAT_NAMES,
    spec.key_types from NAME_KINDS, spec.value_types from VALUE_KINDS, spec.fillers ("text",) only."""

    def __init__(self, tokenizer, spec: SynthSpec, text=None):
        known = {
            "tasks": (spec.tasks, DISJOINT_TASKS),
            "templates": (spec.templates, FORMAT_NAMES),
            "key types": (spec.key_types, NAME_KINDS),
            "value types": (spec.value_types, VALUE_KINDS),
        }
        for what, (got, ok) in known.items():
            bad = [t for t in got if t not in ok]
            if bad or not got:
                raise DataError(f"synth --profile disjoint: {what} {bad or '(none)'} unknown; known: {list(ok)}")
        if tuple(spec.fillers) != ("text",):
            raise DataError(
                f"synth --profile disjoint: --filler {','.join(spec.fillers)}: this profile's haystack is "
                f"real text only (the kv and repeat fillers are the eval's haystack shapes); use "
                f"--filler text with --filler-data DIR"
            )
        # the base class checks lengths, query_every, distances and that text is given, against its own names
        super().__init__(
            tokenizer,
            SynthSpec(
                lengths=spec.lengths,
                fillers=("text",),
                seed=spec.seed,
                query_every=spec.query_every,
                distances=spec.distances,
                distance_share=spec.distance_share,
            ),
            text,
        )
        self.spec = spec
        self.formats = {f.name: f for f in FORMATS}

    def _document(self, i: int, length: int, rng: np.random.Generator):
        sp = self.spec
        task = sp.tasks[int(rng.integers(len(sp.tasks)))]
        fmt = self.formats[sp.templates[int(rng.integers(len(sp.templates)))]]
        kt = sp.key_types[int(rng.integers(len(sp.key_types)))]
        vt = sp.value_types[int(rng.integers(len(sp.value_types)))]
        names = _Names(rng)
        ask_field = int(rng.integers(3))
        shared = names.draw(vt) if task == "collect" else None  # collect: the value every asked record holds
        if shared is not None:
            names.protected.append(shared)

        def record(asked: bool = False) -> tuple[str, str, list[int]]:
            name = names.draw(kt)
            vals = [names.draw(vt) for _ in range(3)]
            if shared is not None and asked:
                vals[ask_field] = shared
            if asked:
                names.protected.extend([name] + vals)
            text = fmt.record.format(name=name, f0=vals[0], f1=vals[1], f2=vals[2])
            return name, vals[ask_field], self.tok.encode(text + "\n")

        a = fmt.fields[ask_field]
        if task == "collect":
            asked = [record(asked=True) for _ in range(int(rng.integers(2, 6)))]
            n_dis = int(rng.integers(3, 13))

            def qa_of(order):
                names_in = fmt.join.join(asked[j][0] for j in order)
                return fmt.ask_all.format(a=a, x=shared) + fmt.answer_all.format(names=names_in)

            qa = qa_of(range(len(asked)))
        else:
            n_ask = min(MAX_LOOKUPS, max(2, length // sp.query_every)) if task == "lookups" else 1
            asked = [record(asked=True) for _ in range(n_ask)]
            n_dis = int(rng.integers(2, 13)) if task == "lookup" else int(rng.integers(0, 7))
            qa = "\n".join(fmt.ask.format(name=r[0], a=a) + fmt.answer.format(v=r[1]) for r in asked)
        qa_ids = self.tok.encode(qa + "\n")
        ids, extra = self._text_body(rng, length, asked, qa_ids, record, n_dis=n_dis)
        if task == "collect":
            # the names in the order they appear: the question is rebuilt after placement, and must keep its
            # token count (a permutation of the same ', '-joined names does unless BPE merges across a join)
            order = sorted(range(len(asked)), key=lambda j: extra["distances"][j], reverse=True)
            again = self.tok.encode(qa_of(order) + "\n")
            if len(again) != len(qa_ids):
                raise _Ambiguous()
            ids = ids[: len(ids) - len(qa_ids)] + again
            qa_ids = again
        assert len(ids) == length, (len(ids), length)
        ctx = self.tok.decode(ids[: len(ids) - len(qa_ids)])
        if any(ctx.count(r[0]) != 1 for r in asked):
            raise _Ambiguous()
        meta = {
            "profile": "disjoint",
            "task": task,
            "template": fmt.name,
            "key_type": kt,
            "value_type": vt,
            "filler": "text",
            "field": a,
            "asked": [r[0] for r in asked],
            "qa_tokens": len(qa_ids),
            "answer": ([asked[j][0] for j in order] if task == "collect" else [r[1] for r in asked]),
        }
        if shared is not None:
            meta["value"] = shared
        meta.update(extra)
        return ids, meta


def disjoint_dataset(
    out,
    tok_cfg,
    *,
    tasks=DISJOINT_TASKS,
    templates=FORMAT_NAMES,
    key_types=NAME_KINDS,
    value_types=VALUE_KINDS,
    fillers=("text",),
    **kw,
) -> dict:
    """synth.synth_dataset for this profile (the same options; filler text only, --filler-data required)."""
    return synth_dataset(
        out,
        tok_cfg,
        tasks=tasks,
        templates=templates,
        key_types=key_types,
        value_types=value_types,
        fillers=fillers,
        profile="disjoint",
        make=DisjointSynthesizer,
        wording=[asdict(f) for f in FORMATS],
        **kw,
    )
