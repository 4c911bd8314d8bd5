"""RULER as published (megablu/eval/ruler, megablu/config/ruler_tasks.py): each task's text against
RULER's own (NVIDIA/RULER at c3f5e3b, transcribed here with file and line), its scoring against RULER's
string_match_all, exact lengths, cwe's distinct words up to 128k, the chat template against
transformers' apply_chat_template, the average and its threshold, bad input."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from megablu.config.ruler_tasks import RULER_PRESETS, RULER_TASKS
from megablu.config.schema import EvalConfig, TokenizerConfig, eval_problems
from megablu.data.tokenizer import load_tokenizer
from megablu.eval.harness import build_prompts, check_lengths, preflight_problems, run_eval
from megablu.eval.prompts import EvalError, Prompt, score
from megablu.eval.report import ruler_average
from megablu.eval.ruler import make_ruler_builder

# NVIDIA/RULER scripts/synthetic.yaml lines 15-112 (qa_1, qa_2 left out) with tokens_to_generate from
# scripts/data/synthetic/constants.py lines 26, 32, 38, 44
SYNTHETIC_YAML = {
    "niah_single_1": (
        "niah",
        128,
        dict(
            type_haystack="noise",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_single_2": (
        "niah",
        128,
        dict(
            type_haystack="essay",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_single_3": (
        "niah",
        128,
        dict(
            type_haystack="essay",
            type_needle_k="words",
            type_needle_v="uuids",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_multikey_1": (
        "niah",
        128,
        dict(
            type_haystack="essay",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=4,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_multikey_2": (
        "niah",
        128,
        dict(
            type_haystack="needle",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_multikey_3": (
        "niah",
        128,
        dict(
            type_haystack="needle",
            type_needle_k="uuids",
            type_needle_v="uuids",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=1,
        ),
    ),
    "niah_multivalue": (
        "niah",
        128,
        dict(
            type_haystack="essay",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=1,
            num_needle_v=4,
            num_needle_q=1,
        ),
    ),
    "niah_multiquery": (
        "niah",
        128,
        dict(
            type_haystack="essay",
            type_needle_k="words",
            type_needle_v="numbers",
            num_needle_k=1,
            num_needle_v=1,
            num_needle_q=4,
        ),
    ),
    "vt": ("variable_tracking", 30, dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", 120, dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", 50, dict(alpha=2.0)),
}

# scripts/data/synthetic/constants.py lines 27-28 (niah), 33-34 (vt), 39-40 (cwe), 45-46 (fwe), verbatim
R_NIAH = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
    "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} "
    "for {query} mentioned in the provided text?"
)
R_NIAH_A = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
R_VT = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: "
    "Find all variables that are assigned the value {query} in the text above."
)
R_VT_A = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)
R_CWE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
R_CWE_A = " Answer: The top 10 words that appear most often in the list are:"
R_FWE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
R_FWE_A = " Answer: According to the coded text above, the three most frequently appeared words are:"
# niah.py line 83 (needle), line 89 (noise); variable_tracking.py lines 108-112 (chain lines)
R_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
R_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def r_niah_text(context: str, query: str, tv: str, singular: bool) -> str:
    """niah.py lines 189-204 with prepare.py line 101 (template + answer prefix, base model)."""
    template = R_NIAH + R_NIAH_A
    if singular:  # niah.py lines 193-198
        template = template.replace("Some", "A")
        template = template.replace("are all", "is")
        template = template.replace("are", "is")
        template = template.replace("answers", "answer")
        tv = tv[:-1]
    return template.format(type_needle_v=tv, context=context, query=query)


def r_string_match_all(preds, refs):
    """scripts/eval/synthetic/constants.py lines 28-30, after evaluate.py's postprocess_pred (lines 51-58)."""
    preds = [re.compile(r"[\x00-\x1f]").sub("\n", p.strip()).strip() for p in preds]
    score = (
        sum(
            [sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref) for pred, ref in zip(preds, refs)]
        )
        / len(preds)
        * 100
    )
    return round(score, 2)


