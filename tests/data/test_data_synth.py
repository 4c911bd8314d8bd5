"""`megablu data synth`: exact lengths, answers at the end, uniform depths, train-only filler, reproducible,
and no word 6-gram shared with any eval task's prompts (megablu/data/synth.py)."""

import itertools
import json
import re
import sysconfig
import typing
from pathlib import Path

import numpy as np
import pytest

from megablu.config.schema import EvalConfig, TokenizerConfig
from megablu.data.build import Source, build_dataset
from megablu.data.shards import DataError, DocTable, read_manifest
from megablu.data.synth import (
    FILLERS,
    KEY_TYPES,
    TASKS,
    TEMPLATE_NAMES,
    Synthesizer,
    SynthSpec,
    TrainText,
    parse_lengths,
    synth_dataset,
)
from megablu.data.tokenizer import load_tokenizer

TOK = TokenizerConfig(kind="tiktoken_file", path="megablu:stdlib4k")
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOK)


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    """Real text with train and val splits: the stdlib's json and email packages."""
    out = tmp_path_factory.mktemp("synth") / "std"
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
    """(text, meta) of every document of a dataset."""
    m = read_manifest(root)
    out = []
    for s in [x for x in m["shards"] if split is None or x["split"] == split]:
        t = DocTable.open(root, [s], m["dtype"])
        metas = [json.loads(x) for x in (root / s["meta"]).read_text().splitlines()]
        out += [(tok.decode(t.doc(i).tolist()), metas[i]) for i in range(len(t))]
    return out


def test_exact_lengths_answer_at_the_end_uniform_depths(tmp_path, tok, text_data):
    m = synth_dataset(
        tmp_path / "s",
        TOK,
        lengths=parse_lengths("300,700-900"),
        docs=160,
        fillers=("kv", "text"),
        filler_data=str(text_data),
        val_fraction=0.0,
        progress=False,
    )
    docs = _docs(tmp_path / "s", tok)
    assert len(docs) == 160 and m["synth"]["docs"] == 160
    depths = []
    m_data = read_manifest(tmp_path / "s")
    ids = {}
    for s in m_data["shards"]:
        t = DocTable.open(tmp_path / "s", [s], m_data["dtype"])
        for j, x in enumerate((tmp_path / "s" / s["meta"]).read_text().splitlines()):
            ids[json.loads(x)["key"]] = t.doc(j).tolist()
    for i, (_, meta) in enumerate(sorted(docs, key=lambda d: int(d[1]["key"].rsplit("/", 1)[1]))):
        n, doc = meta["n_tokens"], ids[meta["key"]]
        assert len(doc) == n and ((n == 300) if i % 2 == 0 else (700 <= n <= 900))
        # the question and its answer close the document: keys then values, in the asked order
        qa, ctx = tok.decode(doc[-meta["qa_tokens"] :]), tok.decode(doc[: -meta["qa_tokens"]])
        assert qa.endswith("\n") and qa.index(meta["asked"][0]) < qa.rindex(meta["answer"][-1])
        at = [qa.rindex(v) for v in meta["answer"]]
        assert at == sorted(at)
        for k, v in zip(meta["asked"], meta["answer"]):
            assert ctx.count(k) == 1 and ctx.count(v) == 1 and ctx.index(k) < ctx.index(v)  # its record, once
        depths += meta["depths"]
    assert sum(m["sources"][j]["tokens"] for j in range(len(m["sources"]))) == sum(d[1]["n_tokens"] for d in docs)
    d = np.asarray(depths)
    assert d.min() < 0.1 and d.max() > 0.9 and abs(d.mean() - 0.5) < 0.07  # uniform over the context
    assert np.histogram(d, bins=4, range=(0, 1))[0].min() > len(d) / 8


