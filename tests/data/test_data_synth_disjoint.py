"""`megablu data synth --profile disjoint` shares no template wording and no structure with the eval
(megablu/data/synth_disjoint.py); the same checks find the default profile's eval-like shapes.

Eval wording: every prompt constant of the eval's modules (passkey, needle, vt, words, the RULER suite's
templates) read from the modules, plus the text of prompts generated for every eval task (haystack text
taken out: it is real text either side may draw on). Structure: keys and values (no digits, no UUIDs,
no word of the eval's word lists, no adjective-noun pair), the question (none of the eval's phrases),
the haystack (real train text, no line repeated as filler, not the essay haystack)."""

import importlib
import itertools
import json
import re
import sysconfig
from pathlib import Path

import pytest

from megablu.config.eval_tasks import PRESETS
from megablu.config.schema import EvalConfig, TokenizerConfig
from megablu.data.build import Source, build_dataset
from megablu.data.shards import DataError, DocTable, read_manifest
from megablu.data.synth import Synthesizer, SynthSpec, TrainText, synth_dataset
from megablu.data.synth_disjoint import (
    DISJOINT_TASKS,
    FORMAT_NAMES,
    NAME_KINDS,
    VALUE_KINDS,
    DisjointSynthesizer,
    disjoint_dataset,
)
from megablu.data.tokenizer import load_tokenizer

TOK = TokenizerConfig(kind="tiktoken_file", path="megablu:stdlib4k")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
N = 4  # word n-grams of the eval's wording that no training document may hold
# the modules whose constants are prompt text: megablu's own tasks and the RULER suite's
PROMPT_MODULES = (
    "megablu.eval.passkey",
    "megablu.eval.needle",
    "megablu.eval.vt",
    "megablu.eval.words",
    "megablu.eval.prompts",
    "megablu.eval.ruler.templates",
    "megablu.eval.ruler.niah",
    "megablu.eval.ruler.vt",
    "megablu.eval.ruler.words",
    "megablu.eval.ruler.common",
)
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
PHRASES = re.compile(
    r"pass ?key|special magic|magic numbers?|grass is green|variable assignment|"
    r"most common words|coded words?",
    re.I,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOK)


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    """Real text with train and val splits: the stdlib's json and email packages."""
    out = tmp_path_factory.mktemp("disjoint") / "std"
    build_dataset(
        [Source(str(STDLIB / "json"), include=["*.py"]), Source(str(STDLIB / "email"), include=["*.py"])],
        TOK,
        out,
        val_fraction=0.3,
        workers=1,
        progress=False,
    )
    return out


def _docs(root, tok, split=None):
    m = read_manifest(root)
    out = []
    for s in [x for x in m["shards"] if split is None or x["split"] == split]:
        t = DocTable.open(root, [s], m["dtype"])
        metas = [json.loads(x) for x in (root / s["meta"]).read_text().splitlines()]
        out += [(tok.decode(t.doc(i).tolist()), metas[i]) for i in range(len(t))]
    return out


def grams(text: str, n: int = N) -> set:
    w = re.findall(r"\w+", text.lower())
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def _strings(x):
    if isinstance(x, str):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _strings(y)


def eval_constants() -> list[str]:
    """Every module-level string constant (and tuple of strings) of the eval's prompt modules, split at
    their {placeholders}: the fixed wording of every template."""
    out = []
    for name in PROMPT_MODULES:
        mod = importlib.import_module(name)
        for attr, val in vars(mod).items():
            if re.fullmatch(r"_?[A-Z][A-Z0-9_]*", attr):
                for s in _strings(val):
                    out += [p for p in re.split(r"\{[^}]*\}", s) if p.strip()]
    return out


def eval_word_lists() -> set:
    """The words the eval draws keys, values and word-list items from."""
    from megablu.eval import needle
    from megablu.eval.ruler.assets import english_words, wonderwords

    words = set(needle._ADJ) | set(needle._NOUN) | set(english_words())
    for c in ("nouns", "adjectives", "verbs"):
        words |= set(wonderwords(c))
    return {w.lower() for w in words}