@pytest.fixture(scope="module")
def byte_tok():
    return load_tokenizer(TokenizerConfig(kind="byte"))


def _b(task, tok, n=3, seed=0, chat="auto", essay=None):
    return make_ruler_builder(task, RULER_PRESETS[task], tok, seed, n, chat, essay=essay)


def test_the_eleven_tasks_are_synthetic_yaml():
    assert RULER_TASKS == tuple(f"ruler_{t}" for t in SYNTHETIC_YAML)
    for name, (script, ttg, args) in SYNTHETIC_YAML.items():
        spec = RULER_PRESETS[f"ruler_{name}"]
        assert (spec.task, spec.tokens_to_generate) == (script, ttg), name
        assert {k: getattr(spec, k) for k in args} == args, name
    cfg = EvalConfig(suite="ruler", lengths=[4096])
    assert cfg.tasks == list(RULER_TASKS) and cfg.task_max_new("ruler_cwe") == 120
    assert EvalConfig(suite="ruler", tasks=["passkey"]).tasks == ["passkey", *RULER_TASKS]


def test_niah_noise_and_needle_texts_are_rulers(byte_tok):
    """The byte tokenizer decodes exactly: each prompt is RULER's text for its own keys, values and
    needle slots (niah.py: noise lines joined by newlines, the needles as lines, line 182)."""
    for task in ("ruler_niah_single_1", "ruler_niah_multikey_2", "ruler_niah_multikey_3"):
        b = _b(task, byte_tok)
        spec = RULER_PRESETS[task]
        p = b.build(2048, 1)
        assert len(p.ids) == 2048 - 128
        text = byte_tok.decode(list(p.ids))
        key = p.meta["keys"][0]
        needle = R_NEEDLE.format(type_needle_v=spec.type_needle_v, key=key, value=p.answer)
        head, rest = text.split("\n", 1)
        ctx = rest[: rest.rindex("\nWhat is")]
        lines = ctx.split("\n")
        assert needle in lines  # a line of its own
        others = [x for x in lines[:-1] if x != needle]
        if spec.type_haystack == "noise":
            assert set(others) == {R_NOISE} and R_NOISE.startswith(lines[-1])  # the last line cut
        else:  # the needle haystack: other keys' needles, same kinds (lines 171-176)
            kv = re.compile(
                re.escape(R_NEEDLE)
                .replace(r"\{type_needle_v\}", spec.type_needle_v)
                .replace(r"\{key\}", "(.+)")
                .replace(r"\{value\}", "(.+)")
            )
            assert all(kv.fullmatch(x) and kv.fullmatch(x).group(1) != key for x in others) and len(others) > 5
        assert text == r_niah_text(ctx, key, spec.type_needle_v, singular=True)


def test_niah_essay_multi_and_singular_texts(byte_tok):
    essay = "It was the best of times. It was the worst of times! Was it the age of wisdom? " * 400
    for task, sing in (
        ("ruler_niah_single_2", True),
        ("ruler_niah_multivalue", False),
        ("ruler_niah_multiquery", False),
        ("ruler_niah_multikey_1", True),
    ):
        spec = RULER_PRESETS[task]
        p = _b(task, byte_tok, essay=essay).build(3000, 2)
        text = byte_tok.decode(list(p.ids))
        q = (
            ", ".join(p.meta["keys"][:-1]) + ", and " + p.meta["keys"][-1]
            if len(p.meta["keys"]) > 1
            else p.meta["keys"][0]
        )
        start = text.index("afterwards.\n") + len("afterwards.\n")
        ctx = text[start : text.rindex("\nWhat ")]
        assert text == r_niah_text(ctx, q, "numbers", singular=sing), task
        # every needle between sentences of the essay (niah.py lines 155-166), answers in order
        found = re.findall(r"(?:^|[.!?]) One of the special magic numbers for ([\w-]+) is: (\d+)\.(?= |$)", ctx)
        asked = [v for k, v in found if k in p.meta["keys"]]
        assert (
            sorted(asked) == sorted(p.expected)
            and len(found) == spec.num_needle_k * spec.num_needle_v
            or len(found) == max(spec.num_needle_k, spec.num_needle_q) * spec.num_needle_v
        ), (task, found)


