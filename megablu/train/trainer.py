"""The training loop: DeepSpeed engine + Ulysses SP + ZeRO, exact resume, metrics, checkpoints.

Trainer(cfg).train() does, in order: init_distributed -> groups (dp x sp) -> run dir
(allocated or resumed, its liveness lock taken) -> tokenizer + data (verified) -> BluModel
(init_from weights) -> apply_ulysses -> deepspeed.initialize -> resume state -> steps ->
final checkpoint/eval -> summary.json of the whole run (from metrics.csv).
The config was validated and every input checked before this point (train/preflight.py,
called by launch/ext32k.py and `megablu config check`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..config import Config, ConfigError, config_hash, grad_accum_steps, to_yaml
from ..memory.apply import apply_memory
from ..model.decoder import BluModel
from ..parallel.groups import Groups, build_groups
from ..parallel.ulysses import apply_ulysses
from ..utils.device import mfu, peak_bf16_tflops, resolve_device
from ..utils.dist import broadcast_object, is_rank0, skip_cpu_shm_op
from .metrics import MetricsWriter
from .schedule import lr_at
from .step import forward_backward
from .step_profile import no_timer
from .tracker import open_tracker

if TYPE_CHECKING:
    from .runs import RunLock

log = logging.getLogger(__name__)


def deepspeed_config(cfg: Config, grad_accum: int, dp: int, device: str) -> dict:
    z = cfg.parallel
    zero: dict = {"stage": z.zero_stage}
    if z.zero_stage == 3:
        zero["reduce_scatter"] = z.reduce_scatter
    if z.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device == "cuda"}
    if z.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device == "cuda"}
    ds = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": cfg.train.micro_batch * grad_accum * dp,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.train.dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    if z.offload_optimizer:
        # ZeRO-Offload steps the optimizer on the CPU with DeepSpeed's CPU Adam
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": cfg.schedule.lr,
                "betas": list(cfg.train.betas),
                "eps": cfg.train.eps,
                "weight_decay": cfg.train.weight_decay,
            },
        }
    return ds


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not norms, biases)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class _OutOfTime(Exception):
    """train.stop_after_s ran out inside the probe's steps (the checkpoint is saved)."""


