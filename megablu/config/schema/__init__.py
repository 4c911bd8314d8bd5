"""Typed configuration, one module per section (being split out of eval.py)."""
from .eval import *  # noqa: F401,F403
