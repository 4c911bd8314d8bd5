"""batch["doc_ids"] under data.doc_mask: the rule (each EOT after the row's first token starts the next
document), and that no label is predicted from another document's tokens."""

import numpy as np
import pytest
import torch

from megablu.config.schema import DataConfig
from megablu.data.loader import IGNORE, build_loader

from .conftest import EOT, IDENT


def _doc_of(tok):  # unique_docs: token = 1 + i*1000 + p
    return (int(tok) - 1) // 1000


def _check_row(x, y, d):
    """x input ids, y labels, d doc ids of one row (numpy)."""
    assert d[0] == 0 and (np.diff(d) >= 0).all()
    # a new id exactly at every EOT but the first token: the EOT is the BOS of the document after it
    starts = np.nonzero(np.diff(d))[0] + 1
    assert (np.diff(d) <= 1).all()
    assert starts.tolist() == [t for t in range(1, len(x)) if x[t] == EOT]
    for i in np.unique(d):
        # what a position of document i sees under the mask (its id, causal) and what it is asked to predict:
        # tokens and targets of one document only, apart from EOT (the BOS it starts with, the EOT it ends with)
        seg = d == i
        toks, tgts = x[seg], y[seg]
        docs = {_doc_of(v) for v in toks[toks != EOT]} | {_doc_of(v) for v in tgts[(tgts != EOT) & (tgts != IGNORE)]}
        assert len(docs) <= 1, (i, docs)


@pytest.mark.parametrize("T", [96, 300])
def test_pack_doc_ids_follow_documents(dataset, T):
    root, _ = dataset
    L = build_loader(
        DataConfig(path=str(root), window=T, mode="pack", doc_mask=True, max_epochs=10),
        IDENT,
        micro_batch=2,
        dp_rank=0,
        dp_size=1,
    )
    multi = 0
    for _ in range(L.stats["sequences_per_epoch"] // 2):
        b = L.next_batch()
        assert b["doc_ids"].dtype == torch.int32 and b["doc_ids"].shape == b["input_ids"].shape
        for x, y, d in zip(b["input_ids"].numpy(), b["labels"].numpy(), b["doc_ids"].numpy()):
            _check_row(x, y, d)
            multi += d[-1] > 0
    assert multi > 5  # rows that hold several documents were checked


def test_the_token_before_an_eot_predicts_it_within_its_document(dataset):
    root, _ = dataset
    L = build_loader(
        DataConfig(path=str(root), window=300, mode="pack", doc_mask=True), IDENT, micro_batch=1, dp_rank=0, dp_size=1
    )
    b = L.next_batch()
    x, y, d = (b[k][0].numpy() for k in ("input_ids", "labels", "doc_ids"))
    t = next(t for t in range(1, 299) if x[t] == EOT)
    assert y[t - 1] == EOT and d[t - 1] == d[t] - 1  # the closing EOT is the last target of the document
    assert d[t + 1] == d[t] and _doc_of(y[t]) != _doc_of(x[t - 1])  # the EOT predicts the next document


@pytest.mark.parametrize("mode", ["fit", "truncate"])
def test_one_document_rows_are_all_zero(dataset, mode):
    root, _ = dataset
    cfg = DataConfig(
        window=100,
        doc_mask=True,
        mix=[
            dict(name="one", path=str(root), mode=mode, weight=1.0),
            dict(name="packed", path=str(root), mode="pack", weight=1.0),
        ],
        max_epochs=100,
    )
    L = build_loader(cfg, IDENT, micro_batch=1, dp_rank=0, dp_size=1)
    seen = {0: 0, 1: 0}
    for g in range(80):
        src, _ = L.space.locate(g)
        b = L.next_batch()
        x, y, d = (b[k][0].numpy() for k in ("input_ids", "labels", "doc_ids"))
        if src == 0:
            assert (d == 0).all()  # padding included
        else:
            _check_row(x, y, d)
        seen[src] += 1
    assert min(seen.values()) > 10


def test_no_doc_ids_without_doc_mask(dataset):
    root, _ = dataset
    b = build_loader(DataConfig(path=str(root), window=96), IDENT, micro_batch=1, dp_rank=0, dp_size=1).next_batch()
    assert set(b) == {"input_ids", "labels"}
