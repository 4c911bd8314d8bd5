"""The decode loop (eval/decode.py): every way of running the steps gives the tokens that recomputing the whole
sequence gives, up to each row's first stop (stop_ids[0] after it): eager steps that drop the rows that are done,
shape-stable static steps over the whole cache with a mask, and (on a GPU) their CUDA graph. Several prompt
lengths and batch sizes, rows stopping at different steps, GQA, YaRN (always and beyond_original), a RULER
prompt in a chat template end to end."""

import functools

import pytest
import torch

from megablu.config.schema import EvalConfig, RopeConfig, YarnConfig
from megablu.eval import decode as dec, harness
from megablu.eval.generate import _generate_recompute, greedy_generate, new_cache

from .conftest import tiny_model

YARN = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0, original_max_position=64))
YARN_BEYOND = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0, original_max_position=64, apply="beyond_original"))
MAX_NEW = 10


def _model(rope=None, seed=1, **kw):
    """A tiny fp64 model (no argmax near-ties) whose attention matters: at init_std 0.02 the logits barely
    depend on which keys a token sees, so a step that attends to the wrong keys could still pick the same
    tokens. Scaling q/k and v/o by 8 makes each key count."""
    m = tiny_model(vocab=97, h=4, kv=2, rope=rope, seed=seed, **kw).double()
    with torch.no_grad():
        for layer in m.layers:
            a = layer.self_attn
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                lin.weight *= 8
    return m


def _prompts(B, L, vocab, seed=0):
    return torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(seed))


def _expected(ref: torch.Tensor, stops: tuple) -> torch.Tensor:
    """Each row of `ref` (decoded on to max_new) up to and with its first stop, stops[0] after it."""
    out = ref.clone()
    for r in range(ref.shape[0]):
        hit = [i for i, t in enumerate(ref[r].tolist()) if t in stops]
        if hit:
            out[r, hit[0] + 1 :] = stops[0]
    return out


def _stops_at_different_steps(ref: torch.Tensor) -> tuple:
    """Stop ids that end rows at different steps: the token some row emits first at the earliest step >= 1
    (no row has it sooner), and one another row emits first at a later step, if any."""
    first = {}  # token -> its earliest (step, row)
    for r in range(ref.shape[0]):
        for i, t in enumerate(ref[r].tolist()):
            first[t] = min(first.get(t, (i, r)), (i, r))
    news = sorted((i, r, t) for t, (i, r) in first.items() if i >= 1)
    if not news:
        return ()
    i0, r0, t0 = news[0]
    later = [t for i, r, t in news if r != r0 and i > i0]
    return (t0,) + tuple(later[:1])


@pytest.mark.parametrize("rope", [None, YARN, YARN_BEYOND], ids=["rope", "yarn", "yarn_beyond"])
@pytest.mark.parametrize("B,L", [(1, 5), (3, 37), (4, 130)])
def test_every_mode_equals_recompute(rope, B, L):
    m = _model(rope)
    ids = _prompts(B, L, 97, seed=L)
    ref = _generate_recompute(m, ids, MAX_NEW)
    for mode in ("eager", "static"):
        assert torch.equal(greedy_generate(m, ids, MAX_NEW, prefill_chunk=16, decode=mode), ref), mode
    stops = _stops_at_different_steps(ref)
    assert stops, "no row emits a new token after its first for this seed"
    want = _expected(ref, stops)
    ends = {next((i for i, t in enumerate(r) if t in stops), MAX_NEW) for r in want.tolist()}
    assert min(ends) < MAX_NEW - 1 and (B == 1 or len(ends) > 1), ends  # rows end at different steps (or never)
    for mode in ("eager", "static"):
        got = greedy_generate(m, ids, MAX_NEW, prefill_chunk=0, stop_ids=stops, decode=mode)
        assert torch.equal(got, want), (mode, got, want)


