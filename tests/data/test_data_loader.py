import json

import numpy as np
import pytest
import torch

from megablu.config.schema import DataConfig
from megablu.data.loader import IGNORE, build_loader
from megablu.data.shards import DataError

from .conftest import EOT, IDENT, unique_docs, write_dataset


def _cfg(root, **kw):
    kw.setdefault("window", 96)
    kw.setdefault("mode", "pack")
    return DataConfig(path=str(root), **kw)


def _epoch(loader, n_batches):
    return [loader.next_batch() for _ in range(n_batches)]


def _check_labels(b):
    x, y = b["input_ids"], b["labels"]
    assert x.dtype == torch.long and y.dtype == torch.long and x.shape == y.shape
    real = y != IGNORE
    # labels are the next input token wherever both exist
    assert torch.equal(y[:, :-1][real[:, :-1]], x[:, 1:][real[:, :-1]])


def _doc_of(tok):  # unique_docs: token = 1 + i*1000 + p
    return (tok - 1) // 1000, (tok - 1) % 1000


def test_pack_covers_every_token_once_per_epoch(dataset):
    root, docs = dataset
    L = build_loader(_cfg(root, window=96), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    n = L.stats["sequences_per_epoch"]
    stream_len = sum(len(d) + 1 for d in docs) + 1
    assert n == (stream_len - 1) // 96
    seen = []
    for b in _epoch(L, n):
        _check_labels(b)
        assert (b["labels"] != IGNORE).all()  # packing never pads
        x = b["input_ids"][0].numpy()
        seen.append(x)
        # between EOTs, tokens are consecutive positions of one document
        for seg in np.split(x, np.nonzero(x == EOT)[0]):
            seg = seg[seg != EOT]
            if len(seg):
                d, p = _doc_of(seg)
                assert (d == d[0]).all() and (np.diff(p) == 1).all()
    allx = np.concatenate(seen)
    body = allx[allx != EOT]
    assert len(np.unique(body)) == len(body)  # no token twice in an epoch
    # everything but the dropped tail (< one window) is covered
    total = sum(len(d) for d in docs)
    assert total - 96 <= len(body) <= total
    # a document that starts a window after the first is continued exactly where the previous window ended
    assert L.stats["pack_tail_fraction"] < 96 / total


def test_fit_mode(dataset):
    root, docs = dataset
    T = 100
    L = build_loader(_cfg(root, window=T, mode="fit", prefetch=0), IDENT, micro_batch=2, dp_rank=0, dp_size=1)
    fits = [i for i, d in enumerate(docs) if len(d) + 1 <= T]
    assert L.stats["sequences_per_epoch"] == len(fits)
    assert L.stats["dropped_fraction"] == pytest.approx(
        sum(len(d) for d in docs if len(d) + 1 > T) / sum(len(d) for d in docs)
    )
    got = []
    for _ in range(len(fits) // 2):
        b = L.next_batch()
        _check_labels(b)
        for x, y in zip(b["input_ids"].numpy(), b["labels"].numpy()):
            assert x[0] == EOT
            d, _ = _doc_of(x[1])
            n = len(docs[d])
            assert (x[1 : 1 + n] == docs[d]).all()
            assert y[n] == EOT and (y[n + 1 :] == IGNORE).all() and (y[:n] == docs[d]).all()
            got.append(d)
    assert set(got) <= set(fits) and len(set(got)) == len(got)


def test_fit_edge_len_T_minus_1(tmp_path):
    docs = unique_docs([99, 100])
    write_dataset(tmp_path / "d", docs)
    L = build_loader(
        _cfg(tmp_path / "d", window=100, mode="fit", bucket="b1"), IDENT, micro_batch=1, dp_rank=0, dp_size=1
    )
    assert L.stats["sequences_per_epoch"] == 1  # 99 + EOT fits in 100, 100 + EOT does not
    y = L.next_batch()["labels"][0]
    assert y[-1].item() == EOT and (y != IGNORE).all()


def test_truncate_mode(dataset):
    root, docs = dataset
    T = 100
    L = build_loader(_cfg(root, window=T, mode="truncate"), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    total = sum(len(d) for d in docs)
    assert L.stats["truncated_fraction"] == pytest.approx(sum(max(0, len(d) - T) for d in docs) / total)
    seen = set()
    for _ in range(len(docs)):
        b = L.next_batch()
        _check_labels(b)
        x, y = b["input_ids"][0].numpy(), b["labels"][0].numpy()
        d, p0 = _doc_of(x[1])
        assert p0 == 0 and d not in seen
        seen.add(d)
        m = min(len(docs[d]), T)
        assert (y[:m] == docs[d][:m]).all()
    assert seen == set(range(len(docs)))


def test_bucket_selection_and_edges(dataset):
    root, docs = dataset
    L = build_loader(_cfg(root, bucket="b1", mode="truncate", window=200), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    want = sorted(i for i, d in enumerate(docs) if 64 <= len(d) < 128)
    assert L.stats["documents"] == len(want)
    got = sorted(_doc_of(L.next_batch()["input_ids"][0, 1].item())[0] for _ in range(len(want)))
    assert got == want
    L2 = build_loader(
        _cfg(root, bucket="b0,b1", mode="truncate", window=200), IDENT, micro_batch=1, dp_rank=0, dp_size=1
    )
    assert L2.stats["documents"] == sum(1 for d in docs if len(d) < 128)


def test_dp_ranks_disjoint_and_interleaved(dataset):
    root, _ = dataset
    one = build_loader(_cfg(root), IDENT, micro_batch=2, dp_rank=0, dp_size=1)
    ref = torch.cat([one.next_batch()["input_ids"] for _ in range(6)])  # 12 global sequences
    ranks = [build_loader(_cfg(root), IDENT, micro_batch=2, dp_rank=r, dp_size=3) for r in range(3)]
    for k in range(2):
        for r, L in enumerate(ranks):
            g = (k * 3 + r) * 2
            assert torch.equal(L.next_batch()["input_ids"], ref[g : g + 2])


def test_sp_ranks_identical_and_slices_recompose(dataset):
    root, _ = dataset
    sp = 4
    loaders = [build_loader(_cfg(root, window=96), IDENT, micro_batch=2, dp_rank=1, dp_size=2) for _ in range(sp)]
    for _ in range(3):
        bs = [L.next_batch() for L in loaders]
        for b in bs[1:]:
            assert torch.equal(b["input_ids"], bs[0]["input_ids"]) and torch.equal(b["labels"], bs[0]["labels"])
        # each sp rank keeps its T/sp slice; together they are the unsharded batch
        parts = [b["input_ids"][:, r * 24 : (r + 1) * 24] for r, b in enumerate(bs)]
        assert torch.equal(torch.cat(parts, dim=1), bs[0]["input_ids"])


@pytest.mark.parametrize("mode", ["pack", "fit", "truncate"])
@pytest.mark.parametrize("prefetch", [0, 3])
def test_exact_resume(dataset, mode, prefetch):
    root, _ = dataset
    cfg = _cfg(root, mode=mode, window=100, prefetch=prefetch)
    a = build_loader(cfg, IDENT, micro_batch=3, dp_rank=1, dp_size=2)
    full = [a.next_batch() for _ in range(40)]  # crosses epoch boundaries in fit/truncate
    b = build_loader(cfg, IDENT, micro_batch=3, dp_rank=1, dp_size=2)
    for _ in range(17):
        b.next_batch()
    sd = json.loads(json.dumps(b.state_dict()))  # JSON-able
    b.close()
    c = build_loader(cfg, IDENT, micro_batch=3, dp_rank=1, dp_size=2)
    c.load_state_dict(sd)
    for k in range(17, 40):
        got = c.next_batch()
        assert torch.equal(got["input_ids"], full[k]["input_ids"]) and torch.equal(got["labels"], full[k]["labels"])


def test_epochs_reshuffle_and_seed(dataset):
    root, _ = dataset
    L = build_loader(_cfg(root, mode="truncate", window=64), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    n = L.stats["sequences_per_epoch"]
    e0 = [L.next_batch()["input_ids"][0, 1].item() for _ in range(n)]
    e1 = [L.next_batch()["input_ids"][0, 1].item() for _ in range(n)]
    assert sorted(e0) == sorted(e1) and e0 != e1
    L2 = build_loader(_cfg(root, mode="truncate", window=64, seed=1), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    assert [L2.next_batch()["input_ids"][0, 1].item() for _ in range(n)] != e0


def test_resume_refuses_other_data(dataset):
    root, _ = dataset
    a = build_loader(_cfg(root, window=96), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    a.next_batch()
    b = build_loader(_cfg(root, window=64), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match="window"):
        b.load_state_dict(a.state_dict())


def test_max_epochs(dataset):
    root, _ = dataset
    L = build_loader(_cfg(root, mode="truncate"), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    n = L.stats["sequences_per_epoch"]
    ok = build_loader(_cfg(root, mode="truncate"), IDENT, micro_batch=1, dp_rank=0, dp_size=1, total_sequences=2 * n)
    assert ok.stats["planned_epochs"] == pytest.approx(2.0)
    with pytest.raises(
        DataError,
        match=rf"consumes {2 * n + 1} sequences .* holds {n} per epoch: 2.02 epochs > "
        r"data.max_epochs=2",
    ):
        build_loader(_cfg(root, mode="truncate"), IDENT, micro_batch=1, dp_rank=0, dp_size=1, total_sequences=2 * n + 1)


def test_tokenizer_mismatch(dataset):
    root, _ = dataset
    with pytest.raises(DataError, match="manifest.json: data tokenized with 'test:v100000"):
        build_loader(_cfg(root), "byte:v257:01927f6dec51a9dd", micro_batch=1, dp_rank=0, dp_size=1)


def test_empty_bucket(tmp_path):
    write_dataset(tmp_path / "d", unique_docs([10, 20]))
    with pytest.raises(DataError, match="bucket 'b3' split 'train' is empty"):
        build_loader(_cfg(tmp_path / "d", bucket="b3"), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match=r"bucket\(s\) \['b9'\] not in this dataset"):
        build_loader(_cfg(tmp_path / "d", bucket="b9"), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match="no document is shorter than the window"):
        build_loader(_cfg(tmp_path / "d", mode="fit", window=10), IDENT, micro_batch=1, dp_rank=0, dp_size=1)


def test_missing_dataset(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        build_loader(_cfg(tmp_path / "nope"), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    (tmp_path / "half").mkdir()
    with pytest.raises(DataError, match="manifest.json is missing"):
        build_loader(_cfg(tmp_path / "half"), IDENT, micro_batch=1, dp_rank=0, dp_size=1)


def test_prefetch_thread_stops_when_loader_dropped(dataset):
    import gc

    root, _ = dataset
    L = build_loader(_cfg(root, prefetch=2), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    L.next_batch()
    t = L._thread
    assert t.is_alive()
    del L
    gc.collect()
    t.join(timeout=5)
    assert not t.is_alive()


def test_error_in_prefetch_thread_surfaces(dataset):
    root, _ = dataset
    L = build_loader(_cfg(root, prefetch=2), IDENT, micro_batch=1, dp_rank=0, dp_size=1)

    def boom(g, out):
        raise DataError(f"cannot read sequence {g}")

    L.space.sequence = boom
    with pytest.raises(DataError, match="cannot read sequence 0"):
        L.next_batch()


def test_resume_with_other_dp_and_micro_batch_continues_the_global_order(dataset):
    root, _ = dataset
    ref = build_loader(_cfg(root), IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    seqs = [ref.next_batch()["input_ids"][0] for _ in range(20)]
    a = build_loader(_cfg(root), IDENT, micro_batch=2, dp_rank=1, dp_size=2)
    for _ in range(3):
        a.next_batch()
    sd = a.state_dict()
    assert sd["sequences_consumed"] == 12  # 3 batches x 2 ranks x 2 sequences
    b = build_loader(_cfg(root), IDENT, micro_batch=4, dp_rank=0, dp_size=1)
    b.load_state_dict(sd)
    assert torch.equal(b.next_batch()["input_ids"], torch.stack(seqs[12:16]))


@pytest.mark.parametrize("T,sp", [(96, 4), (98, 4), (100, 3)])
def test_sp_shard_batch_against_unsharded(dataset, T, sp):
    """Every sp rank builds the same loader and keeps its T/sp slice (megablu.parallel.sequence);
    the slices put back together are the unsharded batch, positions included."""
    from megablu.parallel.groups import Groups
    from megablu.parallel.sequence import shard_batch

    root, _ = dataset
    full = build_loader(_cfg(root, window=T), IDENT, micro_batch=2, dp_rank=0, dp_size=2).next_batch()
    parts = []
    for r in range(sp):
        g = Groups(world_size=2 * sp, rank=r, sp=sp, dp=2, sp_rank=r, dp_rank=0)
        b = build_loader(_cfg(root, window=T), IDENT, micro_batch=2, dp_rank=0, dp_size=2).next_batch()
        parts.append(shard_batch(b, g, pad_id=EOT))
    ids = torch.cat([p["input_ids"] for p in parts], 1)[:, :T]
    lab = torch.cat([p["labels"] for p in parts], 1)
    pos = torch.cat([p["position_ids"] for p in parts], 1)
    assert torch.equal(ids, full["input_ids"]) and torch.equal(lab[:, :T], full["labels"])
    assert (lab[:, T:] == IGNORE).all()  # padding added for T % sp carries no label
    assert torch.equal(pos[0], torch.arange(pos.shape[1]))
