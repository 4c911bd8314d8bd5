"""A small byte-level BPE tokenizer.json with SmolLM2-Instruct's special tokens, built offline for tests:
EOT <|endoftext|> (id 0), <|im_start|> (1), <|im_end|> (2, the end of an instruct model's turn)."""

from pathlib import Path


def write_chat_tokenizer(d: Path, text: str, vocab_size: int = 300, added: tuple[str, ...] = ()) -> Path:
    """Train on `text` (repeated), add the plain (non-special) tokens `added`, save d/tokenizer.json; returns d."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text] * 50, tr)
    if added:
        tok.add_tokens(list(added))
    tok.save(str(Path(d) / "tokenizer.json"))
    return Path(d)
