"""The lm-eval backend `megablu` (megablu/eval/lm_eval_adapter.py) against references computed here:
generate_until equals megablu's greedy decoding without a KV cache (the recompute path) token for token,
cut at the `until` strings; loglikelihood equals the continuation's log-probs summed from one full
forward of the unpadded sequence (rows of two lengths either side of YaRN's original_max_position in one
right-padded batch: each row must keep its own length-aware rope); loglikelihood_rolling on a text 3x
longer than the window equals lm-eval's documented windows scored directly; the chat template; sp=2 on
two gloo ranks equals one rank; and the documented command (`python -m megablu.eval.lm_eval_adapter
--model megablu ...`) runs a RULER task offline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval==0.4.13)")

from lm_eval.api.instance import Instance  # noqa: E402

from megablu.config.schema import RopeConfig, TokenizerConfig, YarnConfig  # noqa: E402
from megablu.data.tokenizer import load_tokenizer  # noqa: E402
from megablu.eval.generate import greedy_generate  # noqa: E402
from megablu.eval.lm_eval_adapter import CHATML, AdapterError, MegabluLM, strip_local_rank  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402

from .conftest import tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# beyond_original: a row of <= 24 tokens gets the original rope, a longer one YaRN
ROPE = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0, original_max_position=24, apply="beyond_original"))
WINDOW = 96


def _model(seed=3):
    return tiny_model(seed=seed, rope=ROPE).double()


def _lm(model, tok, **kw):
    return MegabluLM(model=model, tokenizer=tok, window=WINDOW, **kw)


def _req(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i, metadata=("t", i, 1))


def test_generate_until_equals_greedy_decoding(byte_tok):
    m = _model()
    prompts = [
        "The grass is green. The sky is",
        "Passkey 12345. Remember",
        "Passkey 67890. Remember",
        "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs! 0123",
    ]
    # two of equal length (one batch), and one cut from the left (90 + 24 > 96)
    max_new = 24
    refs = []
    for p in prompts:
        ids = byte_tok.encode(p)[-(WINDOW - max_new) :]
        g = greedy_generate(m, torch.tensor([ids]), max_new, use_cache=False)[0].tolist()  # no KV cache
        refs.append(byte_tok.decode(g[: g.index(byte_tok.eot_id)] if byte_tok.eot_id in g else g))  # up to EOT
    # `until`: a piece of each reference answer, so the answer must be cut there
    untils = [r[5:7] for r in refs]
    reqs = [
        _req("generate_until", (p, {"until": [u], "max_gen_toks": max_new, "do_sample": False}), i)
        for i, (p, u) in enumerate(zip(prompts, untils))
    ]
    out = _lm(m, byte_tok, batch_size="auto").generate_until(reqs)
    assert out == [r.split(u)[0] for r, u in zip(refs, untils)]
    assert all(len(o) < len(r) for o, r in zip(out, refs))  # every answer was cut at its until
    # no until: the whole answer
    req = _req("generate_until", (prompts[0], {"max_gen_toks": max_new}))
    out = _lm(m, byte_tok, batch_size=2).generate_until([req])
    assert out == [refs[0]]
    with pytest.raises(AdapterError, match="greedily"):
        _lm(m, byte_tok).generate_until([_req("generate_until", (prompts[0], {"do_sample": True}))])


def test_decode_model_arg_reaches_greedy_generate(byte_tok, monkeypatch):
    """decode= picks how greedy decoding runs (the config's eval.decode when loaded); a bad value or a
    one-rank mode under sp is refused at construction."""
    import megablu.eval.generate as generate

    seen = []
    real = generate.greedy_generate

    def spy(*a, **kw):
        seen.append(kw.get("decode"))
        return real(*a, **kw)

    monkeypatch.setattr(generate, "greedy_generate", spy)
    m = _model()
    req = _req("generate_until", ("The grass is green. The sky is", {"max_gen_toks": 8}))
    for mode, want in ((None, "auto"), ("eager", "eager"), ("static", "static")):
        kw = {} if mode is None else {"decode": mode}
        _lm(m, byte_tok, **kw).generate_until([req])
        assert seen[-1] == want
    with pytest.raises(AdapterError, match="decode='fast': one of auto, eager, static, graph"):
        _lm(m, byte_tok, decode="fast")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(AdapterError, match="sequence-parallel decode is eager"):
        _lm(m, byte_tok, sp=2, decode="graph")


def _direct_ll(m, ctx, cont):
    """sum log p(cont | ctx), greedy?: one forward of the unpadded sequence, every position's logits."""
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = F.log_softmax(m(ids[:, :-1])[0].double(), -1)  # (T-1, V); rope_len: this row's length
    pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    tgt = torch.tensor(cont)
    return float(logp[pos, tgt].sum()), bool((logp[pos].argmax(-1) == tgt).all())


def test_loglikelihood_equals_direct_log_probs(byte_tok):
    m = _model()
    pairs = [
        ("The sky is", " blue"),
        ("A much longer context, past the original positions:", " yes"),
        ("Q: 2+2? A:", " 4"),
        ("", "hello"),
    ]
    reqs = [_req("loglikelihood", pr, i) for i, pr in enumerate(pairs)]
    lm = _lm(m, byte_tok, batch_size=4)  # one right-padded batch of all four
    got = lm.loglikelihood(reqs)
    for (c, x), (lp, greedy) in zip(pairs, got):
        ctx = byte_tok.encode(c) if c else [byte_tok.eot_id]  # empty context: EOT as the prefix
        ref, ref_greedy = _direct_ll(m, ctx, byte_tok.encode(x))
        assert lp == pytest.approx(ref, rel=1e-9, abs=1e-9) and greedy == ref_greedy, (c, x)
    # a continuation the model predicts greedily (its own next tokens, in token space: a random model's bytes
    # need not decode), and the same with its last token changed
    ctx = byte_tok.encode("The sky is")
    g = greedy_generate(m, torch.tensor([ctx]), 3, use_cache=False)[0].tolist()
    (lp, greedy), (lp2, greedy2) = lm._loglikelihood_tokens([(None, ctx, g), (None, ctx, g[:2] + [(g[2] + 1) % 256])])
    assert greedy and lp == pytest.approx(_direct_ll(m, ctx, g)[0], rel=1e-9)
    assert not greedy2 and lp2 < lp


def test_loglikelihood_rolling_over_several_windows(byte_tok):
    m = _model()
    text = "Perplexity over a text longer than the window: every token is predicted exactly once. " * 3  # 261 bytes
    toks = byte_tok.encode(text)
    W = WINDOW
    assert len(toks) > 2 * W
    # lm-eval's windows (LM.loglikelihood_rolling docstring): the first predicts toks[:W] from EOT + toks[:W-1];
    # each next one the next W tokens (fewer at the end) with the W tokens before each as its input
    ref, start = 0.0, 0
    while start < len(toks):
        pred = toks[start : start + W]
        end = start + len(pred)
        inp = ([byte_tok.eot_id] + toks)[max(0, end - W) : end]  # W inputs ending just before toks[end-1]
        ctx, cont = inp[: len(inp) - len(pred) + 1], pred
        ref += _direct_ll(m, ctx, cont)[0]
        start = end
    got = _lm(m, byte_tok, batch_size=3).loglikelihood_rolling([_req("loglikelihood_rolling", (text,))])
    assert got[0] == pytest.approx(ref, rel=1e-9)


def test_chat_template(tmp_path, byte_tok):
    from tests.hf_tok import write_chat_tokenizer

    d = write_chat_tokenizer(tmp_path, "What is the special magic number? the quick fox", 300)
    tok = load_tokenizer(TokenizerConfig(kind="hf", path=str(d)))
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Number?"},
    ]
    lm = _lm(tiny_model(vocab=tok.vocab_size).double(), tok, tokenizer_path=str(d / "tokenizer.json"))
    text = lm.apply_chat_template(chat)
    assert text == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\nNumber?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert lm.chat_template(True) == CHATML and lm.chat_template(False) is None
    assert tok.encode(text).count(tok.encode("<|im_start|>")[0]) == 4  # the special tokens are one id each
    # the model's own template (tokenizer_config.json beside tokenizer.json) wins over ChatML
    (d / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"})
    )
    assert lm.apply_chat_template(chat[:1]) == "[user]Hi"
    # the template megablu's tokenizer loaded (the one its RULER suite wraps prompts in) is lm-eval's too,
    # with no tokenizer path given (bench/ruler_oracle.py builds the backend from a loaded tokenizer)
    (d / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    own = load_tokenizer(TokenizerConfig(kind="hf", path=str(d)))
    assert own.chat_template.startswith("{% for m in messages %}<")
    assert _lm(tiny_model(vocab=own.vocab_size).double(), own).apply_chat_template(chat[:1]) == "<user>Hi"
    with pytest.raises(AdapterError, match="no chat template"):
        _lm(_model(), byte_tok).apply_chat_template(chat)


TRIM = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.mark.parametrize("template", [None, TRIM], ids=["chatml", "trimming"])
def test_a_gen_prefix_is_continued_as_transformers_does(tmp_path, template):
    """lm-eval renders a task's gen_prefix (RULER's "The special magic number for X ... is") as a final
    assistant message with add_generation_prompt=False, and its HF backend passes
    continue_final_message=True: the prompt must end with the prefix, not with the turn closed."""
    from transformers import PreTrainedTokenizerFast

    from tests.hf_tok import write_chat_tokenizer

    d = write_chat_tokenizer(tmp_path, "What is the special magic number? the quick fox", 300)
    tok = load_tokenizer(TokenizerConfig(kind="hf", path=str(d)))
    kw = {} if template is None else {"chat_template": str(tmp_path / "t.jinja")}
    if template is not None:
        (tmp_path / "t.jinja").write_text(template)
    lm = _lm(tiny_model(vocab=tok.vocab_size).double(), tok, tokenizer_path=str(d / "tokenizer.json"), **kw)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), chat_template=template or CHATML)
    for prefix in ["The special magic number is", "The answer is: ", " trailing space "]:
        chat = [{"role": "user", "content": "Number?"}, {"role": "assistant", "content": prefix}]
        got = lm.apply_chat_template(chat, add_generation_prompt=False)
        want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=False, continue_final_message=True)
        assert got == want and got.rstrip().endswith(prefix.strip())
        # with a generation prompt nothing is cut: the template's own rendering
        full = ref.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
        assert lm.apply_chat_template(chat[:1], add_generation_prompt=True) == full


