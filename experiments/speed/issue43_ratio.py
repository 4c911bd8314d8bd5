"""megablu / the ALST-style peer, tokens/s at each T, from one issue43.sh call's files.

    python experiments/speed/issue43_ratio.py PROF_DIR LOGS_DIR

PROF_DIR holds bench/profile_step.py's profile_<T>_<mode>.json; LOGS_DIR the peer's stderr logs
(peer<T>_<attention>.err, one JSON row per T from bench/alst_peer.py). Prints a markdown table: every megablu
mode at each T beside each peer measured at that T, with the ratio.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def megablu_rows(prof: Path) -> list[dict]:
    rows = []
    for f in sorted(prof.glob("profile_*.json")):
        r = json.loads(f.read_text())
        step = r.get("step") or {}
        if step.get("tokens_per_s"):
            rows.append({"T": int(r["T"]), "mode": r["mode"], "tps": step["tokens_per_s"], "peak": step.get("peak_gb")})
    return rows


def peer_rows(logs: Path) -> list[dict]:
    rows = []
    for f in sorted(logs.glob("peer*.err")):
        for line in f.read_text().splitlines():
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("tokens_per_s"):
                rows.append({"T": int(r["T"]), "impl": r["impl"], "tps": r["tokens_per_s"], "peak": r.get("peak_gb")})
    return rows


def table(mine: list[dict], peers: list[dict]) -> str:
    out = [
        "| T | megablu mode | tokens/s | peak GB | peer | peer tokens/s | peer peak GB | x peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    gb = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
    for m in sorted(mine, key=lambda r: (r["T"], r["mode"])):
        at = [p for p in peers if p["T"] == m["T"]]
        for p in at or [None]:
            tail = (
                f"| {p['impl']} | {p['tps']:,.0f} | {gb(p['peak'])} | **{m['tps'] / p['tps']:.2f}x** |"
                if p
                else "| (no peer row) | | | |"
            )
            out.append(f"| {m['T']} | {m['mode']} | {m['tps']:,.0f} | {gb(m['peak'])} {tail}")
    return "\n".join(out)


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    print(table(megablu_rows(Path(sys.argv[1])), peer_rows(Path(sys.argv[2]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
