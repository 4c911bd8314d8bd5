"""megablu.eval.report: the old name of megablu.eval.results, re-exported for the callers that import it."""
from . import results as _results
from .results import *  # noqa: F401,F403


def __getattr__(name: str):   # the private helpers too (`from megablu.eval.report import _mpl`)
    return getattr(_results, name)