def _rope(orig, factor):
    yarn = YarnConfig(factor=factor, original_max_position=orig, apply="beyond_original")
    return RopeConfig(theta=10000.0, yarn=yarn)


def _config(tmp_path, orig=128, factor=4.0, seed=3):
    """A YAML and a bare weights file (it records no rope): window orig * factor, YaRN beyond orig."""
    from safetensors.torch import save_file

    rope = _rope(orig, factor)
    cfg = {
        "name": "tiny",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "vocab_size": 257},
        "rope": rope.model_dump(mode="json"),
        "tokenizer": {"kind": "byte"},
        "data": {"window": int(orig * factor)},
        "train": {"max_steps": 10, "tokens_per_step": 512, "dtype": "fp32", "device": "cpu"},
        "schedule": {"kind": "cosine", "lr": 1e-3, "warmup_steps": 1},
    }
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(cfg))
    ck = tmp_path / "step_5" / "model.safetensors"
    ck.parent.mkdir()
    save_file({k: v.contiguous() for k, v in tiny_model(seed=seed).state_dict().items()}, str(ck))
    return p, ck


def test_loaded_from_config_and_checkpoint(tmp_path, byte_tok):
    cfg, ck = _config(tmp_path)
    with pytest.raises(AdapterError, match="rope_override=True"):  # a bare weights file records no rope
        MegabluLM(config=str(cfg), ckpt=str(ck), device="cpu")
    with pytest.raises(AdapterError, match="drop tokenizer="):  # RULER's docs say tokenizer=; not here
        MegabluLM(config=str(cfg), ckpt=str(ck), tokenizer="gpt2")
    with pytest.raises(AdapterError, match="unknown megablu model_args.*pretrained"):
        MegabluLM(config=str(cfg), ckpt=str(ck), pretrained="gpt2")
    # overrides joined by ';' (a ',' separates model_args): YaRN x8 from 32 positions, window 256
    lm = MegabluLM(
        config=str(cfg),
        ckpt=str(ck),
        rope_override="True",
        device="cpu",
        set="rope.yarn.original_max_position=32;data.window=256;rope.yarn.factor=8.0",
    )
    assert lm.max_length == 256 and lm.info["rope_override"]["differences"] == ["rope: not recorded"]
    assert lm.decode == "auto"  # the config's eval.decode
    eager = MegabluLM(config=str(cfg), ckpt=str(ck), rope_override="True", device="cpu", set="eval.decode=eager")
    assert eager.decode == "eager"
    ref = tiny_model(seed=3, rope=_rope(32, 8.0))  # the same weights with the overridden rope, built here
    ctx = byte_tok.encode("A context longer than the 32 original positions: is the sky")
    want = _direct_ll(ref, ctx, byte_tok.encode(" blue"))[0]
    got = lm.loglikelihood([_req("loglikelihood", (byte_tok.decode(ctx), " blue"))])[0][0]
    assert got == pytest.approx(want, rel=1e-5)
    plain = _direct_ll(tiny_model(seed=3, rope=_rope(128, 4.0)), ctx, byte_tok.encode(" blue"))[0]
    assert abs(plain - want) > 1e-4  # the override changed the numbers (not the YAML's rope)