@pytest.fixture(scope="module")
def eval_side(tok, text_data):
    """(the eval's wording as word 4-grams, its word lists, the essay haystack's 8-grams)."""
    from megablu.data.haystack import haystack_source
    from megablu.eval.harness import build_prompts
    from megablu.eval.ruler.assets import essay_text

    consts = eval_constants()
    assert any("pass key" in c for c in consts) and any("special magic" in c for c in consts)
    wording = set().union(*(grams(c) for c in consts))
    hay = haystack_source(str(text_data), tok)
    tasks = sorted(PRESETS)
    assert {"passkey", "needle", "ruler_niah_single_1", "ruler_vt", "ruler_fwe"} <= set(tasks)
    prompts = build_prompts(
        EvalConfig(tasks=[t for t in tasks if t != "ruler_cwe"], lengths=[4096], n=3, seed=0), tok, haystack=hay
    )
    prompts.update(build_prompts(EvalConfig(tasks=["ruler_cwe"], lengths=[8192], n=2, seed=0), tok, haystack=hay))
    assert {t for t, _ in prompts} == set(tasks)
    essays = essay_text()
    real = grams(essays).union(*(grams(t) for t, _ in _docs(text_data, tok)))
    generated = set().union(*(grams(tok.decode(list(p.ids))) for ps in prompts.values() for p in ps)) - real
    assert len(wording) > 150 and len(generated) > 300
    return wording | generated, eval_word_lists(), grams(essays, 8)


def violations(tok, docs, eval_grams, words, essay8, train_lines) -> dict:
    """What in these (ids, meta) documents is shaped like the eval: {check: examples}."""
    bad = {
        k: []
        for k in (
            "eval wording",
            "eval phrase",
            "digits or uuid",
            "eval word list",
            "adjective-noun",
            "repeated filler",
            "not real text",
            "essay text",
        )
    }
    for ids, meta in docs:
        text = tok.decode(list(ids))
        ctx, qa = tok.decode(list(ids[: -meta["qa_tokens"]])), tok.decode(list(ids[-meta["qa_tokens"] :]))
        bad["eval wording"] += [" ".join(g) for g in grams(text) & eval_grams]
        bad["eval phrase"] += PHRASES.findall(qa)
        for item in meta["asked"] + meta["answer"] + [meta.get("value", "x")]:
            if re.search(r"\d", item) or UUID.search(item):
                bad["digits or uuid"].append(item)
            parts = [p for p in re.split(r"[-_ /]+", item.lower()) if p]
            if any(p in words for p in parts):
                bad["eval word list"].append(item)
            if len(parts) == 2 and all(p in words for p in parts):
                bad["adjective-noun"].append(item)
        lines = [ln.strip() for ln in ctx.split("\n") if len(ln.strip()) >= 20]
        counts = {ln: lines.count(ln) for ln in set(lines)}
        bad["repeated filler"] += [ln for ln, c in counts.items() if c >= 10]
        real = sum(ln in train_lines for ln in lines) / max(1, len(lines))
        if real < 0.5:  # most of the haystack's lines are lines of the train split's text
            bad["not real text"].append(round(real, 2))
        bad["essay text"] += [" ".join(g) for g in grams(ctx, 8) & essay8]
    return {k: v for k, v in bad.items() if v}


@pytest.fixture(scope="module")
def train_lines(tok, text_data):
    return {ln.strip() for t, _ in _docs(text_data, tok, "train") for ln in t.split("\n")}


def test_disjoint_documents_share_no_wording_or_structure_with_the_eval(tok, text_data, eval_side, train_lines):
    text = TrainText(text_data, tok)
    docs = []
    for task, fmt, kt, vt in itertools.product(DISJOINT_TASKS, FORMAT_NAMES, NAME_KINDS, VALUE_KINDS):
        syn = DisjointSynthesizer(
            tok,
            SynthSpec(
                lengths=[(1500, 2500)],
                tasks=(task,),
                templates=(fmt,),
                key_types=(kt,),
                value_types=(vt,),
                fillers=("text",),
                query_every=512,
                seed=5,
            ),
            text,
        )
        docs += [syn.document(i) for i in range(2)]
    assert {m["template"] for _, m in docs} == set(FORMAT_NAMES) and len(docs) == 270
    assert violations(tok, docs, *eval_side, train_lines) == {}