def test_every_template_task_key_type_and_filler(tok, text_data):
    """Each combination builds documents of the exact length whose answer matches the asked key's record."""
    text = TrainText(text_data, tok)
    for tpl, task, kt, filler in itertools.product(TEMPLATE_NAMES, TASKS, KEY_TYPES, FILLERS):
        syn = Synthesizer(
            tok,
            SynthSpec(lengths=[640], tasks=(task,), templates=(tpl,), key_types=(kt,), fillers=(filler,), seed=3),
            text,
        )
        ids, meta = syn.document(0)
        assert len(ids) == 640 and (meta["template"], meta["task"], meta["key_type"]) == (tpl, task, kt)
        assert len(meta["asked"]) == (1 if task == "kv" else len(meta["answer"])) and len(meta["answer"]) >= 1


def test_manyq_asks_one_key_per_query_every_tokens_each_answered_at_once(tok, text_data):
    """The dense task: length // query_every questions (2..MAX_QUERIES), each followed by its own record's value,
    in an order unrelated to depth; every asked record once in the context, depths uniform."""
    from megablu.data.synth import MAX_QUERIES

    text = TrainText(text_data, tok)
    depths, orders = [], []
    for filler, L, every in (("kv", 3000, 256), ("text", 3000, 256), ("kv", 600, 1024), ("kv", 9000, 64)):
        syn = Synthesizer(
            tok, SynthSpec(lengths=[L], tasks=("manyq",), fillers=(filler,), query_every=every, seed=5), text
        )
        for i in range(6):
            ids, meta = syn.document(i)
            n = min(MAX_QUERIES, max(2, L // every))
            assert len(ids) == L and len(meta["asked"]) == len(meta["answer"]) == len(meta["depths"]) == n
            qa, ctx = tok.decode(ids[-meta["qa_tokens"] :]), tok.decode(ids[: -meta["qa_tokens"]])
            lines = [ln for ln in qa.split("\n") if ln]
            pos = 0
            for k, v in zip(meta["asked"], meta["answer"]):
                assert ctx.count(k) == 1  # the key, once: its own record (never inside another item)
                line = ctx[ctx.rindex("\n", 0, ctx.index(k)) + 1 :]
                assert v in line[: line.index("\n")]  # the value on the key's record line
                q_at, a_at = qa.index(k, pos), qa.index(v, pos)  # question, then its answer, before the next one
                assert q_at < a_at
                pos = a_at + len(v)
            assert len(lines) >= n
            depths += meta["depths"]
            orders.append(meta["depths"] == sorted(meta["depths"]))
    d = np.asarray(depths)
    assert d.min() < 0.05 and d.max() > 0.95 and abs(d.mean() - 0.5) < 0.06
    assert not all(orders)  # questions are not asked in depth order
    with pytest.raises(DataError, match="--query-every 0: must be a positive"):
        Synthesizer(tok, SynthSpec(lengths=[500], tasks=("manyq",), query_every=0))


def test_an_asked_key_occurs_once_even_among_many_number_records(tok):
    """5-digit keys among ~1,000 records with values of up to 9 digits: without the pools' protection
    a key would sit inside some distractor's value in most documents."""
    from megablu.data.synth import _Pool

    syn = Synthesizer(
        tok,
        SynthSpec(
            lengths=[16000],
            tasks=("manyq",),
            key_types=("numbers",),
            value_types=("numbers",),
            templates=("colon",),
            query_every=256,
            seed=2,
        ),
    )
    for i in range(3):
        ids, meta = syn.document(i)
        ctx = tok.decode(ids[: -meta["qa_tokens"]])
        assert meta["records"] > 700 and len(meta["asked"]) == 62
        assert all(ctx.count(k) == 1 for k in meta["asked"])
    pool = _Pool("numbers", np.random.default_rng(0), protected=["1"])
    assert not any("1" in pool.draw("value") for _ in range(300))


def test_reproducible_and_seeded(tmp_path):
    kw = dict(lengths=[200], docs=20, progress=False, val_fraction=0.2)
    a = synth_dataset(tmp_path / "a", TOK, seed=1, **kw)
    b = synth_dataset(tmp_path / "b", TOK, seed=1, **kw)
    c = synth_dataset(tmp_path / "c", TOK, seed=2, **kw)
    sha = [[e["sha256"] for e in x["shards"]] for x in (a, b, c)]
    assert sha[0] == sha[1] and sha[0] != sha[2]
    assert a["sources"][0]["license"].startswith("generated by megablu data synth")
    assert {s["split"] for s in a["shards"]} == {"train", "val"}


def test_filler_is_train_text_with_its_licence(tmp_path, tok, text_data):
    synth_dataset(
        tmp_path / "s", TOK, lengths=[900], docs=30, fillers=("text",), filler_data=str(text_data), progress=False
    )
    m = read_manifest(text_data)
    train_keys = {
        json.loads(x)["key"]
        for s in m["shards"]
        if s["split"] == "train"
        for x in (text_data / s["meta"]).read_text().splitlines()
    }
    val_keys = {
        json.loads(x)["key"]
        for s in m["shards"]
        if s["split"] == "val"
        for x in (text_data / s["meta"]).read_text().splitlines()
    }
    assert val_keys
    for _, meta in _docs(tmp_path / "s", tok):
        assert meta["filler_docs"] and set(meta["filler_docs"]) <= train_keys
        assert meta["source"].startswith("synth+") and "filler text from" in meta["license"]
        assert "unknown" in meta["license"]  # the filler dataset's own licence field, carried over


def test_bad_input(tmp_path, tok, text_data):
    with pytest.raises(DataError, match="needs --filler-data"):
        synth_dataset(tmp_path / "a", TOK, lengths=[500], docs=2, fillers=("text",), progress=False)
    with pytest.raises(
        DataError, match="tokenized with 'tiktoken_file:v4096.* the synthetic set's tokenizer is 'byte:v257"
    ):
        synth_dataset(
            tmp_path / "b",
            TokenizerConfig(kind="byte"),
            lengths=[500],
            docs=2,
            fillers=("text",),
            filler_data=str(text_data),
            progress=False,
        )
    with pytest.raises(DataError, match="512 \\+ its closing EOT does not fit --window 512.*lengths <= 511"):
        synth_dataset(tmp_path / "c", TOK, lengths=[(200, 512)], docs=2, window=512, progress=False)
    with pytest.raises(DataError, match="no draw of task/template/key type fits"):
        synth_dataset(tmp_path / "d", TOK, lengths=[20], docs=2, progress=False)
    with pytest.raises(DataError, match="unknown templates \\['passkey'\\]"):
        synth_dataset(tmp_path / "e", TOK, lengths=[500], docs=2, templates=("passkey",), progress=False)
    assert parse_lengths("4k-32k,300") == [(4096, 32768), 300]
    with pytest.raises(DataError, match="need 0 < lo <= hi"):
        parse_lengths("8k-4k")
    assert not any((tmp_path / x).exists() for x in "abcde")


def test_cli(tmp_path, capsys):
    from megablu.cli import main

    rc = main(
        [
            "data",
            "synth",
            "--tokenizer",
            "tiktoken_file:megablu:stdlib4k",
            "--out",
            str(tmp_path / "s"),
            "--lengths",
            "255,511",
            "--docs",
            "12",
            "--window",
            "512",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "| synth | generated by megablu data synth" in out and "| all | | " in out
    rc = main(
        [
            "data",
            "synth",
            "--tokenizer",
            "tiktoken_file:megablu:stdlib4k",
            "--out",
            str(tmp_path / "t"),
            "--lengths",
            "600",
            "--docs",
            "2",
            "--window",
            "512",
            "--no-progress",
        ]
    )
    assert rc == 2 and "does not fit --window 512" in capsys.readouterr().err


# --------------------------------------------------------------------------- disjoint from the eval
def eval_task_names() -> list[str]:
    """Every task the eval harness knows: its registry when there is one, else EvalConfig's Literal."""
    try:
        from megablu.config.eval_tasks import PRESETS  # noqa: PLC0415 (the task registry, when it exists)

        return sorted(PRESETS)
    except ImportError:
        pass
    ann = EvalConfig.model_fields["tasks"].annotation
    lits = [a for a in typing.get_args(ann) if typing.get_origin(a) is typing.Literal]
    assert lits, f"cannot enumerate the eval tasks from EvalConfig.tasks: {ann}"
    return list(typing.get_args(lits[0]))


def _grams(text: str, n: int = 6) -> set:
    w = re.findall(r"\w+", text.lower())
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def test_no_eval_prompt_6gram_in_synthetic_documents(tok, text_data):
    """Word 6-grams of every eval task's prompts (haystack text excluded: both sides may draw on the same
    corpus) never occur in synthetic documents of every template, task, key type and filler."""
    from megablu.data.haystack import haystack_source
    from megablu.eval.harness import build_prompts

    tasks = eval_task_names()
    assert {"passkey", "needle", "multikey"} <= set(tasks)
    hay = haystack_source(str(text_data), tok)
    # ruler_cwe's 10 common words x 30 need more than 4096 tokens of this tokenizer before an uncommon one fits
    prompts = build_prompts(
        EvalConfig(tasks=[t for t in tasks if t != "ruler_cwe"], lengths=[4096], n=4, seed=0), tok, haystack=hay
    )
    if "ruler_cwe" in tasks:
        prompts.update(build_prompts(EvalConfig(tasks=["ruler_cwe"], lengths=[8192], n=4, seed=0), tok, haystack=hay))
    assert {t for t, _ in prompts} == set(tasks)
    eval_grams = set().union(*(_grams(tok.decode(list(p.ids))) for ps in prompts.values() for p in ps))
    real = set().union(*(_grams(t) for t, _ in _docs(text_data, tok)))
    own = eval_grams - real
    assert len(own) > 100  # the eval's own wording (instructions, needles, questions, filler) is there
    text = TrainText(text_data, tok)
    synth = set()
    for tpl, task, kt, filler in itertools.product(TEMPLATE_NAMES, TASKS, KEY_TYPES, FILLERS):
        syn = Synthesizer(
            tok,
            SynthSpec(lengths=[900], tasks=(task,), templates=(tpl,), key_types=(kt,), fillers=(filler,), seed=11),
            text,
        )
        for i in range(2):
            synth |= _grams(tok.decode(syn.document(i)[0]))
    shared = own & synth
    assert not shared, sorted(" ".join(g) for g in shared)[:20]


def test_distances_place_asked_records_in_the_band(tok, text_data):
    """--distances LO-HI: the asked records sit LO..HI tokens back from the questions (exact to one record
    for kv filler, to the line-end snap for text); with --distance-share 0.5 about half of them do and
    the rest keep uniform depths; the document is still exact, each key once, its value on its line."""
    text = TrainText(text_data, tok)
    lo, hi = 1200, 1800
    for filler in ("kv", "text", "repeat"):
        for share in (1.0, 0.5):
            syn = Synthesizer(
                tok,
                SynthSpec(
                    lengths=[(2600, 3400)],
                    tasks=("manyq", "kv"),
                    fillers=(filler,),
                    query_every=512,
                    seed=11,
                    distances=(lo, hi),
                    distance_share=share,
                ),
                text,
            )
            dist = []
            for i in range(24):
                ids, meta = syn.document(i)
                assert len(ids) == syn.length_of(i)
                ctx = tok.decode(ids[: -meta["qa_tokens"]])
                ctx_ids = ids[: -meta["qa_tokens"]]
                for k, v, d in zip(meta["asked"], meta["answer"], meta["distances"]):
                    assert ctx.count(k) == 1
                    line = ctx[ctx.rindex("\n", 0, ctx.index(k)) + 1 :]
                    assert v in line[: line.index("\n")]
                    # the distance in meta is where the key's record really starts
                    start = len(ctx_ids) - d
                    assert k in tok.decode(ctx_ids[start : start + 40]), (filler, d)
                dist += meta["distances"]
            d = np.asarray(dist)
            slack = 80  # one record (kv) or the 64-token snap (text)
            inside = ((d >= lo - slack) & (d <= hi + slack)).mean()
            if share == 1.0:
                assert inside == 1.0, (filler, sorted(d)[:5], sorted(d)[-5:])
                assert d.min() < lo + 150 and d.max() > hi - 150  # the band is covered, not one point
            else:
                assert 0.35 < inside < 0.8, (filler, inside)  # the band's own share: ~0.5 + 0.5 * 600/3000
                assert (d < lo - slack).mean() > 0.06 and (d > hi + slack).mean() > 0.06  # uniform ones: both sides


def test_distances_bad_input_and_default_unchanged(tmp_path, tok, text_data):
    from megablu.data.synth import parse_distances

    assert parse_distances("10k-20k") == (10240, 20480) and parse_distances(None) is None
    with pytest.raises(DataError, match="one range LO-HI"):
        parse_distances("10k")
    with pytest.raises(DataError, match="LO must be below the shortest document"):
        Synthesizer(tok, SynthSpec(lengths=[(900, 4000)], distances=(1000, 2000)))
    with pytest.raises(DataError, match="need 0 < LO <= HI"):
        Synthesizer(tok, SynthSpec(lengths=[900], distances=(500, 400)))
    with pytest.raises(DataError, match="distance-share 0.5 without --distances"):
        Synthesizer(tok, SynthSpec(lengths=[900], distance_share=0.5))
    with pytest.raises(DataError, match="distance-share 1.5"):
        Synthesizer(tok, SynthSpec(lengths=[900], distances=(100, 400), distance_share=1.5))
    # without --distances the documents are those of earlier versions, bit for bit (digest of this setup
    # computed before --distances existed)
    import hashlib

    h = hashlib.sha256()
    golden = TrainText(GOLDEN_TEXT(tmp_path), tok)
    for filler in ("kv", "text"):
        for tasks in (("kv", "multikv"), ("manyq",)):
            syn = Synthesizer(
                tok, SynthSpec(lengths=[(600, 3000)], tasks=tasks, fillers=(filler,), query_every=128, seed=7), golden
            )
            for i in range(6):
                ids, meta = syn.document(i)
                h.update(json.dumps([ids, meta["depths"]]).encode())
    assert h.hexdigest() == "5336c0b8538108de192df66685e664e728e159e9b560c55eb85b86aa79dc4f77"
    # the CLI writes the options into the manifest
    m = synth_dataset(
        tmp_path / "far", TOK, lengths=[900], docs=4, distances=(200, 400), distance_share=0.7, progress=False
    )
    assert m["synth"]["distances"] == [200, 400] and m["synth"]["distance_share"] == 0.7
    assert 0.5 <= m["synth"]["in_band"] <= 1.0  # what the documents got, not only what was asked for


def GOLDEN_TEXT(tmp_path):
    """The filler the golden digest was computed with: the stdlib's json package, val 0.3."""
    out = tmp_path / "golden_std"
    build_dataset(
        [Source(str(STDLIB / "json"), include=["*.py"])], TOK, out, val_fraction=0.3, workers=1, progress=False
    )
    return out


def test_repeat_filler_is_one_generated_block_repeated(tok):
    """filler repeat: the context is one block of generated lines repeated (thousands of identical lines),
    with the records inserted; the asked key once, its value on its line; licence: generated only."""
    syn = Synthesizer(tok, SynthSpec(lengths=[3000], tasks=("manyq",), fillers=("repeat",), query_every=512, seed=4))
    for i in range(4):
        ids, meta = syn.document(i)
        assert len(ids) == 3000 and meta["filler"] == "repeat" and "filler_sources" not in meta
        ctx = tok.decode(ids[: -meta["qa_tokens"]])
        lines = [ln for ln in ctx.split("\n") if ln]
        recs = [ln for ln in lines if any(k in ln for k in meta["asked"])]
        assert len(recs) == len(meta["asked"])
        filler = [ln for ln in lines if ln not in recs]
        common = max(set(filler), key=filler.count)
        assert filler.count(common) > 0.8 * len(filler) and filler.count(common) > 20, (i, set(filler))
        for k, v in zip(meta["asked"], meta["answer"]):
            assert ctx.count(k) == 1 and any(k in ln and v in ln for ln in recs)