def _sp_worker(rank, world, cfg, ck, prompts, pairs, text):
    from megablu.eval.lm_eval_adapter import MegabluLM

    lm = MegabluLM(config=cfg, ckpt=ck, rope_override=True, sp=2, device="cpu")
    gen = lm.generate_until([_req("generate_until", (p, {"max_gen_toks": 12}), i) for i, p in enumerate(prompts)])
    ll = lm.loglikelihood([_req("loglikelihood", pr, i) for i, pr in enumerate(pairs)])
    roll = lm.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))])
    return gen, ll, roll


def test_sp2_equals_one_rank(tmp_path):
    cfg, ck = _config(tmp_path, orig=32, factor=4.0)  # window 128
    prompts = ["The grass is green. The sky is blue. Passkey 4821.", "odd length!"]  # 51 and 11 bytes
    # 40 and 66 tokens: each rank's slice of the first is <= 32 (the original positions), the row is not
    pairs = [
        ("Q: past the 32 original positions? A:", " yes"),
        ("The sky is, in a much longer question, what colour? A:", " blue"),
    ]
    text = "Rolling windows of 128 tokens under sequence parallelism, every token scored once. " * 2
    gen, ll, roll = run_distributed(_sp_worker, 2, str(cfg), str(ck), prompts, pairs, text)
    one = MegabluLM(config=str(cfg), ckpt=str(ck), rope_override=True, device="cpu")
    assert gen == one.generate_until([_req("generate_until", (p, {"max_gen_toks": 12})) for p in prompts])
    for (a, ga), (b, gb) in zip(ll, one.loglikelihood([_req("loglikelihood", pr) for pr in pairs])):
        assert a == pytest.approx(b, rel=1e-5) and ga == gb
    assert roll[0] == pytest.approx(one.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))])[0], rel=1e-5)


