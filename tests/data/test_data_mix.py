"""data.mix: token shares, disjoint dp ranks, exact resume, config-time problems (megablu/data/mix.py)."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megablu.config.schema import DataConfig
from megablu.data.loader import IGNORE, build_loader
from megablu.data.mix import BLOCK, block_quotas, mix_problems
from megablu.data.shards import DataError

from .conftest import EOT, IDENT, unique_docs, write_dataset


def _mix(root, other=None, **kw):
    """long: b3 packed; short: b0 fit (60% padding at T=96); mid: b1+b2 truncated."""
    kw.setdefault("window", 96)
    kw.setdefault("max_epochs", 1000.0)
    srcs = kw.pop("sources", None) or [
        dict(name="long", path=str(root), bucket="b3", mode="pack", weight=0.5),
        dict(name="short", path=str(other or root), bucket="b0", mode="fit", weight=0.3),
        dict(name="mid", path=str(root), bucket="b1,b2", mode="truncate", weight=0.2),
    ]
    return DataConfig(mix=srcs, **kw)


def _doc_of(tok):  # unique_docs: token = 1 + i*1000 + p
    return (np.asarray(tok) - 1) // 1000


def test_token_shares_follow_the_weights_not_the_sequence_counts(dataset):
    """Weights are shares of loss tokens: the fit source (37.5 labels per row of 96) gets more rows
    than its weight, and the labels counted batch by batch match the weights and the reported shares."""
    root, docs = dataset
    n = 3 * BLOCK + 300  # three whole blocks and a partial one
    L = build_loader(_mix(root, prefetch=0), IDENT, micro_batch=4, dp_rank=0, dp_size=1, total_sequences=n)
    bucket_docs = {
        "long": {i for i, d in enumerate(docs) if len(d) >= 256},
        "short": {i for i, d in enumerate(docs) if len(d) < 64},
        "mid": {i for i, d in enumerate(docs) if 64 <= len(d) < 256},
    }
    names = [s["name"] for s in L.mixture["sources"]]
    labels = np.zeros(3)
    for k in range(n // 4):
        b = L.next_batch()
        for j in range(4):
            src, _ = L.space.locate(4 * k + j)
            y = b["labels"][j].numpy()
            labels[src] += (y != IGNORE).sum()
            body = y[(y != IGNORE) & (y != EOT)]
            assert set(_doc_of(body)) <= bucket_docs[names[src]]  # the row is that source's data
    got = labels / labels.sum()
    assert got == pytest.approx([0.5, 0.3, 0.2], abs=0.01)
    assert got == pytest.approx([s["planned_token_share"] for s in L.mixture["sources"]], abs=1e-12)
    q = [s["sequences_per_block"] for s in L.mixture["sources"]]
    assert sum(q) == BLOCK and q[1] > 0.5 * BLOCK  # by rows the fit source dominates
    # every block holds exactly its quota of each source
    assert L.space.counts(3 * BLOCK) == [3 * x for x in q]


def test_every_stretch_of_the_order_holds_the_shares(dataset):
    """Not only whole blocks: any prefix of a block (a short run, one step's batch) is within about one
    sequence per source of its quota's proportion, and the blocks differ (seeded offsets)."""
    root, _ = dataset
    L = build_loader(_mix(root), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    q = np.asarray([s["sequences_per_block"] for s in L.mixture["sources"]])
    prev = None
    for b in range(3):
        src = np.asarray([L.space.locate(b * BLOCK + t)[0] for t in range(BLOCK)])
        for t in (8, 20, 32, 100, 333, 1000):
            counts = np.bincount(src[:t], minlength=3)
            assert np.abs(counts - t * q / BLOCK).max() <= 2, (b, t, counts, t * q / BLOCK)
        if prev is not None:
            assert not np.array_equal(src, prev)
        prev = src


def test_quotas_round_to_the_block_and_keep_small_weights():
    assert block_quotas([0.6, 0.4], [100, 100]) == [614, 410]
    assert block_quotas([0.6, 0.4], [100, 50]) == [439, 585]  # half the labels per row: twice the rows
    q = block_quotas([1.0, 1e-6, 0.0], [10, 10, 10])
    assert q == [1023, 1, 0]  # a positive weight is never rounded away; weight 0 is never read


def test_dp_ranks_disjoint_and_the_global_order(dataset):
    root, _ = dataset
    one = build_loader(_mix(root), IDENT, micro_batch=2, dp_rank=0, dp_size=1)
    ref = torch.cat([one.next_batch()["input_ids"] for _ in range(6)])
    ranks = [build_loader(_mix(root), IDENT, micro_batch=2, dp_rank=r, dp_size=3) for r in range(3)]
    for k in range(2):
        for r, L in enumerate(ranks):
            g = (k * 3 + r) * 2
            assert torch.equal(L.next_batch()["input_ids"], ref[g : g + 2])


@pytest.mark.parametrize("prefetch", [0, 3])
def test_split_by_resume_equals_straight(dataset, prefetch):
    """A mixture resumed inside its second block (dp 2, doc_ids on) continues every source exactly; the
    state keeps each source's position; resuming with another dp/micro-batch continues the same order."""
    root, _ = dataset
    cfg = _mix(root, prefetch=prefetch, doc_mask=True)
    stop, end = 200, 260  # 1200 and 1560 global sequences: past the first block of 1024
    a = build_loader(cfg, IDENT, micro_batch=3, dp_rank=1, dp_size=2)
    full = [a.next_batch() for _ in range(end)]
    a.close()
    b = build_loader(cfg, IDENT, micro_batch=3, dp_rank=1, dp_size=2)
    for _ in range(stop):
        b.next_batch()
    sd = json.loads(json.dumps(b.state_dict()))
    b.close()
    g = stop * 2 * 3
    assert sd["sequences_consumed"] == g > BLOCK
    assert sum(sd["source_positions"].values()) == g and set(sd["source_positions"]) == {"long", "short", "mid"}
    c = build_loader(cfg, IDENT, micro_batch=3, dp_rank=1, dp_size=2)
    c.load_state_dict(sd)
    for k in range(stop, end):
        got = c.next_batch()
        for key in ("input_ids", "labels", "doc_ids"):
            assert torch.equal(got[key], full[k][key]), (k, key)
    c.close()
    one = build_loader(cfg, IDENT, micro_batch=1, dp_rank=0, dp_size=1, total_sequences=g + 4)
    ref = [one.next_batch()["input_ids"][0] for _ in range(g + 4)]
    assert one.mixture["sources"][1]["planned_sequences"] == sd["source_positions"]["short"] + sum(
        one.space.locate(x)[0] == 1 for x in range(g, g + 4)
    )
    d = build_loader(cfg, IDENT, micro_batch=4, dp_rank=0, dp_size=1)
    d.load_state_dict(sd)
    assert torch.equal(d.next_batch()["input_ids"], torch.stack(ref[g : g + 4]))


def test_resume_refuses_another_mixture(dataset):
    root, _ = dataset
    a = build_loader(_mix(root), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    a.next_batch()
    srcs = [
        dict(name="long", path=str(root), bucket="b3", mode="pack", weight=0.4),
        dict(name="short", path=str(root), bucket="b0", mode="fit", weight=0.6),
    ]
    b = build_loader(_mix(root, sources=srcs), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match="mixture: saved"):
        b.load_state_dict(a.state_dict())
    single = build_loader(DataConfig(path=str(root), window=96), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match="saved for other data"):
        single.load_state_dict(a.state_dict())


def test_same_dataset_twice_is_read_in_two_orders(dataset):
    root, _ = dataset
    srcs = [
        dict(name="a", path=str(root), bucket="b3", mode="pack", weight=1),
        dict(name="b", path=str(root), bucket="b3", mode="pack", weight=1),
    ]
    L = build_loader(_mix(root, sources=srcs, prefetch=0), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    rows = {0: [], 1: []}
    for g in range(60):
        rows[L.space.locate(g)[0]].append(L.next_batch()["input_ids"][0])
    n = min(len(rows[0]), len(rows[1]))
    assert n > 10 and not all(torch.equal(x, y) for x, y in zip(rows[0][:n], rows[1][:n]))


# --------------------------------------------------------------------------- config-time problems
class _Cfg:  # the two sections mix_problems reads
    def __init__(self, data, max_steps=10, tokens_per_step=96 * 8):
        self.data = data
        self.train = type("T", (), {"max_steps": max_steps, "tokens_per_step": tokens_per_step})()


def test_mix_problems_lists_every_bad_source(tmp_path, dataset):
    root, _ = dataset
    write_dataset(tmp_path / "other_tok", unique_docs([300, 20]), ident="other:v100000:fedcba9876543210")
    (tmp_path / "empty_dir").mkdir()
    srcs = [
        dict(name="long", path=str(root), bucket="b3", mode="pack", weight=0.5),
        dict(name="nodata", path=str(tmp_path / "empty_dir"), mode="pack", weight=0.1),
        dict(name="nobucket", path=str(root), bucket="b7", mode="fit", weight=0.1),
        dict(name="othertok", path=str(tmp_path / "other_tok"), mode="pack", weight=0.3),
    ]
    probs = mix_problems(_Cfg(_mix(root, sources=srcs)), IDENT)
    text = "\n".join(probs)
    assert len(probs) == 4, text
    assert f"data.mix[1] (nodata).path: {tmp_path / 'empty_dir'} is not a megablu dataset" in text
    assert "manifest.json is missing" in text
    assert "data.mix[2] (nobucket).bucket='b7': ['b7'] not in" in text and "'b0', 'b1', 'b2', 'b3'" in text
    assert "different tokenizers" in text and "other:v100000:fedcba9876543210" in text and IDENT in text
    assert (
        f"data.mix[3] (othertok).path: {tmp_path / 'other_tok'} is tokenized with "
        f"'other:v100000:fedcba9876543210' but the run's tokenizer is {IDENT!r}"
    ) in text


def test_exhausted_source_says_the_epochs_it_needs(dataset):
    root, _ = dataset
    cfg = _Cfg(_mix(root, max_epochs=2.0), max_steps=10, tokens_per_step=96 * 32)  # 320 sequences
    probs = mix_problems(cfg, IDENT)
    short = [p for p in probs if p.startswith("data.mix[1] (short)")]
    assert len(short) == 1, probs
    m = re.search(
        r"draws (\d+) sequences .* holds (\d+) per epoch: ([\d.]+) epochs > max_epochs=2; to repeat it "
        r"set data.mix\[1\].max_epochs >= ([\d.]+),",
        short[0],
    )
    assert m, short[0]
    draws, per_epoch, epochs, need = int(m[1]), int(m[2]), float(m[3]), float(m[4])
    assert epochs == pytest.approx(draws / per_epoch, abs=0.005) and need == math.ceil(draws / per_epoch * 100) / 100
    srcs = [
        dict(name="long", path=str(root), bucket="b3", mode="pack", weight=0.5, max_epochs=1000),
        dict(name="short", path=str(root), bucket="b0", mode="fit", weight=0.3, max_epochs=need),
        dict(name="mid", path=str(root), bucket="b1,b2", mode="truncate", weight=0.2, max_epochs=1000),
    ]
    assert mix_problems(_Cfg(_mix(root, sources=srcs, max_epochs=2.0), 10, 96 * 32), IDENT) == []
    srcs[1]["max_epochs"] = need - 0.02
    assert len(mix_problems(_Cfg(_mix(root, sources=srcs, max_epochs=2.0), 10, 96 * 32), IDENT)) == 1


def test_one_source_spelling_is_checked_at_config_time_too(dataset, tmp_path):
    root, _ = dataset
    d = DataConfig(path=str(root), window=96, mode="truncate", max_epochs=2.0)
    n = build_loader(d, IDENT, micro_batch=1, dp_rank=0, dp_size=1).stats["sequences_per_epoch"]
    assert mix_problems(_Cfg(d, max_steps=2 * n, tokens_per_step=96), IDENT) == []
    (p,) = mix_problems(_Cfg(d, max_steps=2 * n + 1, tokens_per_step=96), IDENT)
    assert p.startswith("data: ") and "epochs > data.max_epochs=2" in p
    (p,) = mix_problems(_Cfg(d, 1, 96), "byte:v257:01927f6dec51a9dd")
    assert "data tokenized with 'test:v100000" in p
    (p,) = mix_problems(_Cfg(DataConfig(path=str(tmp_path), window=96)), IDENT)
    assert p.startswith(f"data.path: {tmp_path} has no manifest.json")
    (p,) = mix_problems(_Cfg(DataConfig(window=96)), IDENT)
    assert p.startswith("data.path: not set and no data.mix")


def test_cli_prints_the_resolved_mixture(tmp_path, doc_lengths, capsys):
    from megablu.cli import main

    root = tmp_path / "ds"  # the tiny arm's tokenizer identity, so the config check passes
    write_dataset(root, unique_docs(doc_lengths), ident="tiktoken_file:v4096:33b169a4741adc73")
    tiny = str(Path(__file__).resolve().parents[2] / "tests" / "configs" / "tiny_cpu.yaml")
    mix = (
        "data.mix=[{name: long, path: %s, bucket: b3, mode: pack, weight: 0.7}, "
        "{name: short, path: %s, bucket: b0, mode: fit, weight: 0.3}]" % (root, root)
    )
    sets = ["--set", "data.path=null", "--set", mix, "--set", "data.max_epochs=1000", "--set", "train.max_steps=8"]
    assert main(["data", "mix", tiny, *sets]) == 0
    out = capsys.readouterr().out
    assert "64 sequences of T=256" in out and "| long | pack | b3 | 0.7 | 70.0% |" in out
    assert main(["data", "mix", tiny, *sets, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert sum(s["planned_sequences"] for s in res["sources"]) == res["planned_sequences"] == 64
    assert main(["data", "mix", tiny, *sets[:-2], "--set", "data.max_epochs=1"]) == 2
    assert "data.mix[1] (short): the run draws" in capsys.readouterr().err
