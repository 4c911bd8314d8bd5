"""Print docs/RELIABILITY.md's bad-input table from the cases in tests/test_bad_input.py.

    python -m tests.bad_input_table            # counts by category (markdown), then every case not refused
    python -m tests.bad_input_table --cases    # also one line per case

The counts are the test cases themselves: each is run as the test runs it (tests/bad_input_lab.py)
and classified: refused cleanly (exit 2, the expected message, no traceback, nothing written),
traceback, silently accepted (exit 0), or other (a wrong code or message).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", action="store_true", help="list every case with its outcome")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.__stderr__, level=logging.CRITICAL)
    from tests.bad_input_lab import Lab, Tally, run_case
    from tests.test_bad_input import CASES

    tally, notes = Tally(), []
    with tempfile.TemporaryDirectory(prefix="megablu-bad-input-") as d:
        lab = Lab(Path(d))
        for c in CASES:
            outcome, _ = run_case(c, lab)
            tally.add(c.area, outcome)
            if args.cases or outcome.kind != "refused":
                notes.append(
                    f"- {c.area}: {c.name}: {outcome.kind}"
                    + (f" ({outcome.detail.splitlines()[0][:200]})" if outcome.detail else "")
                )
    print(tally.markdown())
    if notes:
        print()
        print("\n".join(notes))
    return 0 if all(n.endswith("refused") for n in notes) else 1


if __name__ == "__main__":
    sys.exit(main())
