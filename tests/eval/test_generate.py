"""Greedy generation: the KV cache path equals recomputing the whole sequence each step (the seed
once shipped a cache bug that looked like a long-context gain), for any prefill chunking, batched
or not, with GQA and YaRN."""

import pytest
import torch

from megablu.config.schema import ModelConfig, RopeConfig, YarnConfig
from megablu.eval.generate import cut_at_stop, greedy_generate

from .conftest import tiny_model

YARN = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0, original_max_position=64))


def _prompts(B, L, vocab, seed=0):
    return torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rope", [None, YARN], ids=["rope", "yarn"])
def test_cache_equals_recompute(rope):
    torch.manual_seed(0)
    m = tiny_model(vocab=97, h=4, kv=2, rope=rope, seed=1).double()  # fp64: no argmax near-ties
    ids = _prompts(3, 137, 97)
    ref = greedy_generate(m, ids, 12, use_cache=False)
    for chunk in (0, 1000, 64, 50, 7):
        assert torch.equal(greedy_generate(m, ids, 12, prefill_chunk=chunk), ref), chunk
    # a batch of prompts decodes exactly like each prompt alone
    for b in range(3):
        assert torch.equal(greedy_generate(m, ids[b : b + 1], 12, prefill_chunk=64), ref[b : b + 1])


def test_generation_uses_the_whole_prompt():
    """Changing only the first token changes the logits (the cache really holds the prefix)."""
    m = tiny_model(vocab=97, seed=2).double()
    ids = _prompts(1, 90, 97)
    other = ids.clone()
    other[0, 0] = (other[0, 0] + 1) % 97
    from megablu.model.decoder import KVCache

    def last_logits(x):
        cache = KVCache(m.cfg.n_layers)
        for s in range(0, 90, 32):
            out = m(x[:, s : s + 32], cache=cache)
        return out[:, -1]

    assert not torch.allclose(last_logits(ids), last_logits(other))
    full = m(ids)[:, -1]
    assert torch.allclose(last_logits(ids), full, atol=1e-10)


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 2, 7], (2,)) == [5, 6]
    assert cut_at_stop([5, 6], (2,)) == [5, 6]
    assert cut_at_stop([5, 6], ()) == [5, 6]
    # the first of any stop id, whichever it is (an instruct model's <|im_end|> before its EOT)
    assert cut_at_stop([5, 2, 6, 0, 7], (0, 2)) == [5]
    assert cut_at_stop([5, 6, 0, 2], (2, 0)) == [5, 6]


def test_eot_early_stop_equals_decoding_on():
    """Stopping once every row has emitted EOT changes nothing that scoring reads (the output up
    to the first EOT), and stops: a row's tokens after its EOT are EOT."""
    m = tiny_model(vocab=97, seed=1).double()
    ids = _prompts(3, 40, 97, seed=3)
    ref = greedy_generate(m, ids, 16)
    eot = int(ref[0, 2])  # a token row 0 emits early
    got = greedy_generate(m, ids, 16, stop_ids=(eot,))
    assert got.shape == ref.shape
    for r, g in zip(ref.tolist(), got.tolist()):
        assert cut_at_stop(g, (eot,)) == cut_at_stop(r, (eot,))
    calls = []
    real = m.forward

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    m.forward = counting
    every = int(ref[0, 0])
    greedy_generate(m, ids[:1], 16, stop_ids=(every,), prefill_chunk=0)  # row 0's first token is its EOT
    assert len(calls) == 1  # the prefill only: nothing decoded


class ScriptModel(torch.nn.Module):
    """Emits script[t] after being fed token t (the last of each row), whatever came before; records the
    batch size of each forward call."""

    def __init__(self, script: dict, vocab=16):
        super().__init__()
        self.script, self.batches = script, []
        self.cfg = ModelConfig(n_layers=1, d_model=8, n_heads=1, n_kv_heads=1, ffn_dim=8, vocab_size=vocab)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids=None, cache=None, logits_index=None):
        self.batches.append(input_ids.shape[0])
        logits = torch.full((input_ids.shape[0], 1, self.cfg.vocab_size), -1e4)
        for b, t in enumerate(input_ids[:, -1].tolist()):
            logits[b, -1, self.script[t]] = 0.0
        return logits


# row 0 (prompt ends in 10): 5 7 2 9 9 ...; row 1 (prompt ends in 11): 12 0 6 6 ...
SCRIPT = {10: 5, 5: 7, 7: 2, 2: 9, 9: 9, 11: 12, 12: 0, 0: 6, 6: 6}


def test_stops_once_every_row_emitted_any_stop_id():
    """Row 0 ends its turn (<|im_end|> = 2) at its 3rd token, row 1 emits EOT (0) at its 2nd: row 1 leaves the
    batch after its 2nd token, decoding stops after row 0's 3rd (one prefill, two decode steps), the rest is
    the first stop id, and each row's answer ends at its own first stop. With EOT alone row 0 decodes all
    max_new tokens, alone in the batch once row 1 is done."""
    prompt = torch.tensor([[1, 10], [1, 11]])
    m = ScriptModel(SCRIPT)
    got = greedy_generate(m, prompt, 8, stop_ids=(0, 2))
    assert m.batches == [2, 2, 1]
    assert got.tolist() == [[5, 7, 2, 0, 0, 0, 0, 0], [12, 0, 0, 0, 0, 0, 0, 0]]
    assert [cut_at_stop(g, (0, 2)) for g in got.tolist()] == [[5, 7], [12]]
    m = ScriptModel(SCRIPT)
    assert greedy_generate(m, prompt, 8, stop_ids=(0,)).tolist() == [[5, 7, 2, 9, 9, 9, 9, 9], [12] + [0] * 7]
    assert m.batches == [2, 2] + [1] * 6


def test_static_cache_is_preallocated_and_sets_rope_len(monkeypatch):
    """Generation makes its cache in one place (generate.new_cache): buffers of prompt + max_new
    written in place (no torch.cat per token), and rope_len = L + max_new set when the model's
    KVCache has that field (the model side picks the rope from it at prefill)."""
    from megablu.eval import generate
    from megablu.model.decoder import KVCache

    m = tiny_model(vocab=97, seed=1).double()
    seen = []
    real = generate.new_cache

    def spy(*a, **k):
        c = real(*a, **k)
        seen.append(c)
        return c

    monkeypatch.setattr(generate, "new_cache", spy)
    monkeypatch.setattr(KVCache, "rope_len", None, raising=False)
    ids = _prompts(2, 50, 97)
    greedy_generate(m, ids, 7, prefill_chunk=16)
    (c,) = seen
    assert c.rope_len == 57 and c.capacity == 57 and c.length == 56  # the last token is never fed back
    assert c.k[0].data_ptr() == c._kb[0].data_ptr()  # a view of the preallocated buffer
    with pytest.raises(RuntimeError, match="capacity"):
        c.append(0, c.k[0][:, :2], c.v[0][:, :2])
