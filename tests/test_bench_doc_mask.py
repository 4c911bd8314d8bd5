"""bench/doc_mask_bench.py off the GPU: the document mixes, the table with failed rows, no-CUDA exit."""

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("doc_mask_bench", ROOT / "bench" / "doc_mask_bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.parametrize("T", [16384, 32768, 65536])
def test_mixes_fill_the_row(T):
    assert bench.mix_lengths(T, "one") == [T]
    for mix in ("60/40", "short"):
        ls = bench.mix_lengths(T, mix)
        assert sum(ls) == T and all(n > 0 for n in ls)
        assert bench.mix_lengths(T, mix) == ls  # seeded
    ls = bench.mix_lengths(T, "60/40")
    assert max(ls) == int(0.6 * T) and all(n <= 4096 for n in ls if n != max(ls))
    assert all(n <= 4096 for n in bench.mix_lengths(T, "short"))


def test_table_keeps_failed_and_skipped_rows(tmp_path):
    rows = [
        dict(
            heads="16/4",
            T=32768,
            mix="one",
            n_docs=1,
            kernel="sdpa causal",
            fwd_ms=1.0,
            fwd_bwd_ms=3.0,
            speedup=1.0,
            tflops=400.0,
            first_s=0.1,
        ),
        dict(heads="16/4", T=32768, mix="short", n_docs=12, kernel="flex", note="OutOfMemoryError: x"),
        dict(heads="9/3", T=65536, mix="-", kernel="all", note="skipped: budget"),
    ]
    bench.write(rows, tmp_path, {"device": "d", "torch": "t", "budget_s": 1})
    md = (tmp_path / "doc_mask_bench.md").read_text()
    assert md.count("\n| ") == 4 and "OutOfMemoryError" in md and "skipped: budget" in md
    assert len(json.loads((tmp_path / "doc_mask_bench.json").read_text())["rows"]) == 3


def test_exits_2_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--out", str(tmp_path)]) == 2