def test_float32_and_gqa_one_kv_head():
    """SmolLM2's head layout (3 query heads, 1 kv head) in fp32: the masked step groups the query heads."""
    m = tiny_model(vocab=97, d=24, h=3, kv=1, rope=YARN, seed=3)
    ids = _prompts(2, 70, 97, seed=4)
    ref = greedy_generate(m, ids, MAX_NEW, decode="eager")
    assert torch.equal(greedy_generate(m, ids, MAX_NEW, decode="static"), ref)


def test_early_exit_drops_only_done_rows(monkeypatch):
    """Eager steps drop a row once it has emitted a stop (its cache row too) and never another: each row of a
    batch decodes as it would alone, and the batch shrinks as rows end."""
    m = _model()
    ids = _prompts(4, 37, 97, seed=37)
    ref = _generate_recompute(m, ids, MAX_NEW)
    stops = _stops_at_different_steps(ref)
    kept = []
    real = dec._eager

    def spy_rows(model, tok, cache, *a):
        def keep_rows(rows, _real=cache.keep_rows):
            kept.append(rows.tolist())
            _real(rows)

        cache.keep_rows = keep_rows
        return real(model, tok, cache, *a)

    monkeypatch.setattr(dec, "_eager", spy_rows)
    got = greedy_generate(m, ids, MAX_NEW, stop_ids=stops, decode="eager")
    assert torch.equal(got, _expected(ref, stops))
    assert kept and len(kept[0]) < 4  # a row left the batch
    for b in range(4):
        alone = greedy_generate(m, ids[b : b + 1], MAX_NEW, stop_ids=stops, decode="eager")
        assert torch.equal(alone, got[b : b + 1]), b
    # the growing KVCache (torch.cat per token; bench/eval_bench.py's before-the-change path) drops rows alike
    from megablu.eval import generate
    from megablu.model.decoder import KVCache

    monkeypatch.setattr(
        generate,
        "new_cache",
        lambda model, capacity, rope_len, seq_sharded=False: KVCache(
            model.cfg.n_layers, seq_sharded=seq_sharded, rope_len=rope_len
        ),
    )
    n = len(kept)
    assert torch.equal(greedy_generate(m, ids, MAX_NEW, stop_ids=stops), got) and len(kept) > n


def test_modes_are_checked():
    m = tiny_model(vocab=97, seed=1)
    ids = _prompts(1, 9, 97)
    with pytest.raises(ValueError, match="decode='fast' is not one of"):
        greedy_generate(m, ids, 4, decode="fast")
    with pytest.raises(ValueError, match="not on a GPU"):
        greedy_generate(m, ids, 4, decode="graph")
    assert dec.resolve_mode("auto", m, None, 8, one_rank=False) == "eager"
    cache = new_cache(m, 20, 20)
    assert dec.resolve_mode("auto", m, cache, 8, one_rank=True) == "eager"  # a CPU model
    from megablu.config.schema import StringConfig
    from megablu.model.string import apply_string

    apply_string(m, StringConfig(variant="fixed_shift", shift=6, local=2))
    with pytest.raises(ValueError, match="STRING attention"):
        greedy_generate(m, ids, 4, decode="static")
    m = tiny_model(vocab=97, seed=1)
    m.layers[1].mlp.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="forward hooks on layers.1.mlp"):
        greedy_generate(m, ids, 4, decode="static")
    m = tiny_model(vocab=97, seed=1)
    m.norm.weight.ds_id = 3  # what DeepSpeed's ZeRO-3 puts on a partitioned parameter
    assert "ZeRO-3" in dec.graph_problem(m, cache)