@pytest.mark.parametrize(
    "filler,key_type,expect",
    [
        ("kv", "numbers", {"digits or uuid", "not real text"}),
        ("repeat", "words", {"repeated filler", "eval word list", "not real text"}),
        ("text", "uuid", {"digits or uuid"}),
    ],
)
def test_the_checks_find_the_default_profiles_eval_like_shapes(
    tok, text_data, eval_side, train_lines, filler, key_type, expect
):
    """The evidence the check can fail: the default profile's number/UUID/word keys, its key-value-list and
    repeated-filler haystacks are each reported."""
    syn = Synthesizer(
        tok,
        SynthSpec(
            lengths=[(1500, 2500)],
            tasks=("kv", "manyq"),
            key_types=(key_type,),
            value_types=(key_type,),
            fillers=(filler,),
            query_every=512,
            seed=5,
        ),
        TrainText(text_data, tok),
    )
    got = violations(tok, [syn.document(i) for i in range(6)], *eval_side, train_lines)
    assert expect <= set(got), got


def test_answers_close_each_document_and_match_its_records(tok, text_data):
    """Exact lengths; each asked name once in the context; a lookup's answer is its record's field; collect's
    answer lists every record holding the value, in the order they appear, and no other record holds it."""
    text = TrainText(text_data, tok)
    for task in DISJOINT_TASKS:
        syn = DisjointSynthesizer(
            tok,
            SynthSpec(
                lengths=[(1200, 3000)],
                tasks=(task,),
                templates=FORMAT_NAMES,
                key_types=NAME_KINDS,
                value_types=VALUE_KINDS,
                fillers=("text",),
                query_every=400,
                seed=9,
            ),
            text,
        )
        for i in range(12):
            ids, meta = syn.document(i)
            assert len(ids) == syn.length_of(i) and meta["filler_docs"]
            ctx, qa = tok.decode(ids[: -meta["qa_tokens"]]), tok.decode(ids[-meta["qa_tokens"] :])
            assert all(ctx.count(k) == 1 for k in meta["asked"])
            if task == "collect":
                at = [ctx.index(k) for k in meta["answer"]]
                assert at == sorted(at) and sorted(meta["answer"]) == sorted(meta["asked"])
                assert ctx.count(meta["value"]) == len(meta["asked"]) and qa.rstrip().endswith(
                    meta["answer"][-1]
                    + ("]" if meta["template"] == "signature" else "." if meta["template"] == "glossary" else "")
                )
                continue
            assert len(meta["asked"]) == (1 if task == "lookup" else max(2, len(ids) // 400))
            pos = 0
            for k, v in zip(meta["asked"], meta["answer"]):
                assert ctx.count(v) == 1 and 0 < ctx.index(v) - ctx.index(k) < 160  # in the name's record
                q_at = qa.index(k, pos)
                pos = qa.index(v, q_at) + len(v)  # its question, then its answer
                assert meta["field"] in qa[max(0, q_at - 80) : pos]


def test_filler_exclude_keeps_a_texts_documents_out(tmp_path, tok, text_data):
    """--filler-exclude FILE: no filler document sharing an 8-word run with FILE is drawn (here FILE is three
    train documents, as the essay haystack would be), the manifest counts them; default profile too."""
    train = _docs(text_data, tok, "train")
    banned = sorted(train, key=lambda d: -len(d[0]))[:3]
    ex = tmp_path / "ex.txt"
    ex.write_text("\n\n".join(t for t, _ in banned))
    m = disjoint_dataset(
        tmp_path / "d", TOK, lengths=[1500], docs=30, filler_data=str(text_data), filler_exclude=str(ex), progress=False
    )
    keys = {meta["key"] for _, meta in banned}
    got = _docs(tmp_path / "d", tok)
    assert m["synth"]["profile"] == "disjoint" and m["synth"]["filler_excluded_docs"] >= 1
    assert all(not keys & set(meta["filler_docs"]) for _, meta in got)
    ex8 = grams(ex.read_text(), 8)
    assert not any(grams(t, 8) & ex8 for t, _ in got)
    # without the exclusion the same documents do draw them (the check above can fail)
    disjoint_dataset(tmp_path / "e", TOK, lengths=[1500], docs=30, filler_data=str(text_data), progress=False)
    assert any(keys & set(meta["filler_docs"]) for _, meta in _docs(tmp_path / "e", tok))
    k = synth_dataset(
        tmp_path / "k",
        TOK,
        lengths=[1500],
        docs=30,
        fillers=("text",),
        filler_data=str(text_data),
        filler_exclude=str(ex),
        progress=False,
    )
    assert k["synth"]["filler_excluded_docs"] >= 1
    assert all(not keys & set(meta["filler_docs"]) for _, meta in _docs(tmp_path / "k", tok))


def test_reproducible_and_default_manifest_unchanged(tmp_path, text_data):
    kw = dict(lengths=[1200], docs=8, filler_data=str(text_data), progress=False)
    a, b = disjoint_dataset(tmp_path / "a", TOK, seed=3, **kw), disjoint_dataset(tmp_path / "b", TOK, seed=3, **kw)
    c = disjoint_dataset(tmp_path / "c", TOK, seed=4, **kw)
    sha = [[s["sha256"] for s in x["shards"]] for x in (a, b, c)]
    assert sha[0] == sha[1] != sha[2]
    d = synth_dataset(tmp_path / "d", TOK, lengths=[300], docs=4, progress=False)
    assert "profile" not in d["synth"]  # the default profile writes the manifest it always wrote


def test_bad_input(tmp_path, tok, text_data):
    text = TrainText(text_data, tok)
    with pytest.raises(DataError, match="this profile's haystack is real text only.*--filler text"):
        DisjointSynthesizer(
            tok,
            SynthSpec(
                lengths=[900],
                tasks=("lookup",),
                templates=("ini",),
                key_types=("coined",),
                value_types=("code",),
                fillers=("repeat",),
            ),
            text,
        )
    with pytest.raises(DataError, match=r"key types \['numbers'\] unknown; known: \['coined', 'snake', 'title'\]"):
        DisjointSynthesizer(
            tok,
            SynthSpec(
                lengths=[900],
                tasks=("lookup",),
                templates=("ini",),
                key_types=("numbers",),
                value_types=("code",),
                fillers=("text",),
            ),
            text,
        )
    with pytest.raises(DataError, match="needs --filler-data"):
        DisjointSynthesizer(
            tok,
            SynthSpec(
                lengths=[900],
                tasks=("lookup",),
                templates=("ini",),
                key_types=("coined",),
                value_types=("code",),
                fillers=("text",),
            ),
        )
    with pytest.raises(DataError, match="profile 'disjoint' with synthesizer None"):
        synth_dataset(tmp_path / "a", TOK, lengths=[900], docs=2, profile="disjoint", progress=False)
    with pytest.raises(DataError, match="--filler-exclude nope.txt: no such file"):
        synth_dataset(
            tmp_path / "b",
            TOK,
            lengths=[900],
            docs=2,
            fillers=("text",),
            filler_data=str(text_data),
            filler_exclude="nope.txt",
            progress=False,
        )
    with pytest.raises(DataError, match="excludes filler text, but there is none"):
        synth_dataset(tmp_path / "c", TOK, lengths=[900], docs=2, filler_exclude="x.txt", progress=False)
    assert not any((tmp_path / x).exists() for x in "abc")


def test_cli(tmp_path, capsys, text_data):
    from megablu.cli import main

    rc = main(
        [
            "data",
            "synth",
            "--tokenizer",
            "tiktoken_file:megablu:stdlib4k",
            "--out",
            str(tmp_path / "s"),
            "--profile",
            "disjoint",
            "--filler-data",
            str(text_data),
            "--lengths",
            "1000,1500",
            "--docs",
            "6",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "| synth+" in out
    m = read_manifest(tmp_path / "s")["synth"]
    assert (m["profile"], m["tasks"], m["key_types"], m["fillers"]) == (
        "disjoint",
        list(DISJOINT_TASKS),
        list(NAME_KINDS),
        ["text"],
    )
    rc = main(
        [
            "data",
            "synth",
            "--tokenizer",
            "tiktoken_file:megablu:stdlib4k",
            "--out",
            str(tmp_path / "t"),
            "--profile",
            "disjoint",
            "--filler-data",
            str(text_data),
            "--filler",
            "kv",
            "--lengths",
            "900",
            "--docs",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 2 and "real text only" in capsys.readouterr().err