def test_essay_needles_go_between_sentences_not_inside_a_dotted_word(byte_tok):
    """A '.' inside '2.3', 'os.path' or 'e.g.x' ends no sentence: every needle follows '. ', '! ' or '? ' and is
    followed by a space (RULER splits the essay into sentences and inserts between them)."""
    essay = "Version 2.3 of os.path came out. It was fast, e.g.x was. Was it good? Yes! " * 300
    b = _b("ruler_niah_multivalue", byte_tok, n=12, essay=essay)  # 4 needles a prompt
    for index in range(12):
        p = b.build(3000, index)
        text = byte_tok.decode(list(p.ids))
        for m in re.finditer(r"One of the special magic numbers for [\w-]+ is: \d+\.", text):
            before, after = text[m.start() - 2 : m.start()], text[m.end() : m.end() + 1]
            assert before in (". ", "! ", "? ") and after in (" ", "\n"), (index, text[m.start() - 30 : m.end() + 10])


def test_vt_text_is_rulers(byte_tok):
    p = _b("ruler_vt", byte_tok).build(3000, 0)
    text = byte_tok.decode(list(p.ids))
    assert len(p.ids) == 3000 - 30
    value = p.meta["value"]
    ex, task = text.split("\n\n" + R_VT[:20], 1)
    # the worked example: RULER's template + answer prefix, a space, its 3-letter names, a newline (lines 216-218)
    m = re.fullmatch(
        re.escape(R_VT + R_VT_A)
        .replace(r"\{context\}", "(?P<ctx>.*)")
        .replace(r"\{query\}", r"(\d{5})")
        .replace(r"\{num_v\}", "5")
        + r" ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3})",
        ex,
        flags=re.S,
    )
    assert m, ex[-300:]
    ctx = (R_VT[:20] + task)[len(R_VT.split("{context}")[0]) : task.rindex("\nQuestion:") + 20]
    assert (R_VT[:20] + task) == (R_VT + R_VT_A).format(context=ctx, query=value, num_v=5)
    lines = ctx.split("\n")
    chain = [x for x in lines if x.startswith("VAR")]
    v = p.expected
    # variable_tracking.py lines 108-112: the value line, then the hops, each ending in a space, in order
    assert chain == [f"VAR {v[0]} = {value}"] + [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(4)]
    assert {x for x in lines[:-1] if not x.startswith("VAR")} == {R_NOISE} and not lines[-2].startswith("VAR")


def test_vt_example_within_500_tokens(bpe_tok):
    """main() line 304: the example is sized to max_seq_length=500 (its answer after that)."""
    p = _b("ruler_vt", bpe_tok).build(4096, 0)
    ex = bpe_tok.decode(list(p.ids)).split("\n\n" + R_VT[:20], 1)[0]
    assert 400 < len(bpe_tok.encode(ex[: ex.rindex("they are: ") + 10])) <= 500


