"""Prompts: exact lengths in the model's tokenizer, seeded determinism, keys paired across lengths,
needles where they should be, and the errors that replace an empty report."""

import re

import pytest

from megablu.config.schema import EvalConfig
from megablu.eval.harness import build_prompts, check_lengths
from megablu.eval.needle import Haystack, NeedleBuilder
from megablu.eval.passkey import NEEDLE, PasskeyBuilder
from megablu.eval.prompts import EvalError, is_correct, prompt_digest

LENGTHS = [300, 777, 2048]


@pytest.mark.parametrize("tok_name", ["byte_tok", "bpe_tok"])
def test_passkey_exact_length_and_content(request, tok_name):
    tok = request.getfixturevalue(tok_name)
    b = PasskeyBuilder(tok, seed=3, n=10)
    for L in LENGTHS:
        for i in range(10):
            p = b.build(L, i)
            assert len(p.ids) == L
            text = tok.decode(list(p.ids))
            assert text.startswith("There is an important info hidden")
            assert text.endswith("What is the pass key? The pass key is")
            assert text.count(f"The pass key is {p.answer}. Remember it. {p.answer} is the pass key.") == 1
            assert re.fullmatch(r"\d{5}", p.answer)
    # the same prompt index carries the same key at every length (lengths are paired)
    assert len({b.build(L, 4).answer for L in LENGTHS}) == 1


def test_passkey_depth_is_where_the_needle_is(bpe_tok):
    n = 8
    b = PasskeyBuilder(bpe_tok, seed=0, n=n)
    L = 4000
    ps = [b.build(L, i) for i in range(n)]
    # stratified: one prompt per stratum [k/n, (k+1)/n) (up to one filler sentence of snapping), the
    # k-th shallowest in stratum k; which prompt holds which stratum is the seed's (tests/eval/test_seeds.py)
    slack = len(b.unit) / (L - b.min_length())
    for k, p in enumerate(sorted(ps, key=lambda p: p.depth)):
        assert k / n - slack <= p.depth <= (k + 1) / n + slack
    assert [p.index for p in sorted(ps, key=lambda p: p.depth)] != list(range(n))
    for p in ps:
        needle = bpe_tok.encode(NEEDLE.format(key=p.answer))
        pos = p.meta["needle_pos"]
        assert list(p.ids[pos : pos + len(needle)]) == needle