class GateFailed(RuntimeError):
    """The run's final eval failed the short-context gate (the checkpoint is saved)."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


class Trainer:
    def __init__(self, cfg: Config, *, resume: Optional[str] = None, local_rank: Optional[int] = None):
        self.cfg = cfg
        self.resume = resume
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        self.device = resolve_device(cfg.train.device, require=True)
        from ..plan import flops_per_token

        self._flops_per_token = flops_per_token(cfg.model, cfg.data.window)
        self._peak_tflops = peak_bf16_tflops(index=self.local_rank) if self.device == "cuda" else None
        self._gate_failure: Optional[str] = None
        self.run_dir: Optional[Path] = None  # known once setup allocated or found it
        self.lock: Optional[RunLock] = None  # rank 0: the run's liveness lock
        # train.stop_after_s: this session's wall-clock budget, counted from the Trainer's start
        self._t_start = time.monotonic()
        self._timed, self._out_of_time, self._slowest_extra = False, False, 0.0
        self._step_s: list[float] = []  # unprofiled step times, for train.profile_step's report
        if not resume:
            # the parent-RoPE trap (config/lineage.py), also for a Trainer built without the
            # entry's preflight (the Python API): refused before any rank or run dir exists
            from .preflight import init_from_rope_problems

            problems = init_from_rope_problems(cfg, deep=False)
            if problems:
                raise ConfigError(problems, "(Trainer)")

    @property
    def run_path(self) -> Path:
        """run_dir, once setup has allocated or found it."""
        if self.run_dir is None:
            raise RuntimeError("Trainer: the run dir is allocated in setup; nothing before it writes there")
        return self.run_dir

    # ------------------------------------------------------------------ setup
    def _init_distributed(self) -> Groups:
        import deepspeed

        from ..parallel.topology import ranks_per_node_from_env

        # deepspeed's launcher sets LOCAL_SIZE, torchrun LOCAL_WORLD_SIZE
        ranks_per_node = ranks_per_node_from_env()
        if self.device == "cuda":
            torch.cuda.set_device(self.local_rank)
        else:
            # CPU ranks share the cores: one rank per core-share, no oversubscription
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // (ranks_per_node or 1)))
            skip_cpu_shm_op()  # an inference-only op DeepSpeed would JIT-build in init_distributed
        deepspeed.init_distributed(dist_backend="nccl" if self.device == "cuda" else "gloo")
        return build_groups(self.cfg.parallel.sp, ranks_per_node)

    def _run_dir(self) -> Path:
        from .runs import RunError, RunLock, allocate_run, find_run

        path, err = None, None
        if is_rank0():
            try:
                if self.resume:
                    path = str(find_run(self.cfg.runs_dir, self.resume))
                else:
                    path = str(allocate_run(self.cfg.runs_dir, self.cfg.name))
                # one job per run: a second one refuses, naming this one (host, pid, heartbeat)
                self.lock = RunLock.acquire(path)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                err = str(e) if isinstance(e, RunError) else f"{type(e).__name__}: {e}"
        path, err = broadcast_object((path, err))
        if err:  # every rank raises, none waits on a collective rank 0 left
            raise RunError(f"run dir: {err}")
        return Path(path)

    def release(self) -> None:
        """Give up the run's lock (rank 0); called when training ends, however it ends."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _build_model(self) -> BluModel:
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)
        model = BluModel(cfg.model, cfg.rope, seed=cfg.train.seed)
        if cfg.init_from and not self.resume:
            from ..checkpoint import load_weights, resolve_parent, resolve_step_collective
            from .preflight import init_from_rope_problems

            # a run dir means its newest verified checkpoint: decided once, on rank 0, so that
            # a save landing meanwhile cannot give two ranks two different parents
            src = str(resolve_step_collective(cfg.init_from, resolve=resolve_parent))
            # the rope against the record of exactly the step loaded (the preflight read the same rule)
            problems = init_from_rope_problems(cfg, src)
            if problems:
                raise ConfigError(problems, f"(init_from {src})")
            # embeddings trained with another tokenizer have the right shape and mean nothing
            load_weights(model, src, tokenizer=self.tokenizer.identity)
            log.info("initialised weights from %s", src)
        return model

    def setup(self) -> None:
        import deepspeed

        cfg = self.cfg
        self.groups = g = self._init_distributed()
        self.grad_accum = grad_accum_steps(cfg, g.world_size)
        self.run_dir = self._run_dir()
        if is_rank0():
            log.info("topology: %s", g.describe())
            log.info(
                "run dir: %s; grad_accum %d; tokens/step %d", self.run_dir, self.grad_accum, cfg.train.tokens_per_step
            )
            if not self.resume:
                self._write_resolved()

        from ..data.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(cfg.tokenizer)  # its vocab against the model: preflight

        from ..data.loader import build_loader
        from ..data.mix import planned_sequences, write_mixture

        self.loader = build_loader(
            cfg.data,
            self.tokenizer.identity,
            micro_batch=cfg.train.micro_batch,
            dp_rank=g.dp_rank,
            dp_size=g.dp,
            total_sequences=planned_sequences(cfg),
        )

        # built on the CPU, moved by DeepSpeed: memory.loss=auto is resolved for the run's device
        model = apply_memory(self._build_model(), cfg.memory, device=self.device)
        apply_ulysses(model, g)
        self.model = model
        ds_cfg = deepspeed_config(cfg, self.grad_accum, g.dp, self.device)
        opt = None
        if "optimizer" not in ds_cfg:
            fused = {"fused": True} if self.device == "cuda" else {}
            opt = torch.optim.AdamW(
                param_groups(model, cfg.train.weight_decay),
                lr=cfg.schedule.lr,
                betas=cfg.train.betas,
                eps=cfg.train.eps,
                **fused,
            )
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=opt,
            model_parameters=None if opt is not None else param_groups(model, cfg.train.weight_decay),
            config=ds_cfg,
            mpu=g if g.sp > 1 else None,
        )
        if cfg.train.fused_grad_check:
            from .grad_check import install

            why = install(self.engine.optimizer)
            if is_rank0():
                log.info(
                    "train.fused_grad_check: %s",
                    "on (ZeRO-1/2's gradient checks as multi-tensor passes)"
                    if why is None
                    else f"DeepSpeed's own gradient checks run ({why})",
                )

        from ..checkpoint import CheckpointManager

        self.ckpt = CheckpointManager(
            self.run_dir,
            cfg.checkpoint.keep,
            keep_every=cfg.checkpoint.keep_every,
            meta={
                "config_hash": config_hash(cfg),
                "tokenizer": self.tokenizer.identity,
                "world_size": g.world_size,
                "dp": g.dp,
                "sp": g.sp,
                "zero_stage": cfg.parallel.zero_stage,
                # enough to export or evaluate a checkpoint without the YAML it came from
                "model": cfg.model.model_dump(mode="json"),
                "rope": cfg.rope.model_dump(mode="json"),
                "window": cfg.data.window,
                # the whole config: a resume that differs names the fields (train/resume.py)
                "config": cfg.model_dump(mode="json"),
            },
        )
        self.step, self.tokens_seen = 0, 0
        self._session_start = 0
        if self.resume:
            self._load_resume()
            if is_rank0():  # written only now that the resume is accepted
                self._write_resolved()
            self._session_start = self.step
        if is_rank0():  # what each source contributes (token shares, epochs, truncation, padding)
            write_mixture(self.run_path, self.loader.mixture)
        self.metrics = (
            MetricsWriter(
                self.run_path, self.step, open_tracker(cfg.train.tracker, self.run_path, cfg.model_dump(mode="json"))
            )
            if is_rank0()
            else None
        )
        if self.resume and self.step > 0 and self._eval_due(self.step):
            # killed between the save of an eval step and its result: evaluate that step now
            done = broadcast_object((self.run_path / "eval" / f"step_{self.step}.json").exists())
            if not done:
                log.info("step %d was due an eval that did not finish before the stop: evaluating now", self.step)
                self._evaluate()

    def _load_resume(self) -> None:
        from ..checkpoint import CheckpointError, set_rng_state

        # verified once on rank 0 (sha256 of every file), then every rank loads the same step
        path = self.ckpt.resume_point() if is_rank0() else None
        path = broadcast_object(str(path) if path else None)
        path = Path(path) if path else None
        if path is None:
            raise CheckpointError(
                f"resume: no verified checkpoint in {self.run_dir}/checkpoints; start without --resume"
            )
        state = self.ckpt.load(self.engine, path, allow_config_change=self._allowed_change(path))
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        if is_rank0():
            log.info("resumed from %s at step %d (%d tokens seen)", path, self.step, self.tokens_seen)
            from .resume import loss_change

            note = loss_change(self.run_path, self.step, self.model.lm_head.loss)
            if note:
                log.warning(note)

    def _allowed_change(self, path: Path) -> bool:
        """True when the checkpoint's config differs from this run's only in what a resume may
        change (train/resume.py RESUMABLE: parallel.sp, memory.loss, the checkpoint cadence, a
        train.max_steps that leaves the trained part of the LR curve unchanged); the preflight refused
        anything else, naming the fields.

        sp: Ulysses shards activations, not weights: the weights and ZeRO partitions (over all
        dp x sp ranks) do not depend on sp, and the loader's position is global, so such a
        resume continues the same run (tokens_per_step fixed; grad accumulation follows dp).
        max_steps: the LR is a pure function of the step; the loader's order does not depend on it.
        """
        from ..checkpoint import read_manifest
        from ..checkpoint.layout import step_number
        from .resume import config_changes, resume_problems, saved_config

        m = read_manifest(path)
        if m.get("config_hash") == config_hash(self.cfg):
            return False
        saved = saved_config(path, m)
        if saved is None:
            # no recorded config: an sp change alone is recognised by the hash
            saved_sp = m.get("sp")
            if saved_sp in (None, self.cfg.parallel.sp):
                return False
            same = self.cfg.model_copy(update={"parallel": self.cfg.parallel.model_copy(update={"sp": saved_sp})})
            return config_hash(same) == m.get("config_hash")
        if resume_problems(saved, self.cfg, step_number(path)):
            return False  # check_compatible refuses and names the fields
        if is_rank0():
            changes = config_changes(saved, self.cfg.model_dump(mode="json"))
            log.warning(
                "resume: %s (dp %s -> %s); weights, optimizer and data position carry over unchanged",
                ", ".join(f"{k} {a} -> {b}" for k, a, b in changes),
                m.get("dp"),
                self.groups.dp,
            )
        return True

    def _write_resolved(self) -> None:
        """runs/<id>/config.resolved.yaml: the config this run's checkpoints are saved with, so that
        `--config runs/<id>/config.resolved.yaml --resume <id>` continues it. train.stop_after (an
        invocation's time slice) and train.profile_step (its profiled step) are not the run's and are
        left out. A resume that changed the run (max_steps, sp) keeps the previous file as
        config.before.<unix>.yaml."""
        resolved = self.run_path / "config.resolved.yaml"
        session = {"stop_after": None, "profile_step": None}  # an invocation's, not the run's
        text = to_yaml(self.cfg.model_copy(update={"train": self.cfg.train.model_copy(update=session)}))
        if resolved.exists():
            if resolved.read_text() == text:
                return
            resolved.rename(self.run_path / f"config.before.{int(time.time())}.yaml")
        tmp = resolved.with_name(f".{resolved.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, resolved)

    def _client_state(self) -> dict:
        from ..checkpoint import get_rng_state

        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "loader": self.loader.state_dict(),
            "rng": get_rng_state(),
            "schedule": {"kind": self.cfg.schedule.kind, "lr": self._lr},
        }

    # ------------------------------------------------------------------ loop
    def _train_step(self, timer=no_timer) -> tuple[float, Optional[float]]:
        """One optimizer step over grad_accum micro-batches; returns (token-mean loss, grad norm)."""
        with timer("data"):
            micro = [self.loader.next_batch() for _ in range(self.grad_accum)]
        loss = forward_backward(
            self.engine,
            micro,
            self.groups,
            self.cfg.parallel.zero_stage,
            self.cfg.parallel.reduce_scatter,
            doc_mask=self.cfg.data.doc_mask,
            doc_positions=self.cfg.data.doc_positions,
            timer=timer,
        )
        with timer("grad_norm"):
            gn = self.engine.get_global_grad_norm()
            gn = float(gn) if gn is not None else None
        return loss, gn

    def _profiled_train_step(self) -> tuple[float, Optional[float]]:
        """train.profile_step: this step under torch.profiler, profile/step_<N>.md in the run dir."""
        from .step_profile import run_profiled

        n = self.step + 1
        others = statistics.median(self._step_s) if self._step_s else None
        out = run_profiled(
            self._train_step,
            device=self.device,
            step=n,
            run_dir=self.run_path,
            others_median_s=others,
            trace_max_mib=self.cfg.train.profile_trace_mib,
            write=is_rank0(),
        )
        if is_rank0():
            log.info("step %d profiled: %s", n, self.run_path / "profile" / f"step_{n}.md")
        return out

    def _set_lr(self) -> None:
        self._lr = lr_at(self.step, self.cfg.schedule, self.cfg.train.max_steps)
        for pg in self.optimizer.param_groups:
            pg["lr"] = self._lr

    def train(self) -> dict:
        try:
            return self._train()
        finally:
            self.release()

    def _train(self) -> dict:
        from tqdm import tqdm

        self.setup()
        cfg, g = self.cfg, self.groups
        losses: list[float] = []
        tok_s: list[float] = []
        bar = tqdm(
            total=cfg.train.max_steps,
            initial=self.step,
            disable=not is_rank0(),
            file=sys.stderr,
            desc=cfg.name,
            dynamic_ncols=True,
        )
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        stop = min(cfg.train.max_steps, cfg.train.stop_after or cfg.train.max_steps)
        self._losses, self._tok_s = losses, tok_s

        def one_step(_i: int = 0) -> float:
            if self._out_of_time:  # the probe asks for a step after the budget ran out
                raise _OutOfTime
            return self._one_step(bar, stop)

        self._timed = cfg.train.stop_after_s is not None
        try:
            n_probe = min(cfg.train.probe_steps, stop - self.step)
            if n_probe > 0:
                try:
                    self._probe(one_step, n_probe)
                except _OutOfTime:  # a resumed session's probe cut by train.stop_after_s: no probe file
                    pass
            while self.step < stop and not self._out_of_time:
                one_step()
        finally:  # closed before any error is reported, so the bar is not the last line on stderr
            bar.close()
        if self._out_of_time and is_rank0():
            log.warning(
                "stopped at step %d of %d: train.stop_after_s=%g would be exceeded by the next step; "
                "checkpoint saved; continue with --resume %s",
                self.step,
                cfg.train.max_steps,
                cfg.train.stop_after_s,
                self.run_dir,
            )
        if self.metrics is not None:
            self.metrics.close()
        from .metrics import run_summary

        # the whole run, every session, from metrics.csv (rank 0 has it; the others get it)
        summary = None
        if is_rank0():
            session = {"from_step": self._session_start, "to_step": self.step, "world": g.describe()}
            stopped = f"train.stop_after_s={cfg.train.stop_after_s:g}" if self._out_of_time else None
            summary = run_summary(self.run_path, session, gate=self._gate_failure, stopped=stopped)
        summary = broadcast_object(summary)
        if self._gate_failure:
            raise GateFailed(self._gate_failure, summary)
        return summary

    def _probe(self, one_step, n: int) -> None:
        """The run's first n steps, measured: probe.json in the run dir (ProbeOOM on OOM)."""
        from .probe import ProbeOOM, run_probe, setup_dict

        cfg, g = self.cfg, self.groups
        rank0 = g.rank == 0
        name = "probe.json" if self.step == 0 else f"probe.step{self.step}.json"
        try:
            run_probe(
                one_step,
                steps=n,
                device=self.device,
                tokens_per_rank=cfg.train.micro_batch * cfg.data.window // g.sp,
                tokens_per_step=cfg.train.tokens_per_step // g.world_size,
                flops_per_token=self._flops_per_token,
                peak_tflops=self._peak_tflops,
                setup=setup_dict(cfg, g.world_size, loss_used=self.model.lm_head.loss),
                world_size=g.world_size,
                out=self.run_path / name if rank0 else None,
            )
        except ProbeOOM as e:
            if not rank0:  # rank 0 wrote probe.json; the rank that ran out writes its own
                (self.run_path / f"probe.rank{g.rank}.json").write_text(json.dumps(e.measured, indent=2) + "\n")
            raise

    def _one_step(self, bar, stop: int) -> float:
        """One optimizer step: lr, fwd/bwd over grad_accum micro-batches, metrics, checkpoint/eval.

        Returns the seconds spent on the checkpoint/eval after the step (the probe does not time them)."""
        cfg, losses, tok_s = self.cfg, self._losses, self._tok_s
        self._set_lr()
        t0 = time.perf_counter()
        profiled = cfg.train.profile_step == self.step + 1
        loss, gnorm = self._profiled_train_step() if profiled else self._train_step()
        if self.device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if not profiled:
            self._step_s.append(dt)
        self.step += 1
        self.tokens_seen += cfg.train.tokens_per_step
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {self.step}; stopping (no checkpoint written)")
        mem = torch.cuda.max_memory_allocated() / 1e9 if self.device == "cuda" else 0.0
        u = mfu(self._flops_per_token, cfg.train.tokens_per_step / self.groups.world_size, dt, self._peak_tflops)
        row: dict[str, Any] = {
            "step": self.step,
            "loss": loss,
            "lr": self._lr,
            "tokens_seen": self.tokens_seen,
            "step_time_s": dt,
            "tokens_per_s": cfg.train.tokens_per_step / dt,
            "max_mem_gb": mem,
            "grad_norm": gnorm if gnorm is not None else "",
            "mfu": round(u, 4) if u is not None else "",
        }
        losses.append(loss)
        tok_s.append(row["tokens_per_s"])
        if self.metrics is not None:
            self.metrics.write(row)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{self._lr:.2e}", tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update(1)
        t1 = time.perf_counter()
        if self._timed and self.step < stop:
            self._out_of_time = self._time_is_up(time.perf_counter() - t0)
        self._maybe_checkpoint_and_eval(stopping=self.step == stop or self._out_of_time)
        spent = time.perf_counter() - t1
        self._slowest_extra = max(self._slowest_extra, spent)
        return spent

    def _time_is_up(self, step_s: float) -> bool:
        """Would one more step, and a checkpoint after it, end past train.stop_after_s? Decided on
        rank 0 and broadcast, so every rank stops after the same step."""
        if is_rank0():
            elapsed = time.monotonic() - self._t_start
            # the slowest checkpoint/eval so far stands in for the save at the stop (the first save:
            # assume it costs a step)
            save_s = self._slowest_extra or step_s
            budget = self.cfg.train.stop_after_s
            assert budget is not None  # asked only when train.stop_after_s is set (self._timed)
            up = elapsed + 1.2 * step_s + save_s > budget
        else:
            up = None
        return bool(broadcast_object(up))

    def _eval_due(self, s: int) -> bool:
        return s in self.cfg.eval.at_steps or (s == self.cfg.train.max_steps and self.cfg.eval.final)

    def _maybe_checkpoint_and_eval(self, stopping: bool = False) -> None:
        cfg, s = self.cfg, self.step
        last = s == cfg.train.max_steps
        do_eval = self._eval_due(s)
        every = cfg.checkpoint.every_steps
        if do_eval or (every and s % every == 0) or (last and cfg.checkpoint.save_final) or (stopping and not last):
            self.ckpt.save(self.engine, s, self._client_state(), pin=do_eval)
        if do_eval:
            self._evaluate()

    def _evaluate(self) -> None:
        """Evaluate (collective over the sp group); the final eval's gate decides the exit code.

        The dp groups split the prompts (gathered back); only rank 0 writes. The short-context gate
        (eval.gate.parent) is logged at every eval; when the final eval of the run fails it,
        the run ends with GateFailed after its checkpoint is safely published.
        """
        from ..eval.harness import run_eval

        self.engine.eval()
        try:
            res = run_eval(
                self.engine.module,
                self.tokenizer,
                self.cfg.eval,
                self.cfg.data.window,
                sp_group=self.groups.sp_group if self.groups.sp > 1 else None,
                step=self.step,
                dp_group=self.groups.dp_group if self.groups.dp > 1 else None,
                out_dir=self.run_path / "eval",
                rank=self.groups.rank,
            )
        finally:
            self.engine.train()
        gate = res.get("gate")
        if gate is not None and not gate["passed"] and self.step == self.cfg.train.max_steps:
            self._gate_failure = gate["message"]


# the preflight lived here; its checks are in preflight.py (kept importable from here)
from .preflight import init_from_rope_problems, preflight  # noqa: E402,F401
