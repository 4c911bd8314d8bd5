"""lm-eval backend `megablu`: every lm-evaluation-harness task on a megablu checkpoint.

lm-eval 0.4.13 finds a model only by name in its registry, and it loads no plugin entry points:
`lm_eval --model megablu` alone does not import megablu. Run lm-eval's own CLI through this module,
which registers the backend first (every lm-eval flag works as documented):

    python -m megablu.eval.lm_eval_adapter --model megablu \\
        --model_args ckpt=runs/ext32k/checkpoints/step_750,config=configs/ext32k.yaml \\
        --tasks hellaswag,niah_single_1 --metadata '{"max_seq_lengths": [4096, 32768]}'
    deepspeed --num_gpus 2 --module megablu.eval.lm_eval_adapter --model megablu \\
        --model_args ckpt=...,config=...,sp=2 --tasks niah_single_1 ...      (Ulysses-sharded prefill)

(the `--local_rank=N` the deepspeed launcher appends is dropped before lm-eval parses the arguments).

From Python, `import megablu.eval.lm_eval_adapter` then `lm_eval.simple_evaluate(model="megablu", ...)`.

The model is loaded as `megablu eval` loads it (eval/cli.py): the config's model, rope (YaRN and the
length-aware choice as trained), tokenizer and memory switches; --ckpt weights checked against the
tokenizer; a rope that differs from the checkpoint's needs rope_override=True. Model args:
  config (required), ckpt | hf (exactly one), set (config overrides `a.b=v`, several joined by ';'),
  rope_override, sp (Ulysses ranks; the launcher's world size), max_length (default data.window),
  prefill_chunk, batch_tokens (as in `megablu eval`), chat_template (a Jinja file), device, batch_size,
  decode (auto | eager | static | graph: how greedy decoding runs its steps, eval/decode.py; default the
  config's eval.decode).

- generate_until: megablu's greedy_generate (eval/generate.py, KV cache, one rank or a sharded prefill),
  the answer cut at the tokenizer's stop ids, then at the first `until` string (greedy: cutting after the
  fact gives the text stopping early would). Only prompts of equal token length are batched (the model
  takes no padding mask), max(1, batch_tokens // length) at a time. Sampling is refused.
- loglikelihood / loglikelihood_rolling: right-padded batches of batch_size rows (each row's real
  length is its rope_len), the vocab projection run only on the continuation's positions; EOT is the
  prefix of an empty context and of each rolling window (megablu separates documents with EOT).
- RULER (lm-eval's `ruler` tasks): their prompts are sized with the model's own tokenizer (the
  backend hands it to lm-eval's RULER code, which otherwise wants an HF tokenizer name).
  `install_ruler_offline` replaces the essay haystack's download with local prose.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .decode import MODES as DECODE_MODES
from .loss import _LastHidden  # the last block's output, before the final norm

log = logging.getLogger(__name__)

try:
    # lm-eval's own backends first: get_model imports them only while its registry is empty
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    LM_EVAL_MISSING: Optional[ImportError] = None
except ImportError as e:  # lm-eval not installed: the module still imports (tests skip, main() says why)
    TemplateLM, LM_EVAL_MISSING = object, e

# ChatML, the template of instruct models whose tokenizer has <|im_start|>/<|im_end|> (SmolLM2-Instruct,
# Qwen2), without a model's default system prompt: pass the model's own with chat_template= to match it
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class AdapterError(ValueError):
    """The backend cannot be built as asked; the message names the argument and the fix."""


def load_for_eval(
    config: str,
    ckpt: Optional[str] = None,
    hf: Optional[str] = None,
    sets=(),
    rope_override: bool = False,
    device: Optional[str] = None,
):
    """(model on its device in eval mode, tokenizer, config, info) exactly as `megablu eval` builds them:
    the config with overrides, the tokenizer, the rope checked against the checkpoint's, the weights,
    the eval's memory switches, the dtype (bf16 on a GPU when train.dtype=bf16). `device` ('cpu', 'cuda',
    'cuda:N') overrides train.device. Raises AdapterError with the reason."""
    from ..config import ConfigError, load_config
    from ..data.tokenizer import TokenizerError, load_tokenizer
    from ..memory.apply import apply_memory
    from . import cli
    from .prompts import EvalError

    try:
        cfg = load_config(config, list(sets))
    except ConfigError as e:
        raise AdapterError(f"config={config}: {e}") from None
    try:
        tok = load_tokenizer(cfg.tokenizer)
    except TokenizerError as e:
        raise AdapterError(f"tokenizer: {e}") from None
    dev, dtype = cli._device_and_dtype(cfg)
    if device is not None:
        dev = torch.device(device)
        dtype = torch.bfloat16 if (dev.type == "cuda" and cfg.train.dtype == "bf16") else torch.float32
    problems = cli._memory_problems(cfg, dev.type)
    if problems:
        raise AdapterError("; ".join(problems))
    args = SimpleNamespace(ckpt=ckpt, hf=hf, rope_override=rope_override)
    try:
        info = cli._rope_against_checkpoint(args, cfg)
    except EvalError as e:
        raise AdapterError(str(e).replace("--rope-override", "rope_override=True")) from None
    try:
        model, prov = cli._load_model(args, cfg, tok.identity)
    except Exception as e:  # any failure to build the model is reported with its cause
        raise AdapterError(
            f"cannot load weights: {type(e).__name__}: {e}".replace("--ckpt", "ckpt=").replace("--hf", "hf=")
        ) from None
    model = apply_memory(model, cli._eval_memory(cfg.memory), device=dev.type)
    return model.to(device=dev, dtype=dtype).eval(), tok, cfg, {**info, **prov}


class MegabluLM(TemplateLM):
    """A megablu model behind lm-eval's LM interface (module docstring)."""

    _ARGS = (
        "config",
        "ckpt",
        "hf",
        "set",
        "rope_override",
        "sp",
        "max_length",
        "prefill_chunk",
        "batch_tokens",
        "chat_template",
        "device",
        "batch_size",
        "max_batch_size",
        "decode",
    )

    def __init__(
        self,
        config: Optional[str] = None,
        ckpt: Optional[str] = None,
        hf: Optional[str] = None,
        set: Optional[str] = None,
        rope_override: bool = False,
        sp: int = 1,  # noqa: A002 (lm-eval's key)
        max_length: Optional[int] = None,
        prefill_chunk: Optional[int] = None,
        batch_tokens: Optional[int] = None,
        chat_template: Optional[str] = None,
        device: Optional[str] = None,
        batch_size=1,
        max_batch_size=None,
        decode: Optional[str] = None,
        *,
        model=None,
        tokenizer=None,
        window: Optional[int] = None,
        tokenizer_path: Optional[str] = None,
        **unknown,
    ):
        if LM_EVAL_MISSING is not None:
            raise ImportError(
                f"the megablu lm-eval backend needs lm-eval: pip install lm-eval==0.4.13 ({LM_EVAL_MISSING})"
            )
        super().__init__()
        if unknown:
            hint = (
                " (megablu sizes RULER prompts with the config's own tokenizer: drop it)"
                if {"tokenizer", "pretrained"} & unknown.keys()
                else ""
            )
            raise AdapterError(f"unknown megablu model_args {sorted(unknown)}{hint}; known: {', '.join(self._ARGS)}")
        self.sp = int(sp)
        self.sp_group = None
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != self.sp:
            raise AdapterError(
                f"sp={self.sp} but the launcher started {world} ranks: the megablu backend runs one "
                f"sequence-parallel group of all ranks; pass sp={world} (or launch {self.sp})"
            )
        cfg_decode = "auto"
        if model is None:
            if tokenizer is not None:
                raise AdapterError(
                    f"model_args tokenizer={tokenizer!r}: megablu uses the config's tokenizer (and "
                    f"sizes lm-eval's RULER prompts with it); drop tokenizer="
                )
            if not config:
                raise AdapterError("model_args needs config=<the run's YAML> and ckpt=<checkpoint> (or hf=<dir>)")
            if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
                log.warning(
                    "device=%s without CUDA (lm-eval's --device defaults to cuda:0): using the config's train.device",
                    device,
                )
                device = None
            if self.sp > 1:
                device = self._init_sp(device)
            sets = [s for s in (set or "").split(";") if s.strip()]
            model, tokenizer, cfg, self.info = load_for_eval(config, ckpt, hf, sets, _bool(rope_override), device)
            window = cfg.data.window
            tokenizer_path = tokenizer_file(cfg.tokenizer)
            cfg_decode = cfg.eval.decode
            if self.sp > 1:
                from ..parallel.groups import build_groups
                from ..parallel.ulysses import apply_ulysses

                groups = build_groups(self.sp)
                self.sp_group = groups.sp_group
                model = apply_ulysses(model, groups)
        else:  # an already-built model (tests, bench): one rank
            self.info = {}
            if tokenizer is None or window is None:
                raise AdapterError("MegabluLM(model=...) needs tokenizer= and window=")
        self.model, self.tok, self.tokenizer_path = model, tokenizer, tokenizer_path
        # how greedy decoding runs its steps (eval/decode.py): the config's eval.decode unless given here
        self.decode = str(decode) if decode is not None else cfg_decode
        if self.decode not in DECODE_MODES:
            raise AdapterError(f"model_args decode={self.decode!r}: one of {', '.join(DECODE_MODES)}")
        if self.sp > 1 and self.decode in ("static", "graph"):
            raise AdapterError(
                f"model_args decode={self.decode} with sp={self.sp}: sequence-parallel decode is eager; "
                f"pass decode=auto or decode=eager"
            )
        self._device = next(model.parameters()).device
        self._max_length = int(max_length or window)
        on_gpu = self._device.type == "cuda"
        self.prefill_chunk = int(prefill_chunk) if prefill_chunk is not None else (0 if on_gpu else 2048)
        self.batch_tokens = int(batch_tokens or (262144 if on_gpu else 16384))
        bs = str(batch_size)
        # "auto": rows from batch_tokens (as `megablu eval`); an int: that many rows
        self.batch_rows = None if bs.startswith("auto") else max(1, int(bs))
        self._chat_template = _read_template(chat_template) if chat_template else None
        install_ruler_tokenizer(self.tok)
        log.info(
            "megablu lm-eval backend: %s, window %d, sp %d, tokenizer %s",
            type(model).__name__,
            self._max_length,
            self.sp,
            self.tok.identity,
        )

    # ------------------------------------------------------------------ setup
    def _init_sp(self, device: Optional[str]) -> Optional[str]:
        """Start the process group (once) for the sp ranks the launcher started; the rank's GPU."""
        if not dist.is_initialized():
            import deepspeed

            from ..utils.dist import skip_cpu_shm_op

            skip_cpu_shm_op()
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            return f"cuda:{local}"
        return device if device == "cpu" else None

    # ------------------------------------------------------------------ lm-eval's interface
    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tok.identity.replace("/", "__").replace(":", "_")

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def chat_template(self, chat_template=False) -> Optional[str]:
        if chat_template is False or chat_template is None:
            return None
        return self._template()

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self._template()).render(
            messages=chat_history,
            add_generation_prompt=add_generation_prompt,
            bos_token="",
            eos_token=self.tok.decode([self.tok.eot_id]),
        )
        if add_generation_prompt or not chat_history:
            return text
        # lm-eval asks for no generation prompt when a task has a gen_prefix: the prefix is the last
        # (assistant) message and the model continues it, as transformers' continue_final_message (what
        # lm-eval's HF backend passes). Rendered whole, the template would close that message (ChatML:
        # "<|im_end|>") and the model would answer an ended turn.
        final = chat_history[-1]["content"]
        at = text.rfind(final.strip())
        if not final.strip() or at < 0:
            raise AdapterError(
                f"the chat template does not render the final message {final!r} verbatim, so it cannot be "
                f"continued (a task's gen_prefix): pass another chat_template= or drop --apply_chat_template"
            )
        keep = len(final.lstrip()) if text[at : at + len(final.lstrip())] == final.lstrip() else len(final.strip())
        return text[: at + keep]

    def _template(self) -> str:
        if self._chat_template is not None:
            return self._chat_template
        t = _tokenizer_template(self.tok, self.tokenizer_path)
        if t is None:
            raise AdapterError(
                f"tokenizer {self.tok.identity} has no chat template (no tokenizer_config.json "
                f"chat_template beside its tokenizer.json, no <|im_start|>/<|im_end|> tokens): pass "
                f"chat_template=<a Jinja file> in model_args, or drop --apply_chat_template"
            )
        return t

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from .generate import cut_at_stop, greedy_generate

        eos = self.tok.decode([self.tok.eot_id])
        jobs = []  # (request index, ids, max_new, until)
        for i, req in enumerate(requests):
            context, kw = req.args
            kw = dict(kw or {})
            if kw.get("do_sample") or float(kw.get("temperature", 0.0) or 0.0) > 0:
                raise AdapterError(
                    f"task {getattr(req, 'task_name', '?')} asks for sampling (do_sample="
                    f"{kw.get('do_sample')}, temperature={kw.get('temperature')}); megablu generates "
                    f"greedily: pass --gen_kwargs do_sample=False,temperature=0"
                )
            until = kw.get("until")
            until = [until] if isinstance(until, str) else list(until or [])
            if eos not in until:
                until.append(eos)
            max_new = int(kw.get("max_gen_toks", 256))
            if max_new >= self.max_length:
                raise AdapterError(f"max_gen_toks={max_new} >= max_length {self.max_length}")
            ids = self.tok_encode(context) or [self.tok.eot_id]
            keep = self.max_length - max_new
            if len(ids) > keep:  # as lm-eval's HF backend: the context's left end goes
                log.warning(
                    "context of %d tokens + max_gen_toks %d > max_length %d: keeping its last %d tokens",
                    len(ids),
                    max_new,
                    self.max_length,
                    keep,
                )
                ids = ids[-keep:]
            jobs.append((i, ids, max_new, until))
        out = [""] * len(requests)  # every request is one job below: each slot is written
        # equal lengths batch together (no padding mask); longest first, so a memory error comes first
        groups: dict[tuple[int, int], list] = {}
        for j in jobs:
            groups.setdefault((len(j[1]), j[2]), []).append(j)
        for (L, max_new), js in sorted(groups.items(), key=lambda kv: -kv[0][0]):
            rows = max(1, self.batch_tokens // (L + max_new)) if self.batch_rows is None else self.batch_rows
            for s in range(0, len(js), rows):
                batch = js[s : s + rows]
                x = torch.tensor([j[1] for j in batch], dtype=torch.long)
                gen = greedy_generate(
                    self.model,
                    x,
                    max_new,
                    sp_group=self.sp_group,
                    prefill_chunk=self.prefill_chunk,
                    stop_ids=self.tok.stop_ids,
                    decode=self.decode,
                ).tolist()
                for (i, _, _, until), g in zip(batch, gen, strict=True):
                    text = self.tok.decode(cut_at_stop(g, self.tok.stop_ids))
                    for u in until:
                        if u:
                            text = text.split(u)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    # ------------------------------------------------------------------ likelihoods
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: (cache key or None, context ids, continuation ids) -> (sum log p(cont | ctx), greedy)."""
        rows = []
        for n, (_key, ctx, cont) in enumerate(requests):
            if not cont:
                raise AdapterError("an empty continuation has no likelihood to score")
            seq = (list(ctx) + list(cont))[-(self.max_length + 1) :]
            if len(ctx) + len(cont) > self.max_length + 1:
                log.warning(
                    "context %d + continuation %d tokens > max_length %d + 1: the context's left end goes",
                    len(ctx),
                    len(cont),
                    self.max_length,
                )
            rows.append((n, seq[:-1], seq[-len(cont) :]))
        res: list = [None] * len(rows)
        rows.sort(key=lambda r: -len(r[1]))
        if self.sp_group is not None and dist.get_world_size(self.sp_group) > 1:
            for n, inp, cont in rows:
                res[n] = self._score_sp(inp, cont)
        else:
            s = 0
            while s < len(rows):
                L = len(rows[s][1])
                k = max(1, self.batch_tokens // L) if self.batch_rows is None else self.batch_rows
                batch = rows[s : s + k]
                scores = self._score_batch([r[1] for r in batch], [r[2] for r in batch])
                for (n, _, _), r in zip(batch, scores, strict=True):
                    res[n] = r
                s += k
        for (key, _, _), r in zip(requests, res, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, r)
        return res

    @torch.no_grad()
    def _score_batch(self, inps: list[list[int]], conts: list[list[int]]) -> list[tuple[float, bool]]:
        """Right-padded rows (B, Lmax): causal attention keeps each row's real positions exact, and each
        row's rope_len is its own length (the length-aware rope a row of that length gets)."""
        dev = self._device
        T = max(len(i) for i in inps)
        x = torch.full((len(inps), T), self.tok.eot_id, dtype=torch.long)
        for b, i in enumerate(inps):
            x[b, : len(i)] = torch.tensor(i)
        lens = torch.tensor([len(i) for i in inps], device=dev)
        hook = _LastHidden(self.model)
        try:
            self.model(x.to(dev), logits_index=-1, rope_len=lens)
            h = hook.h
        finally:
            hook.close()
        out = []
        for b, (i, c) in enumerate(zip(inps, conts, strict=True)):
            # positions len(i)-len(c) .. len(i)-1 predict the continuation's tokens
            hb = h[b : b + 1, len(i) - len(c) : len(i)]
            out.append(self._cont_score(hb, c))
        return out

    def _cont_score(self, h: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
        """h (1, n, d): the last block's output at the n positions predicting `cont`."""
        logits = self.model.lm_head(self.model.norm(h))[0]  # (n, V)
        logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1).double()
        tgt = torch.tensor(cont, device=logp.device)
        return float(logp.gather(1, tgt[:, None]).sum()), bool((logp.argmax(-1) == tgt).all())

    @torch.no_grad()
    def _score_sp(self, inp: list[int], cont: list[int]) -> tuple[float, bool]:
        """One row under sequence parallelism: each rank runs its slice of the end-padded row (global
        position_ids, rope_len the real length) and scores the continuation positions it holds; the sums
        (log p, misses of the argmax) are all-reduced over the sp group."""
        g = self.sp_group
        sp, r = dist.get_world_size(g), dist.get_rank(g)
        dev, T = self._device, len(inp)
        Tp = -(-T // sp) * sp
        per = Tp // sp
        x = torch.tensor([inp + [inp[-1]] * (Tp - T)], dtype=torch.long, device=dev)
        pos = torch.arange(r * per, (r + 1) * per, device=dev)[None]
        hook = _LastHidden(self.model)
        try:
            self.model(x[:, r * per : (r + 1) * per], position_ids=pos, logits_index=-1, rope_len=T)
            h = hook.h
        finally:
            hook.close()
        first = T - len(cont)  # global position predicting cont[0]
        lo, hi = max(first, r * per), min(T, (r + 1) * per)  # the ones this rank holds
        stats = torch.zeros(2, dtype=torch.float64, device=dev)
        if lo < hi:
            lp, greedy = self._cont_score(h[:, lo - r * per : hi - r * per], cont[lo - first : hi - first])
            stats += torch.tensor([lp, 0.0 if greedy else 1.0], dtype=torch.float64, device=dev)
        dist.all_reduce(stats, group=g)
        return float(stats[0]), bool(stats[1] == 0)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text scored whole in windows of max_length tokens, every token once (lm-eval's rolling
        windows, context_len 1), EOT as the first window's prefix; -> the sum of log p per text."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for w in get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            ):
                ctx, cont = make_disjoint_window(w)
                windows.append((None, ctx, cont))
                owner.append(n)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out = [0.0] * len(requests)
        for n, (lp, _) in zip(owner, scores, strict=True):
            out[n] += lp
        for req, lp in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, lp)
        return out


def _bool(v) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes")


def _read_template(path: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise AdapterError(
            f"chat_template={path}: no such file (a Jinja chat template, e.g. a model's "
            f"tokenizer_config.json 'chat_template' saved as text)"
        )
    return p.read_text()


def tokenizer_file(tcfg) -> Optional[str]:
    """The tokenizer.json an hf tokenizer config names (None for the other kinds)."""
    if tcfg.kind != "hf":
        return None
    from ..data.tokenizer import resolve_asset

    p = resolve_asset(tcfg.path, "hf")
    return str(p / "tokenizer.json" if p.is_dir() else p)


def _tokenizer_template(tok, path: Optional[str]) -> Optional[str]:
    """A chat template that belongs to the tokenizer: the one megablu's tokenizer read beside its
    tokenizer.json (the template the RULER suite wraps its prompts in), else tokenizer_config.json's beside
    `path`, else ChatML when the tokenizer has its <|im_start|>/<|im_end|> special tokens, else None."""
    own = getattr(tok, "chat_template", None)
    if isinstance(own, str) and own:
        return own
    inner = getattr(tok, "_tok", None)
    if path is not None:
        cfg = Path(path).with_name("tokenizer_config.json")
        if cfg.is_file():
            import json

            t = json.loads(cfg.read_text()).get("chat_template")
            if isinstance(t, str):
                return t
    if inner is not None and hasattr(inner, "token_to_id"):
        if inner.token_to_id("<|im_start|>") is not None and inner.token_to_id("<|im_end|>") is not None:
            return CHATML
    return None


# ---------------------------------------------------------------------- lm-eval's RULER tasks
class _RulerTokenizer:
    """What lm-eval's RULER code calls its TOKENIZER: `tok(text).input_ids`, here megablu's ids (no BOS)."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.vocab_size

    def __call__(self, text: str):
        return SimpleNamespace(input_ids=self.tok.encode(text))


def install_ruler_tokenizer(tok) -> None:
    """Make lm-eval's RULER tasks size their prompts with `tok` (megablu's) instead of loading an HF
    tokenizer by name (`tokenizer=`/`pretrained=` in --metadata, which a megablu model has not). A name
    given anyway is refused: prompts sized by another tokenizer would not have the asked lengths."""
    try:
        import lm_eval.tasks.ruler.common_utils as cu
    except ImportError:  # lm-eval without its RULER tasks' imports (transformers): nothing to hook
        return
    orig = getattr(cu, "_megablu_orig_get_tokenizer", cu.get_tokenizer)
    wrapped = _RulerTokenizer(tok)

    def get_tokenizer(tokenizer=None, pretrained=None, **kwargs):
        name = tokenizer or pretrained
        if name:
            raise AdapterError(
                f"RULER tokenizer {name!r} given (--metadata or model_args): the megablu backend "
                f"sizes RULER prompts with the model's own tokenizer ({tok.identity}); drop it"
            )
        return wrapped

    cu._megablu_orig_get_tokenizer = orig
    _patch_ruler_modules("get_tokenizer", get_tokenizer, cu)


def _patch_ruler_modules(name: str, fn, home) -> None:
    """Set `name` in its home module and in every loaded lm-eval RULER module that imported it by name.

    lm-eval loads a task YAML's `!function module.fn` from the file beside it and re-executes a module
    already in sys.modules unless it carries the file's mtime as `__mtime__` (tasks/_yaml_loader.py): the
    home module gets that mark, so lm-eval reuses it -- patched -- instead of a fresh copy."""
    setattr(home, name, fn)
    home.__mtime__ = Path(home.__file__).stat().st_mtime_ns
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("lm_eval.tasks.ruler.") and mod is not home and hasattr(mod, name):
            setattr(mod, name, fn)


def _split_sentences(text: str) -> list[str]:
    """A punkt-free sentence split (after . ! ? followed by whitespace), for machines without nltk's
    punkt_tab data (lm-eval's essay haystack uses nltk.sent_tokenize only to place the needles)."""
    import re

    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def install_ruler_offline(essay_text: str) -> dict:
    """Run lm-eval's RULER essay haystack offline: `datasets.load_dataset("baber/paul_graham_essays")`
    is replaced by `essay_text` (split into words as lm-eval splits the essays), and nltk's punkt_tab
    sentence splitter, when its data is absent, by _split_sentences. Returns what was replaced, for the
    record. Needs lm-eval's RULER dependencies (wonderwords, nltk)."""
    import re

    import lm_eval.tasks.ruler.prepare_niah as pn

    words = re.sub(r"\s+", " ", essay_text).strip().split(" ")
    if len(words) < 1000:
        raise AdapterError(
            f"local essay text has {len(words)} words; the essay haystack needs thousands "
            f"(RULER grows it 500 words at a time)"
        )
    orig = getattr(pn, "_megablu_orig_get_haystack", pn.get_haystack)

    def get_haystack(type_haystack):
        return words if type_haystack == "essay" else orig(type_haystack)

    pn._megablu_orig_get_haystack = orig
    _patch_ruler_modules("get_haystack", get_haystack, pn)
    done = {"essay_haystack": f"local text, {len(words)} words"}
    try:
        import nltk

        nltk.data.find("tokenizers/punkt_tab")
        done["sentences"] = "nltk punkt_tab"
    except LookupError:
        _patch_ruler_modules("cached_sent_tokenize", _split_sentences, pn)
        done["sentences"] = "regex split after . ! ? (nltk punkt_tab data absent)"
    return done


def main(argv: Optional[list[str]] = None) -> None:
    """lm-eval's CLI with the megablu backend registered (module docstring)."""
    if LM_EVAL_MISSING is not None:
        print(
            f"megablu lm-eval backend: lm-eval is not installed ({LM_EVAL_MISSING}); pip install lm-eval==0.4.13",
            file=sys.stderr,
        )
        raise SystemExit(2)
    from lm_eval.__main__ import cli_evaluate

    # registers the backend: run as `python -m`, this file is __main__, whose copy of the class is not registered
    import megablu.eval.lm_eval_adapter  # noqa: F401

    argv = list(sys.argv[1:] if argv is None else argv)
    sys.argv = [sys.argv[0]] + strip_local_rank(argv)
    cli_evaluate()


def strip_local_rank(argv: list[str]) -> list[str]:
    """argv without the `--local_rank=N` the deepspeed launcher adds (lm-eval's parser refuses it; the
    launcher also sets LOCAL_RANK, which is what the sp setup reads)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--local_rank":
            skip = True
        elif not a.startswith("--local_rank="):
            out.append(a)
    return out


# the backend under its name, once: as `python -m` this file also runs as __main__, and lm-eval's registry
# refuses a second class under one name
if LM_EVAL_MISSING is None and __name__ != "__main__":
    register_model("megablu")(MegabluLM)

if __name__ == "__main__":
    main()