def test_sliding_window_layer():
    """Gemma's sliding-window layers attend through their own mask: static steps run it on the same keys."""
    m = _model()
    m.layers[0].self_attn.core.window = 5
    ids = _prompts(2, 40, 97, seed=6)
    ref = _generate_recompute(m, ids, MAX_NEW)
    assert torch.equal(greedy_generate(m, ids, MAX_NEW, decode="eager"), ref)
    assert torch.equal(greedy_generate(m, ids, MAX_NEW, decode="static"), ref)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """A small byte-level BPE tokenizer with SmolLM2-Instruct's special tokens and chat template."""
    import json

    from megablu.config.schema import TokenizerConfig
    from megablu.data.tokenizer import load_tokenizer
    from tests.eval.test_ruler import CHATML
    from tests.hf_tok import write_chat_tokenizer

    d = write_chat_tokenizer(
        tmp_path_factory.mktemp("chat"),
        "The grass is green. What are the special magic numbers for the text? 0123456789",
        300,
    )
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return load_tokenizer(TokenizerConfig(kind="hf", path=str(d)))


def test_ruler_prompt_in_chat_template_same_samples(tmp_path, chat_tok, monkeypatch):
    """A whole run_eval of a RULER task wrapped in the chat template, with the tokenizer's stop ids (EOT and
    <|im_end|>): static steps score the same samples as eager ones, the turn ending early (the random model's
    vocabulary permuted so that its 6th token is <|im_end|>; its rows are alike at this size)."""
    task, L = "ruler_niah_single_1", 1024
    cfg = EvalConfig(lengths=[L], tasks=[task], n=4, pad=32, chat_template="on")
    m = tiny_model(vocab=chat_tok.vocab_size, seed=2).double()
    ids = torch.tensor([p.ids for p in harness.build_prompts(cfg, chat_tok)[(task, L)]])
    t, im_end = int(greedy_generate(m, ids[:1], 8)[0, 5]), chat_tok.stop_ids[-1]
    with torch.no_grad():
        w = m.lm_head.weight
        w[[t, im_end]] = w[[im_end, t]]
    outs = {}
    for mode in ("eager", "static"):
        monkeypatch.setattr(harness, "greedy_generate", functools.partial(greedy_generate, decode=mode))
        res = harness.run_eval(m, chat_tok, cfg, 2048, step=0, out_dir=tmp_path / mode, rank=0, plot=False)
        outs[mode] = [s["output"] for s in res["samples"]]
    assert outs["eager"] == outs["static"]
    raw = greedy_generate(m, ids, 16, stop_ids=chat_tok.stop_ids)
    assert (raw[:, 5] == im_end).all() and (raw[:, 6:] == chat_tok.stop_ids[0]).all()  # the turn ends at 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rope", [None, YARN_BEYOND], ids=["rope", "yarn_beyond"])
def test_cuda_graph_equals_eager(rope, monkeypatch):
    """The captured step replays the eager one token for token (the same kernels on the same shapes, the
    attention run uncaptured as LocalAttention runs it), in fp32 and bf16, with rows stopping at different
    steps; and it really is replayed (a failed capture would fall back to uncaptured steps)."""
    replays = []
    real = dec._Step.replay

    def counting(self):
        replays.append(1)
        real(self)

    monkeypatch.setattr(dec._Step, "replay", counting)
    for dtype in (torch.float32, torch.bfloat16):
        m = tiny_model(vocab=97, h=4, kv=2, rope=rope, seed=1).to("cuda", dtype)
        ids = _prompts(3, 150, 97, seed=5).cuda()
        ref = greedy_generate(m, ids, 40, decode="eager")
        n = len(replays)
        assert torch.equal(greedy_generate(m, ids, 40, decode="graph"), ref), dtype
        assert len(replays) - n == 39 - dec.WARM
        stops = (int(ref[0, 3]), int(ref[2, 20]))
        want = greedy_generate(m, ids, 40, decode="eager", stop_ids=stops)
        assert torch.equal(greedy_generate(m, ids, 40, decode="graph", stop_ids=stops), want), dtype
        assert torch.equal(greedy_generate(m, ids, 40, stop_ids=stops), want), dtype
        auto = dec.resolve_mode("auto", m, new_cache(m, 190, 190), 39, one_rank=True)
        assert auto == ("graph" if dec.AUTO_GRAPH else "eager")
