"""rope.yarn.apply=beyond_original: the original RoPE up to original_max_position tokens, YaRN beyond.

References are the two models it switches between, with the same weights: the native
(no-YaRN) model and the always-YaRN model. Whole sequences must match them bit for bit
(the per-token table select does the same fp32 products); packed rows and generation
within fp32 tolerance (other kernels / summation orders).
"""

import pytest
import torch

from megablu.config.load import ConfigError, build_config
from megablu.config.schema import RopeConfig, YarnConfig, config_warnings
from megablu.eval.generate import greedy_generate
from megablu.model.decoder import BluModel, KVCache
from megablu.model.hf import RopeExportError, hf_config_dict, to_hf
from megablu.model.packing import document_positions
from megablu.parallel.groups import Groups
from megablu.parallel.sequence import shard_batch
from tests.model.test_doc_mask import TOL, VOCAB, alone, bounds, cfg, grads_of, packed

ORIG = 32
NATIVE = RopeConfig(theta=10000.0)
ALWAYS = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0, original_max_position=ORIG))
BEYOND = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0, original_max_position=ORIG, apply="beyond_original"))


def model(rope, init_std=0.02):
    m = BluModel(cfg().model_copy(update={"init_std": init_std}), rope)
    m.reset_parameters(seed=0)
    return m.eval()