def test_cwe_and_fwe_texts_are_rulers(byte_tok):
    p = _b("ruler_cwe", byte_tok).build(16384, 0)
    text = byte_tok.decode(list(p.ids))
    ex, main = text.split("\n" + R_CWE[:30], 1)
    main = R_CWE[:30] + main
    # the example: template + answer prefix + ' ' + the numbered answer (common_words_extraction.py line 120)
    ans = " ".join(f"{i + 1}. \\w[\\w -]*" for i in range(10))
    assert re.fullmatch(re.escape(R_CWE + R_CWE_A).replace(r"\{context\}", ".*") + " " + ans, ex, flags=re.S)
    body = main[main.index("often.\n") + 7 : main.index("\nQuestion:")].rstrip("\n")
    assert main == R_CWE.format(context=main[main.index("often.\n") + 7 : main.index("\nQuestion:")]) + R_CWE_A
    nums = [int(x) for x in re.findall(r"(?:^| )(\d+)\. ", body)]
    assert nums == list(range(1, len(nums) + 1))  # "1. w 2. w ..." (line 96)
    c = Counter(re.split(r"(?:^| )\d+\. ", body)[1:])
    assert sorted(w for w, k in c.items() if k == 30) == sorted(p.expected)  # >= 4096: 30 and 3 times
    assert set(c.values()) == {30, 3}
    f = _b("ruler_fwe", byte_tok).build(4096, 0)
    text = byte_tok.decode(list(f.ids))
    ctx = text[len(R_FWE.split(" {context}")[0]) + 1 : text.index("\nQuestion:")].rstrip("\n")
    assert (
        text == R_FWE.format(context=text[len(R_FWE.split(" {context}")[0]) + 1 : text.index("\nQuestion:")]) + R_FWE_A
    )
    c = Counter(ctx.split(" "))
    top = [w for w, _ in c.most_common(4)]
    assert top[0] == "..." and top[1:] == list(f.expected)  # rank 1 is the noise (line 81)
    assert len(c) <= (4096 - 50) // 50  # vocab_size (lines 113-114)


@pytest.mark.parametrize("task", RULER_TASKS)
def test_exact_lengths_paired_and_seeded(task, bpe_tok):
    b = _b(task, bpe_tok, n=3)
    ttg = RULER_PRESETS[task].tokens_to_generate
    at = {L: [b.build(L, i) for i in range(3)] for L in (4096, 6000)}
    for L, ps in at.items():
        assert all(len(p.ids) == L - ttg and p.length == L for p in ps), task
        assert len({p.ids for p in ps}) == 3
        assert all(x.lower() in bpe_tok.decode(list(p.ids)).lower() for p in ps for x in p.expected)
    assert [p.expected for p in at[4096]] == [p.expected for p in at[6000]]  # lengths paired
    other = _b(task, bpe_tok, n=3, seed=1)
    assert all(other.build(4096, i).expected != at[4096][i].expected for i in range(3))
    m = b.min_length()
    b.build(m, 0)
    with pytest.raises(EvalError):
        b.build(m - 1, [i for i in range(3) if not _ok(b, m - 1, i)][0])


def _ok(b, L, i):
    try:
        b.build(L, i)
        return True
    except EvalError:
        return False


def test_stratified_depths_seed_permuted(bpe_tok):
    n = 10
    d0 = [_b("ruler_niah_single_1", bpe_tok, n=n).depth(i) for i in range(n)]
    d1 = [_b("ruler_niah_single_1", bpe_tok, n=n, seed=1).depth(i) for i in range(n)]
    assert sorted(int(d * n) for d in d0) == list(range(n)) == sorted(int(d * n) for d in d1)
    assert [int(d * n) for d in d0] != [int(d * n) for d in d1]


def _cwe_counts(tok, p):
    body = tok.decode(list(p.ids)).split("\n" + R_CWE[:30], 1)[1]
    body = body[body.index("often.\n") + 7 :]
    # entries "12. word" (wonderwords has a few two-word entries: 'ad hoc')
    return Counter(re.split(r"(?:^| )\d+\. ", body[: body.index("\nQuestion:")].rstrip("\n"))[1:])


