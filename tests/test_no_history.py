"""The package holds no lab notebook: no dates, no run figures, no development-machine paths and no
references to the predecessor trainer ("the seed") in megablu/ -- code, docstrings, comments, pydantic
field descriptions, messages. Those belong in docs/ and the commits (issue 41).

Each rule is a regular expression over every line of megablu's Python sources; the detector itself is
checked on phrases it must flag and on ordinary ones it must leave alone (a random seed is "the seed" too).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megablu"

RULES = {
    # a calendar date: a session's, a run's (2026-12-04)
    "date": r"\b20\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b",
    # a throughput or speed-up quoted from a run: "33,732 tokens/s", "+1.9% tokens/s", "449 TF/s", "1.04x faster"
    "run figure": r"\d[\d,.]*%?\s*(?:tokens/s|tok/s|TF/s|TFLOP/s)(?![\w/])|\b\d+\.\d+x (?:faster|slower)\b",
    # the project's own issue tracker: "(issue 14: 10-14k tokens back", "issue 17's item 5"
    "issue": r"\bissues? \d+\b",
    # where and when something was run: "measured on the H200", "validated ... on an H100", "measured 0.68"
    "run record": r"(?i)\b(?:measured|validated|profiled|benchmarked)\b[^\n]{0,50}\bon (?:the|an?|one) [GH]?H[12]00\b"
    r"|\bmeasured \d",
    # the development machines' files: wheels carried by hand, the shared device folder, results folders
    "dev path": r"\.whl\b|\.\./shared\b|\bshared/device\b|\bfa4_wheels\b|/work/|\bbench/results\b|\bbench/h[12]00_",
    # the predecessor trainer: "the seed's traps", "The seed lost", "(task name in the seed)", its name
    "predecessor": r"(?i)\bthe\s+seed(?:'s\b|\s+(?:lost|numbered|once|shipped|had|trained|used)\b|\))"
    r"|\bbluscript",
}

MUST_FLAG = {
    "date": ["validated in the model on the H200 on 2026-12-04", "(an H100 eval, 2026-12-06: whole"],
    "run figure": [
        "33,732 tokens/s (1.04x)",
        "+1.9% tokens/s for +0.3 GB",
        "449 vs 356 TF/s in the model",
        "a 32k step 1.04x faster with",
    ],
    "issue": ["(issue 14: 10-14k tokens back", "question of issue 17's item 5", "(docs/BENCHMARKS.md, issue 17)"],
    "run record": [
        "(0.8.5 was measured; on the H200",
        "measured on the H200 at 32k",
        "blu-0.5b, measured 0.68",
        "validated fa4 in the model on an H100",
    ],
    "dev path": [
        "carry its wheel in .whl",
        "(../shared/device/fa4_wheels.sh, bench/h200_kernels.sh)",
        "bench/results/2026-12-03",
        "/work/main/.venv",
    ],
    "predecessor": [
        "the seed's default of 1024 cost 27 pp",
        "The seed lost time to `hf download`",
        "(task name in the seed)",
        "the seed once shipped a cache bug",
        "The seed numbered runs",
        "BluScriptCP",
        "a default of 1024 (the\n    seed's YaRN original length)",
    ],
}

MUST_PASS = [
    "takes the seed into its sha256 input",  # the prompts' random seed
    "The seed as an int >= 0, else an EvalError",
    "seed: the init's own generator (reset_parameters(seed))",
    "the seeded offset of prompt `index`",
    "a seeded draw",
    "eval.seed",
    "tokens/s per rank and MFU",  # a unit, no figure
    "the GPU's dense bf16 peak (utils/device.PEAK_BF16_TFLOPS)",
    "FlashAttention-4 is used here on SM90 (H100/H200) only",
    "--gpu-gb: GPU memory in GB (1e9 B)",
    "data_cache/demo",
    "pip install flash-attn-4",
    "an inter-node link is a 5-20x slower link",  # a rule of thumb, not a run
    "(pytorch/pytorch#144455)",
    "what was measured so far",
    "the first steps of a run measured as the probe",
    "`strftime_now` returns a fixed date (_DATE)",
]


def hits(text: str):
    """[(rule, line number, line)] for every match of a rule in `text`; a match may span lines (a phrase
    wrapped in a docstring or a message), and is reported at the line where it starts."""
    lines = text.splitlines()
    out = []
    for rule, pat in RULES.items():
        for m in re.finditer(pat, text):
            n = text.count("\n", 0, m.start()) + 1
            out.append((rule, n, lines[n - 1].strip()))
    return sorted(set(out), key=lambda h: (h[1], h[0]))


@pytest.mark.parametrize("rule", sorted(RULES))
def test_detector_flags_what_it_must(rule):
    for phrase in MUST_FLAG[rule]:
        assert rule in [h[0] for h in hits(phrase)], phrase


def test_detector_leaves_ordinary_text_alone():
    assert [(p, hits(p)) for p in MUST_PASS if hits(p)] == []


def test_package_holds_no_dates_figures_dev_paths_or_history():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the package, not an empty glob
    found = [
        f"{f.relative_to(PACKAGE.parent)}:{n}: [{rule}] {line[:120]}"
        for f in files
        for rule, n, line in hits(f.read_text(encoding="utf-8"))
    ]
    assert found == [], (
        "megablu/ must not quote dates, run figures, development-machine paths or the "
        "predecessor; say it in docs/ or the commit instead:\n" + "\n".join(found)
    )