@pytest.mark.e2e
def test_documented_command_runs_ruler_offline(tmp_path):
    """The command docs/EVAL.md gives, on a tiny checkpoint: lm-eval's niah_single_1 at one short
    length, offline (no HF download: RULER's prompts sized with megablu's byte tokenizer)."""
    cfg, ck = _config(tmp_path)  # window 512
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(ROOT),
        "TOKENIZERS_PARALLELISM": "false",
    }
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "megablu.eval.lm_eval_adapter",
        "--model",
        "megablu",
        "--model_args",
        f"config={cfg},ckpt={ck},rope_override=True",
        "--tasks",
        "niah_single_1",
        "--metadata",
        '{"max_seq_lengths": [512]}',
        "--limit",
        "2",  # lm-eval's --device cuda:0: no CUDA here
        "--output_path",
        str(out),
        "--log_samples",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "niah_single_1" in r.stdout and "|512" in r.stdout.replace(" ", "")
    samples = sorted(out.rglob("samples_niah_single_1_*.jsonl"))
    assert samples, list(out.rglob("*"))
    rows = [json.loads(x) for x in samples[0].read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:  # the prompt was sized with megablu's tokenizer: bytes <= 512 - 128 (RULER's answer budget)
        prompt = row["arguments"]["gen_args_0"]["arg_0"]
        assert 300 < len(prompt.encode()) <= 512 - 128 + 80, len(prompt.encode())  # + gen_prefix


def test_launcher_local_rank_dropped():
    argv = ["--model", "megablu", "--local_rank=1", "--tasks", "x", "--local_rank", "0", "--limit", "2"]
    assert strip_local_rank(argv) == ["--model", "megablu", "--tasks", "x", "--limit", "2"]