def test_cwe_words_distinct_up_to_128k(bpe_tok, monkeypatch):
    """Every uncommon word exactly freq_ucw times at 32k and 128k in cl100k (wonderwords' 8,166 words hold
    131072 tokens here); a shorter first list switches to the longer one (RULER's english_words.json
    fallback), and a length past the longer one is an error, never a repeated word."""
    from megablu.eval.ruler import assets, words

    b = _b("ruler_cwe", bpe_tok, n=1)
    for L in (32768, 131072):
        p = b.build(L, 0)
        c = _cwe_counts(bpe_tok, p)
        assert p.meta["list"] == "wonderwords" and len(p.ids) == L - 120
        assert sorted(w for w, k in c.items() if k == 30) == sorted(p.expected)
        assert Counter(c.values()) == {30: 10, 3: len(c) - 10} and len(c) == p.meta["words"], L
    monkeypatch.setattr(words, "cwe_words", lambda: assets.cwe_words()[:2000])
    for L, lst in ((16384, "wonderwords"), (65536, "english_words")):
        p = _b("ruler_cwe", bpe_tok, n=1).build(L, 0)
        c = _cwe_counts(bpe_tok, p)
        assert p.meta["list"] == lst and len(p.ids) == L - 120
        assert Counter(c.values()) == {30: 10, 3: len(c) - 10} and len(c) == p.meta["words"], L
        assert (len(c) > 2000) == (lst == "english_words")
    monkeypatch.setattr(words, "english_words", lambda: assets.english_words()[:3000])
    with pytest.raises(EvalError, match="length 65536 needs more than the 3000 distinct words"):
        _b("ruler_cwe", bpe_tok, n=1).build(65536, 0)


def test_scoring_is_rulers_string_match_all():
    p = Prompt("ruler_niah_multivalue", 4096, 0, (1,), "", None, answers=("1234567", "Apple-Pie", "abc"), scoring="all")
    outs = [" 1234567, apple-pie and ABC.", "1234567", "\x00 APPLE-PIE\t1234567", "", "12345678 abcd", "none"]
    for o in outs:
        assert round(100 * score(o, p)[0], 2) == r_string_match_all([o], [list(p.expected)]), o


CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)  # SmolLM2-Instruct's


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    import json

    from tests.hf_tok import write_chat_tokenizer

    d = write_chat_tokenizer(
        tmp_path_factory.mktemp("chat"),
        "The grass is green. What are the special magic "
        "numbers for the text? Below is a numbered list of words. 0123456789",
        400,
    )
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return d


def test_chat_template_against_transformers(chat_dir):
    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(TokenizerConfig(kind="hf", path=str(chat_dir)))
    ref = PreTrainedTokenizerFast(tokenizer_file=str(chat_dir / "tokenizer.json"), chat_template=CHATML)
    p = _b("ruler_niah_single_1", tok, chat="auto").build(2048, 0)
    text = tok.decode(list(p.ids))
    user = text[text.index("<|im_start|>user\n") + 17 : text.index("<|im_end|>\n<|im_start|>assistant")]
    answer = " The special magic number for {k} mentioned in the provided text is".format(k=p.meta["keys"][0])
    want = ref.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    assert text == want + answer and p.meta["chat"] and len(p.ids) == 2048 - 128
    assert user.startswith("A special magic number is hidden") and user.endswith("mentioned in the provided text?")
    # cwe: the worked example as an earlier user turn and the assistant's answer
    c = _b("ruler_cwe", tok, n=1).build(2048, 0)
    text = tok.decode(list(c.ids))
    turns = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n", text, flags=re.S)
    assert [r for r, _ in turns] == ["system", "user", "assistant", "user"]
    msgs = [{"role": r, "content": x} for r, x in turns[1:]]
    assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + R_CWE_A
    assert turns[2][1].startswith(R_CWE_A.strip() + " 1. ")
    # off: plain text; on without a template: an error naming the field and the fix
    assert not _b("ruler_niah_single_1", tok, chat="off").build(2048, 0).meta["chat"]
    plain = load_tokenizer(TokenizerConfig(kind="tiktoken", name="cl100k_base"))
    with pytest.raises(
        EvalError,
        match=r"eval.chat_template=on but tokenizer tiktoken:cl100k_base\S* has no "
        r"chat template .*eval.chat_template: auto",
    ):
        _b("ruler_vt", plain, chat="on")
    cfg = EvalConfig(suite="ruler", lengths=[4096], n=1, chat_template="on")
    assert any("eval.chat_template=on" in x for x in preflight_problems(cfg, plain, 4096))