def test_passkey_depth_range_keeps_every_key_far_from_the_question(bpe_tok):
    """task_defs {family: passkey, depth: [0, 0.3]}: every needle in the first 30% of the filler,
    stratified inside it; a variant seeded by its own name; a range that is no range is refused."""
    from pydantic import ValidationError

    cfg = EvalConfig(
        lengths=[992], tasks=["passkey", "far"], n=20, task_defs={"far": {"family": "passkey", "depth": [0.0, 0.3]}}
    )
    by = {task: ps for (task, _), ps in build_prompts(cfg, bpe_tok).items()}
    unit = len(
        bpe_tok.encode("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
    )
    slack = unit / 900
    far = sorted(p.depth for p in by["far"])
    assert max(far) <= 0.3 + slack and far[-1] - far[0] > 0.2  # spread over the range, not bunched
    assert max(p.depth for p in by["passkey"]) > 0.6  # the default still spans it all
    for k, p in enumerate(sorted(by["far"], key=lambda p: p.depth)):  # stratified inside [0, 0.3]
        assert 0.3 * k / 20 - slack <= p.depth <= 0.3 * (k + 1) / 20 + slack
    assert [p.answer for p in by["far"]] != [p.answer for p in by["passkey"]]  # its own keys
    for bad in ([0.5, 0.2], [0.0, 1.5], [0.3, 0.3]):
        with pytest.raises(ValidationError, match="needs 0 <= lo < hi <= 1"):
            EvalConfig(lengths=[992], tasks=["far"], task_defs={"far": {"family": "passkey", "depth": bad}})


def test_prompts_are_deterministic_and_seeded(bpe_tok, haystack_docs):
    cfg = EvalConfig(lengths=[512, 1500], tasks=["passkey", "needle", "multikey"], n=6, seed=7)
    a = build_prompts(cfg, bpe_tok, haystack=haystack_docs)
    b = build_prompts(cfg, bpe_tok, haystack=lambda: iter(haystack_docs))  # a callable source, same text
    assert a == b
    assert {k: prompt_digest(v) for k, v in a.items()} == {k: prompt_digest(v) for k, v in b.items()}
    c = build_prompts(cfg.model_copy(update={"seed": 8}), bpe_tok, haystack=haystack_docs)
    assert all(prompt_digest(a[k]) != prompt_digest(c[k]) for k in a)
    # adding a length leaves the other lengths' prompts unchanged
    d = build_prompts(cfg.model_copy(update={"lengths": [512, 1000, 1500]}), bpe_tok, haystack=haystack_docs)
    assert all(d[k] == a[k] for k in a)
    for (_task, L), ps in a.items():
        assert len(ps) == 6 and all(len(p.ids) == L for p in ps)


@pytest.mark.parametrize("task", ["needle", "multikey"])
def test_needle_in_real_text(bpe_tok, haystack_docs, task):
    hay = Haystack(haystack_docs, bpe_tok, 2 * 3000)
    b = NeedleBuilder(task, bpe_tok, seed=1, n=5, haystack=hay)
    for i in range(5):
        p = b.build(3000, i)
        assert len(p.ids) == 3000
        text = bpe_tok.decode(list(p.ids))
        key = p.meta["key"]
        assert text.count(f"One of the special magic numbers for {key} is: {p.answer}.") == 1
        assert text.endswith(f"The special magic number for {key} mentioned in the provided text is")
        assert "def " in text  # the haystack is the real stdlib text
        distractors = p.meta["distractors"]
        assert len(distractors) == (3 if task == "multikey" else 0)
        for k, v in distractors:
            assert k != key and v != p.answer
            assert f"One of the special magic numbers for {k} is: {v}." in text
        # the needle starts right after a sentence end or newline (snapped), or at the exact depth
        pos = text.index("One of the special magic numbers for " + key)
        assert 0.0 <= p.depth <= 1.0 and pos > 0


def test_scoring_is_exact_digits():
    assert is_correct(" 43140. Remember it.", "43140")
    assert not is_correct(" 4314", "43140")
    assert not is_correct(" 431400", "43140")
    assert not is_correct(" the key", "43140")
    assert is_correct("43140", "43140")


def test_pad_rule_is_the_seeds():
    ok = EvalConfig(lengths=[1024, 4096, 16360, 32744], max_new=24, pad=256)
    check_lengths(ok, 32768)  # 32744 + 24 = 32768 exactly
    bad = ok.model_copy(update={"lengths": [32745]})
    with pytest.raises(EvalError, match=r"32745 \+ max_new 24 pads to 33024 .*longest that fits is 32744"):
        check_lengths(bad, 32768)
    with pytest.raises(EvalError, match="empty"):
        check_lengths(EvalConfig(lengths=[]), 32768)


def test_errors_instead_of_empty_reports(byte_tok):
    cfg = EvalConfig(lengths=[512], tasks=["passkey"], n=2)
    with pytest.raises(EvalError, match="no tokenizer"):
        build_prompts(cfg, None)
    with pytest.raises(EvalError, match="haystack"):
        build_prompts(cfg.model_copy(update={"tasks": ["needle"]}), byte_tok)
    with pytest.raises(EvalError, match="only .* tokens of text"):
        build_prompts(cfg.model_copy(update={"tasks": ["needle"]}), byte_tok, haystack="too short")
    with pytest.raises(EvalError, match="shorter than the prompt"):
        build_prompts(cfg.model_copy(update={"lengths": [50]}), byte_tok)
    with pytest.raises(EvalError, match="outside the model vocabulary"):
        build_prompts(cfg, byte_tok, vocab_size=100)
