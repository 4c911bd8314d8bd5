"""The ZeRO-Offload table of experiments/zero_offload/README.md from one or more offload.jsonl files.

  python bench/offload_table.py CALL1/offload.jsonl CALL2/offload.jsonl ... > offload.md

Within one file a row is the union of its lines (a run prints its fit first, the verified row
last, and a fresh-process retry or a timeout adds to them). A later file replaces a whole row
of an earlier one (a re-run, possibly with a changed method). Ratios to "no offload" use the
ZeRO-1 row of the same shape: windows against its verified largest window, tokens/s against
its step at the SAME window, from the same file when it has one (any file's otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys

NAMES = {
    "z1": "ZeRO-1, no offload",
    "z2_opt": "ZeRO-2 + optimizer offload",
    "z3_opt": "ZeRO-3 + optimizer offload",
    "z3_params": "ZeRO-3 + param offload",
    "z3_opt_params": "ZeRO-3 + optimizer + param offload",
}


def merge_file(path: str) -> dict[tuple, dict]:
    """One call's rows, (shape, setting) -> the union of that run's JSON lines (log lines skipped)."""
    merged: dict[tuple, dict] = {}
    for line in open(path):
        if line.startswith("{"):
            r = json.loads(line)
            merged.setdefault((r["shape"], r["setting"]), {}).update(r)
    return merged


def load(paths: list[str]) -> tuple[list[dict], dict]:
    rows: dict[tuple, dict] = {}
    base_tok_s: dict[tuple, int] = {}  # (file, shape, T) and (shape, T) -> ZeRO-1 tokens/s at that window
    for i, path in enumerate(paths):
        for key, r in merge_file(path).items():
            rows[key] = dict(r, _file=i)
            if r["setting"] == "z1" and "tok_s_at_fit" in r:
                base_tok_s[(i, r["shape"], r["fit_T"])] = base_tok_s[(r["shape"], r["fit_T"])] = r["tok_s_at_fit"]
    order = list(NAMES)
    return sorted(rows.values(), key=lambda r: (r["shape"], order.index(r["setting"]))), base_tok_s


def window(r: dict) -> str:
    oom = ", ".join(f"{t:,}" for t in r.get("oom_at", []))
    if r.get("max_T"):
        return f"{r['max_T']:,}" + (f" (OOM at {oom})" if oom else "")
    if "predicted_T" not in r:
        return r.get("error", "not run")
    why = f"OOM at {oom}" if oom else "not verified"
    if r.get("error"):
        why += "; the retry at -10% ran out of time" if r["error"] == "exit 124" else f"; then {r['error']}"
    return f"none verified ({r['predicted_T']:,} predicted; {why})"


def table(rows: list[dict], base_tok_s: dict) -> str:
    base_T = {r["shape"]: r.get("max_T") for r in rows if r["setting"] == "z1"}
    L = [
        "| shape | setting | params | static GB | MB/token | step peak GB | largest window | vs no offload "
        "| tok/s (window) | vs no offload | tok/s @largest |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = NAMES.get(r["setting"], r["setting"])
        if "tok_s_at_fit" not in r:
            L.append(f"| {r['shape']} | {name} | | | | | {window(r)} | | | | |")
            continue
        b_T = base_T.get(r["shape"])
        rel_T = f"{r['max_T'] / b_T:.2f}x" if b_T and r.get("max_T") else ""
        # the same call's baseline first: single-step times of one setting differ by up to 16% between calls
        b_s = base_tok_s.get((r["_file"], r["shape"], r["fit_T"])) or base_tok_s.get((r["shape"], r["fit_T"]))
        rel_s = f"{r['tok_s_at_fit'] / b_s:.2f}x" if b_s else ""
        at_max = f"{r['tok_s_at_max']:,}" if r.get("tok_s_at_max") else ""
        peak = r.get("step_peak_gb", "")  # rows before the fwd+bwd / step split have none
        L.append(
            f"| {r['shape']} | {name} | {r['params_b']}B | {r['static_gb']} | {r['mb_per_token']} | {peak} | "
            f"{window(r)} | {rel_T} | {r['tok_s_at_fit']:,} ({r['fit_T'] // 1024}k) | {rel_s} | {at_max} |"
        )
    return "\n".join(L) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python bench/offload_table.py",
        description=__doc__.splitlines()[0],
        epilog="Writes the Markdown table on stdout; exit 1 when the files hold no rows.",
    )
    p.add_argument("files", nargs="+", help="offload.jsonl of one or more calls (bench/offload_bench.py), oldest first")
    files = p.parse_args(argv).files  # no file: usage on stderr, exit 2
    rows, base = load(files)
    if not rows:
        print(f"no rows in {files}", file=sys.stderr)
        return 1
    sys.stdout.write(table(rows, base))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