def test_lengths_count_the_budget_and_bad_input():
    """RULER's length L = prompt + tokens_to_generate: L == window fits (32768 on a 32768 window)."""
    cfg = EvalConfig(suite="ruler", lengths=[32768])
    check_lengths(cfg, 32768)
    assert eval_problems(cfg, 32768) == []
    errs = eval_problems(EvalConfig(suite="ruler", lengths=[32768 + 1]), 32768)
    assert any("ruler_cwe@32769" in e and "the longest length that fits is 32768" in e for e in errs), errs
    with pytest.raises(ValueError, match=r"eval.suite='rulr' is not a suite; known: \['ruler'\]"):
        EvalConfig(suite="rulr")
    with pytest.raises(ValueError, match="chat_template"):
        EvalConfig(chat_template="yes")
    # YAML 1.1 reads a bare `on` / `off` as a bool: it means the word
    assert [EvalConfig(chat_template=v).chat_template for v in (True, False)] == ["on", "off"]
    with pytest.raises(ValueError, match=r"eval.seed=True: a bool is not a seed \(true would reproduce seed 1's"):
        EvalConfig(seed=True)
    errs = eval_problems(EvalConfig(suite="ruler", lengths=[100]), 4096)
    assert any("[100] cannot hold task ruler_niah_single_1" in e for e in errs), errs


def test_average_and_threshold_are_rulers():
    """RULER's effective length: the largest length whose AVERAGE over the tasks is >= 85.6 -- a task
    under the threshold does not stop it, an average under it does."""

    def cell(t, L, k):
        return {"task": t, "length": L, "correct": k, "n": 100, "acc_pp": float(k)}

    acc = {4096: [100] * 10 + [50], 8192: [95] * 10 + [40], 16384: [85] * 11}
    cells = [cell(t, L, a[i]) for L, a in acc.items() for i, t in enumerate(RULER_TASKS)]
    avg = ruler_average(cells)
    assert [round(r["acc_pp"], 2) for r in avg["by_length"]] == [95.45, 90.0, 85.0]
    assert avg["effective_length"] == 8192 and avg["tasks"] == list(RULER_TASKS)
    # megablu's own tasks never enter RULER's average
    assert ruler_average([cell("cwe", 4096, 100)]) is None


def test_suite_builds_through_the_harness(bpe_tok):
    ps = build_prompts(EvalConfig(suite="ruler", lengths=[4096], n=2), bpe_tok)
    assert sorted(t for t, _ in ps) == sorted(RULER_TASKS)
    assert all(len(p.ids) == 4096 - RULER_PRESETS[t].tokens_to_generate for (t, _), v in ps.items() for p in v)


def test_run_eval_scores_and_averages_ruler_tasks(tmp_path, bpe_tok):
    """Through run_eval at length == window (the budget is inside the length): a reader that answers up to
    3000 prompt tokens scores 100 at 2048 and 0 at 4096; the report's RULER average says so."""
    from .conftest import OracleModel

    cfg = EvalConfig(tasks=["ruler_niah_single_1", "ruler_niah_multikey_2"], lengths=[2048, 4096], n=2, pad=64)
    res = run_eval(
        OracleModel(bpe_tok, max_ok_len=3000),
        bpe_tok,
        cfg,
        4096,
        step=0,
        out_dir=tmp_path / "eval",
        rank=0,
        plot=False,
        batch_tokens=8192,
    )
    acc = {(c["task"], c["length"]): c["acc_pp"] for c in res["cells"]}
    assert acc == {(t, L): 100.0 * (L == 2048) for t in cfg.tasks for L in (2048, 4096)}
    assert all(c["max_new"] == 128 and c["padded_len"] == c["length"] for c in res["cells"])
    assert res["ruler"]["effective_length"] == 2048 and res["megablu_suite"] is None
    assert "### RULER average" in (tmp_path / "eval" / "step_0.md").read_text()
