"""megablu.eval.report: one name for the three modules eval results live in, for the callers that import it.

results.py  the step_<N>.json schema: cells, summaries, averages, writing, loading, identity, merging;
compare.py  the tables of `megablu compare`: differences, their pairing and stars, averages, held-out loss;
plots.py    the plot, the depth x length heatmaps, and the md/png files written beside a result.
"""

from . import compare as _compare, plots as _plots, results as _results
from .compare import *  # noqa: F401,F403
from .plots import *  # noqa: F401,F403
from .results import *  # noqa: F401,F403


def __getattr__(name: str):  # the private helpers too (`from megablu.eval.report import _mpl`)
    for m in (_results, _compare, _plots):
        if hasattr(m, name):
            return getattr(m, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
