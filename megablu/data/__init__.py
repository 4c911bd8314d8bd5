"""Data: offline tokenizers, document-preserving shards, length buckets, a resumable dp-aware loader.

from megablu.data import load_tokenizer, build_loader, DataError, TokenizerError
"""

from .loader import Loader, build_loader
from .shards import DataError
from .tokenizer import Tokenizer, TokenizerError, load_tokenizer

__all__ = ["DataError", "Loader", "Tokenizer", "TokenizerError", "build_loader", "load_tokenizer"]
