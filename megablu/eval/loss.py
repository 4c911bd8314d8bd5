"""Held-out language-modelling loss beside the retrieval tasks (eval.loss).

Two measurements on the val split of a dataset (`eval.loss.data`, 'DIR' or 'DIR@bucket'):
- loss per eval length: n sequences of exactly L tokens of the val stream (documents in a
  seeded order joined by a blank line, megablu.data.haystack), loss per token (nats) over all
  positions, its exp (perplexity), and the tail loss over positions >= L/2 (the predictions
  that have at least L/2 tokens of context: the long-context part);
- short-document loss: up to `short_docs` val documents of short_min..short_max tokens
  (default 1k-4k), each scored whole from its first token; pooled per token. This is what the
  gate compares with the parent's (a relative margin): an arm that keeps its passkey but
  forgets language modelling fails.

`eval.loss.sets` ({name: source}) scores more held-out sets the same way, each reported on its own
(result["loss_sets"][name]) and gated on its own: a source is a dataset ('DIR' or 'DIR@bucket', its
val split) or 'megablu:essays', the prose shipped for RULER's essay haystack (megablu/eval/assets/ruler:
the Python documentation's HOWTOs, FAQs, tutorial and What's New essays), text that no training
corpus of megablu's holds, so a rise there is not domain adaptation to the training data.

Both are the same for every arm (seeded, the tokenizer checked against the data). The model is
run without labels: a forward hook on the last block keeps its hidden states, so the vocab
projection runs in chunks here ((chunk, V) logits at a time, never (L, V)). Under sequence
parallelism each rank scores its slice (end padding ignored) and the sums are all-reduced.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..model.string import apply_string, installed
from .prompts import EvalError, TokenizerLike

HEAD_CHUNK = 4096  # positions per vocab projection


ESSAYS = "megablu:essays"  # the shipped prose (megablu/eval/ruler/assets.py): outside every training corpus here


class _Docs:
    """In-memory documents with the slice of data.shards.DocTable that the loss reads (doc_len, doc, len)."""

    def __init__(self, docs: list[list[int]]):
        import numpy as np

        self._docs = [np.asarray(d, dtype=np.int64) for d in docs]
        self.doc_len = np.asarray([len(d) for d in self._docs], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._docs)

    def doc(self, d: int, start: int = 0, end=None):
        return self._docs[d][start:end]


def _essays(tokenizer):
    """The shipped essays as a Haystack: one document per source essay (essays.txt.gz separates them by two
    blank lines), each tokenized whole."""
    import gzip

    import numpy as np

    from ..data.haystack import Haystack
    from .ruler.assets import DIR

    with gzip.open(DIR / "essays.txt.gz", "rt", encoding="utf-8") as f:
        texts = [t.strip() for t in f.read().split("\n\n\n") if t.strip()]
    hs = Haystack.__new__(Haystack)  # the same reader over documents held in memory, not a dataset's shards
    hs.table, hs.tokenizer, hs.bucket, hs.split, hs.root = (
        _Docs([tokenizer.encode(t) for t in texts]),
        tokenizer,
        "all",
        "val",
        ESSAYS,
    )
    hs.sep = np.asarray(tokenizer.encode("\n\n"), dtype=np.int64)
    hs.n_tokens = int(hs.table.doc_len.sum())
    return hs


def _field(name) -> str:
    """The config field of a loss set, for messages: eval.loss.data, or eval.loss.sets.<name>."""
    return "eval.loss.data" if name is None else f"eval.loss.sets.{name}"


def _hay(spec: str, tokenizer, name=None):
    from ..data.haystack import Haystack, split_spec
    from ..data.shards import DataError

    if spec == ESSAYS:
        return _essays(tokenizer)
    root, bucket = split_spec(spec)
    try:
        return Haystack(root, tokenizer, bucket=bucket, split="val")
    except (DataError, OSError) as e:
        raise EvalError(f"{_field(name)}={spec!r}: {e}") from None


def loss_sets(eval_cfg) -> dict:
    """{name: source} of every held-out set an eval scores: None -> eval.loss.data (result["loss"]), then
    eval.loss.sets by name (result["loss_sets"][name])."""
    lo = eval_cfg.loss
    return {**({None: lo.data} if lo.data else {}), **dict(lo.sets)}


def _short_docs(hs, lo: int, hi: int, count: int, seed: int) -> list[int]:
    import numpy as np

    lens = hs.table.doc_len
    ok = [int(d) for d in np.random.default_rng([seed, 11]).permutation(len(lens)) if lo <= lens[d] <= hi]
    return ok[:count]


def loss_problems(eval_cfg, tokenizer: TokenizerLike, name=None, spec=None) -> list[str]:
    """What keeps a held-out set from being scored ([] = nothing): by default every set of the eval
    (loss_sets), else the one named (name None: eval.loss.data) with its source `spec`."""
    if spec is None:
        return [p for n, sp in loss_sets(eval_cfg).items() for p in loss_problems(eval_cfg, tokenizer, n, sp)]
    lo, f = eval_cfg.loss, _field(name)
    try:
        hs = _hay(spec, tokenizer, name)
    except EvalError as e:
        return [str(e)]
    out = []
    cap = hs.n_tokens + len(hs.sep) * (len(hs.table) - 1)
    if eval_cfg.lengths and max(eval_cfg.lengths) > cap:
        out.append(
            f"{f}={spec!r}: its val split holds {cap:,} tokens < the longest eval length "
            f"{max(eval_cfg.lengths)}; use a dataset with more val text (or 'DIR' for all buckets)"
        )
    if lo.short_docs and not _short_docs(hs, lo.short_min, lo.short_max, 1, eval_cfg.seed):
        out.append(
            f"{f}={spec!r}: no val document of {lo.short_min}..{lo.short_max} tokens for the "
            f"short-document loss; use 'DIR' (all buckets) or set eval.loss.short_docs=0"
        )
    return out


def loss_inputs(eval_cfg, tokenizer: TokenizerLike, name=None, spec=None) -> dict:
    """{'source', 'by_length': {L: [ids] * n}, 'short': [ids per document]}: the sequences of one held-out
    set (name None: eval.loss.data; else eval.loss.sets[name], or `spec`), for every arm the same."""
    lo = eval_cfg.loss
    spec = spec or (lo.data if name is None else lo.sets[name])
    problems = loss_problems(eval_cfg, tokenizer, name, spec)
    if problems:
        raise EvalError("; ".join(problems))
    hs = _hay(spec, tokenizer, name)
    by_length = {}
    for L in sorted(set(eval_cfg.lengths)):
        # seed per (seed, L, i): adding a length or raising n keeps the other sequences
        by_length[L] = [hs.tokens(L, seed=_seed(eval_cfg.seed, L, i)) for i in range(lo.n)]
    docs = _short_docs(hs, lo.short_min, lo.short_max, lo.short_docs, eval_cfg.seed) if lo.short_docs else []
    short = [hs.table.doc(d).astype("int64").tolist() for d in docs]
    return {"source": spec, "by_length": by_length, "short": short}


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def _digest(seqs) -> str:
    h = hashlib.sha256()
    for s in seqs:
        h.update(b",".join(str(i).encode() for i in s))
        h.update(b"\n")
    return h.hexdigest()[:16]


class _LastHidden:
    """Forward hook on the last block: its output (B, T_local, d), before the final norm."""

    def __init__(self, model):
        self.h = None
        self.handle = model.layers[-1].register_forward_hook(self._hook)

    def _hook(self, mod, args, out):
        self.h = out

    def close(self):
        self.handle.remove()


@torch.no_grad()
def sequence_nll(
    model, ids: list[int], *, sp_group=None, tail_from: Optional[int] = None
) -> tuple[float, int, float, int]:
    """(sum of next-token NLL in nats, tokens scored, tail sum, tail tokens) of one sequence.

    Positions 0..T-2 predict tokens 1..T-1; the tail is the predictions at positions >= tail_from."""
    dev = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    T = x.shape[1]
    sp = dist.get_world_size(sp_group) if sp_group is not None else 1
    tail_from = T if tail_from is None else tail_from
    hook = _LastHidden(model)
    try:
        if sp > 1:
            r = dist.get_rank(sp_group)
            Tp = -(-T // sp) * sp
            per = Tp // sp
            xp = torch.cat([x, x[:, -1:].expand(1, Tp - T)], 1) if Tp != T else x
            pos = torch.arange(r * per, (r + 1) * per, device=dev)[None]
            # rope_len: the whole sequence's length picks the rope (rope.yarn.apply=beyond_original), not the slice's
            model(xp[:, r * per : (r + 1) * per], position_ids=pos, logits_index=-1, rope_len=T)
            first = r * per
        else:
            model(x, logits_index=-1)
            first = 0
        h = hook.h
    finally:
        hook.close()
    stats = torch.zeros(4, dtype=torch.float64, device=dev)
    for s in range(0, h.shape[1], HEAD_CHUNK):
        g = torch.arange(first + s, first + min(s + HEAD_CHUNK, h.shape[1]), device=dev)  # global positions
        keep = g < T - 1  # a next token exists (not end padding)
        if not bool(keep.any()):
            continue
        g = g[keep]
        logits = model.lm_head(model.norm(h[:, s : s + HEAD_CHUNK][:, keep]))  # (1, c, V)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32
        nll = F.cross_entropy(logits[0], x[0, g + 1], reduction="none").double()
        tail = g >= tail_from
        stats += torch.stack(
            [
                nll.sum(),
                torch.tensor(float(nll.numel()), device=dev, dtype=torch.float64),
                nll[tail].sum(),
                tail.sum().double(),
            ]
        )
    if sp > 1:
        dist.all_reduce(stats, group=sp_group)
    a, n, b, m = stats.tolist()
    return a, int(n), b, int(m)


def run_loss(model, data: dict, eval_cfg, *, sp_group=None, dp_group=None) -> dict:
    """The result's "loss" section (module docstring). Collective over sp_group and dp_group."""
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    dr = dist.get_rank(dp_group) if dp_group is not None else 0

    string = getattr(eval_cfg, "string", None)

    def nll(s, tail: bool):
        if string is not None:  # STRING for the sequences longer than eval.string.beyond only, S for its length
            apply_string(model, string if string.applies(len(s)) else None, len(s))
        return sequence_nll(model, s, sp_group=sp_group, tail_from=len(s) // 2 if tail else None)

    def score(seqs, tail: bool):
        mine = {i: nll(s, tail) for i, s in enumerate(seqs) if i % dp == dr}
        if dp > 1:
            parts: list = [None] * dp
            dist.all_gather_object(parts, mine, group=dp_group)
            mine = {k: v for p in parts for k, v in p.items()}
        return [mine[i] for i in range(len(seqs))]

    prev = installed(model)
    try:
        return _run_loss(data, eval_cfg, score)
    finally:
        if string is not None:
            apply_string(model, prev)  # as it came in (nll switched it per sequence)


def _run_loss(data: dict, eval_cfg, score) -> dict:
    """run_loss's sections from `score(seqs, tail)` (each sequence's sums, gathered over dp)."""
    by_length = []
    for L, seqs in data["by_length"].items():
        st = score(seqs, tail=True)
        a, n = sum(s[0] for s in st), sum(s[1] for s in st)
        b, m = sum(s[2] for s in st), sum(s[3] for s in st)
        per = [s[0] / max(s[1], 1) for s in st]
        by_length.append(
            {
                "length": L,
                "n": len(seqs),
                "tokens": n,
                "loss": a / n,
                "ppl": math.exp(a / n),
                "tail_loss": b / max(m, 1),
                "per_seq": per,
                "digest": _digest(seqs),
            }
        )
    out = {"data": data.get("source", eval_cfg.loss.data), "by_length": by_length, "short": None}
    if data["short"]:
        st = score(data["short"], tail=False)
        a, n = sum(s[0] for s in st), sum(s[1] for s in st)
        lo = eval_cfg.loss
        out["short"] = {
            "range": [lo.short_min, lo.short_max],
            "n_docs": len(st),
            "tokens": n,
            "loss": a / n,
            "ppl": math.exp(a / n),
            "per_doc": [[s[1], s[0] / max(s[1], 1)] for s in st],
            "digest": _digest(data["short"]),
        }
    return out