def ids_of(T, B=2, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize("T", [5, ORIG])
def test_short_sequence_equals_native_model_exactly(T):
    ids = ids_of(T)
    assert torch.equal(model(BEYOND)(ids), model(NATIVE)(ids))
    assert not torch.equal(model(ALWAYS)(ids), model(NATIVE)(ids))  # the switch matters here


@torch.no_grad()
@pytest.mark.parametrize("T", [ORIG + 1, 3 * ORIG])
def test_long_sequence_equals_always_yarn_exactly(T):
    ids = ids_of(T)
    assert torch.equal(model(BEYOND)(ids), model(ALWAYS)(ids))


def test_packed_row_mixing_both_equals_each_document_under_its_rope():
    """doc_mask: each document's own length decides (20, 7 and 1 tokens: original; 40: YaRN)."""
    lengths = [20, 40, 7, 1]
    ids, labels, doc = packed(lengths, seed=4)
    m, native, yarn = model(BEYOND).train(), model(NATIVE).train(), model(ALWAYS).train()
    pos = document_positions(doc)
    logits = m(ids, position_ids=pos, doc_ids=doc)
    g = grads_of(m, m(ids, position_ids=pos, labels=labels, doc_ids=doc)[0])
    refs, ref_loss = [], 0
    for (s, e), n in zip(bounds(lengths), lengths):
        r = yarn if n > ORIG else native
        refs.append(r(ids[:, s:e]))
        ref_loss = ref_loss + r(ids[:, s:e], labels=labels[:, s:e])[0]
    torch.testing.assert_close(logits, torch.cat(refs, 1), **TOL)
    native.zero_grad(set_to_none=True)
    yarn.zero_grad(set_to_none=True)
    ref_loss.backward()
    for (k, p), q in zip(native.named_parameters(), yarn.parameters()):
        ref_g = (p.grad if p.grad is not None else 0) + (q.grad if q.grad is not None else 0)
        torch.testing.assert_close(g[k], ref_g, **TOL, msg=lambda s: f"grad {k}: {s}")
    # and the same row under always-YaRN is the always model's, document by document
    torch.testing.assert_close(
        model(ALWAYS)(ids, position_ids=pos, doc_ids=doc), alone(model(ALWAYS), ids, labels, lengths)[0], **TOL
    )


@torch.no_grad()
def test_padded_row_uses_its_real_length():
    """Without doc_mask the row's length is its last labelled token + 1 (fit mode pads)."""
    T, n = 3 * ORIG, ORIG - 4  # a window of 96 holding a 28-token sequence
    ids, labels = ids_of(T, B=1), ids_of(T, B=1, seed=1)
    labels[:, n:] = -100
    one = Groups(world_size=1, rank=0, sp=1, dp=1, sp_rank=0, dp_rank=0)
    m = shard_batch({"input_ids": ids, "labels": labels}, one)
    assert m["rope_len"].unique().tolist() == [n]
    out = model(BEYOND)(ids, position_ids=m["position_ids"], rope_len=m["rope_len"])
    torch.testing.assert_close(out[:, :n], model(NATIVE)(ids[:, :n]), **TOL)  # other T: other sum order
    assert (out[:, :n] - model(ALWAYS)(ids[:, :n])).abs().max() > 1e-3
    full = shard_batch({"input_ids": ids, "labels": ids}, one)["rope_len"]
    assert torch.equal(model(BEYOND)(ids, rope_len=full), model(ALWAYS)(ids))


@torch.no_grad()
@pytest.mark.parametrize("L,max_new", [(20, 8), (26, 10), (40, 6)])  # all short; crosses ORIG; all long
def test_generation_with_cache_equals_recompute_and_picks_rope_once(L, max_new):
    # a large init: attention (hence the rope) decides the argmax of this random model
    m = model(BEYOND, init_std=0.5).double()  # fp64: large logits, tight comparisons
    ids = ids_of(L)
    got = greedy_generate(m, ids, max_new, prefill_chunk=7)
    assert torch.equal(got, greedy_generate(m, ids, max_new, use_cache=False))
    # the rope is the one for L + max_new tokens from the first prompt token on
    ref = model(ALWAYS if L + max_new > ORIG else NATIVE, init_std=0.5).double()
    assert torch.equal(got, greedy_generate(ref, ids, max_new, prefill_chunk=7))
    other = model(NATIVE if L + max_new > ORIG else ALWAYS, init_std=0.5).double()
    assert not torch.equal(got, greedy_generate(other, ids, max_new)), "both ropes generate alike: no test"
    # the cached prefill + decode logits equal one full forward with the same rope_len
    seq = torch.cat([ids, got], 1)[:, : L + max_new - 1]
    cache = KVCache(m.cfg.n_layers, rope_len=L + max_new)
    step = [m(seq[:, :L], cache=cache)] + [m(seq[:, t : t + 1], cache=cache) for t in range(L, seq.shape[1])]
    torch.testing.assert_close(torch.cat(step, 1), m(seq, rope_len=L + max_new), rtol=1e-10, atol=1e-10)


def test_cache_without_rope_len_is_refused_only_when_it_matters():
    ids = ids_of(4)
    with pytest.raises(ValueError, match="KVCache.rope_len"):
        model(BEYOND)(ids, cache=KVCache(3))
    model(ALWAYS)(ids, cache=KVCache(3))  # other ropes ignore it


def test_rope_len_shapes():
    m, ids = model(BEYOND), ids_of(ORIG + 8)
    with torch.no_grad():
        per_row = m(ids, rope_len=torch.tensor([ORIG, ORIG + 8]))
        assert torch.equal(per_row[0], model(NATIVE)(ids)[0])
        assert torch.equal(per_row[1], model(ALWAYS)(ids)[1])
    with pytest.raises(ValueError, match="rope_len"):
        m(ids, rope_len=torch.ones(2, 3, dtype=torch.long))


# --------------------------------------------------------------------------- config
BASE = {
    "name": "t",
    "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 8, "vocab_size": 8},
    "tokenizer": {"kind": "byte"},
    "data": {"window": 128},
    "train": {"max_steps": 10, "tokens_per_step": 128},
    "schedule": {"kind": "cosine", "lr": 1e-3, "warmup_steps": 1},
}


def test_apply_lives_in_yarn_only():
    with pytest.raises(ConfigError) as e:
        build_config({**BASE, "rope": {"theta": 1e4, "apply": "beyond_original"}})
    assert "rope.apply='beyond_original': no such field" in str(e.value) and "rope.yarn.apply" in str(e.value)
    with pytest.raises(ConfigError, match="rope.yarn.apply"):
        build_config(
            {**BASE, "rope": {"theta": 1e4, "yarn": {"factor": 2, "original_max_position": 64, "apply": "sometimes"}}}
        )
    c = build_config(
        {**BASE, "rope": {"theta": 1e4, "yarn": {"factor": 2, "original_max_position": 64, "apply": "beyond_original"}}}
    )
    assert c.rope.yarn.apply == "beyond_original"
    assert any("beyond_original with data.mode=pack and data.doc_mask=false" in w for w in config_warnings(c))
    c.data.doc_mask = True
    assert not any("beyond_original" in w for w in config_warnings(c))
    assert YarnConfig(factor=2, original_max_position=8).apply == "always"


# --------------------------------------------------------------------------- export
def test_export_refuses_beyond_original_or_writes_plain_yarn_on_request():
    m = model(BEYOND)
    with pytest.raises(RopeExportError, match="no transformers equivalent"):
        hf_config_dict(m.cfg, m.rope_cfg)
    d = hf_config_dict(m.cfg, m.rope_cfg, rope_as_yarn=True)
    assert d["rope_parameters"]["rope_type"] == "yarn" and d["max_position_embeddings"] == 4 * ORIG
    hf = to_hf(m, rope_as_yarn=True).eval()
    with torch.no_grad():
        long_ids, short_ids = ids_of(ORIG + 8), ids_of(ORIG // 2)
        torch.testing.assert_close(hf(long_ids).logits, m(long_ids), rtol=1e-5, atol=1e-5)
        assert (hf(short_ids).logits - m(short_ids)).abs().max() > 1e-3  # what "not exact below" means


def test_transformers_longrope_cannot_express_beyond_original():
    """The fact behind the refusal (model/hf.py): longrope scales short inputs by the same
    attention factor as long ones. If a transformers release changes that, an exact export
    may become possible: this test then fails and says so."""
    import math

    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megablu.model.rope import default_inv_freq, yarn_inv_freq

    dim, f = 16, 4.0
    inv, s = yarn_inv_freq(dim, 1e4, f, ORIG)
    long_factor = (default_inv_freq(dim, 1e4) / inv).tolist()  # YaRN's blend as longrope factors
    c = transformers.LlamaConfig(
        hidden_size=dim * 2,
        num_attention_heads=2,
        head_dim=dim,
        max_position_embeddings=int(f * ORIG),
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "factor": f,
            "original_max_position_embeddings": ORIG,
            "attention_factor": s,
            "long_factor": long_factor,
            "short_factor": [1.0] * (dim // 2),
        },
    )
    init = ROPE_INIT_FUNCTIONS["longrope"]
    long_inv, long_s = init(c, "cpu", seq_len=ORIG + 1)
    short_inv, short_s = init(c, "cpu", seq_len=ORIG)
    torch.testing.assert_close(long_inv, inv, rtol=1e-6, atol=0)  # frequencies: expressible
    torch.testing.assert_close(short_inv, default_inv_freq(dim, 1e4), rtol=1e-6, atol=0)
    assert long_s == short_s == pytest.approx(0.1 * math.log(f) + 1), (
        "transformers' longrope now scales short and long inputs differently: revisit model/hf.py's export refusal"
    )


def test_ckpt_export_cli_refuses_beyond_original_before_writing(tmp_path, monkeypatch, capsys):
    """`megablu ckpt export` of a beyond_original run: exit 2, the reason and the flag, no out dir."""
    import megablu.checkpoint.weights as w
    from megablu.cli import main

    m = model(BEYOND)
    monkeypatch.setattr(w, "_export_source", lambda src: tmp_path / "step")  # run dir: tmp_path
    monkeypatch.setattr(w, "read_manifest", lambda step: {"meta": {}})
    monkeypatch.setattr(w, "_model_configs", lambda manifest, run_dir: (m.cfg, m.rope_cfg, 4 * ORIG))
    out = tmp_path / "hf"
    assert main(["ckpt", "export", "run", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no transformers equivalent" in err and "--rope-as-yarn" in err and not out.exists()
