"""megablu: long-context (YaRN + Ulysses SP + ZeRO) training and evaluation on DeepSpeed."""

__version__ = "0.1.0"
