"""Activation offload: each decoder block's saved activations go to pinned host memory in the
forward and come back, one block ahead, in the backward.

What goes to host. Everything autograd saves while a block's forward runs (a
`torch.autograd.graph.saved_tensors_hooks` pair wraps each `Block.forward`), except:
  - parameters and anything sharing a parameter's storage (a transposed weight, a ZeRO flat
    buffer view): saved by reference, never copied;
  - the tensors the caller names (the RoPE cos/sin tables, shared by every layer);
  - storages under `min_bytes` (rstd and, at short T, the LSE): copying them costs more
    in launch latency than they weigh.
Which tensors are saved is the recompute mode's business (apply.py, around decoder.Block): with
`selective`, attention's inputs and outputs (the layer input, the norm state, post-RoPE
q/k/v, the attention output and LSE: attention is never recomputed) and the MLP's input h;
with `full`, the layer input only (the activation-checkpoint offload of ALST); with
`none`, everything, MLP intermediates included unless the MLP is tiled. The checkpoints
are made reentrant under offload: the non-reentrant checkpoint holds its inputs by Python
reference where no hook sees them; the reentrant one saves them with save_for_backward.
A storage saved several times (y is saved by the q, k and v projections) is copied once;
each saved tensor comes back as a view of it (same offset, size, stride).

When. Forward: at pack time the device-to-host copy is queued on a side CUDA stream after
an event on the compute stream (the copy sees the finished tensor), and the source is
`record_stream`-ed on the side stream so the allocator cannot hand its memory out before
the copy has read it; no compute waits. At most two blocks' copies are in flight: before
block i starts, the host waits for block i-2's copies (bounds the GPU memory that pending
copies pin when the link is slower than compute). Backward: the first unpack of block i
makes the compute stream wait for block i's host-to-device copies (issued earlier as a
prefetch, or now) and issues block i-1's copies on the side stream, so they run during
block i's backward. When block i's last saved tensor has been unpacked its device copies
are dropped. The last `keep_last` (1) blocks are not offloaded at all: the backward needs
them first, so a round trip would only stall it; the last offloaded block is brought back as
soon as the forward ends. GPU activation memory is then about two blocks' saved sets, whatever
the depth; host memory holds the others (megablu/plan/memory.py: `host_gb`).

Why long T hides the transfer. The bytes to move per layer grow like T (per token: 11.3 KB
with selective recompute for blu-0.5b, 2 KB with full; megablu/plan/memory.py), the compute per
layer like T * (linear flops + T * attention flops): per token the linear part is fixed and
the causal attention part grows with T, so past some T every copy hides. Estimate for
blu-0.5b on an H200 (host link ~50 GB/s per direction, PCIe Gen5 x16, not measured here):
at T=32k a layer's forward takes ~9.5 ms (a third of a ~1 s fwd+bwd step over 36 layers;
experiments/speed/LOG.md has the step) and its selective saved set (370 MB) ~7.4 ms to copy: about even; at 128k the
forward work per token is ~3x that at 32k (causal attention 2*T*H*D = 268 MFLOP against
22.5 MFLOP of linears) and the copy needs about a quarter of it; the layer-input-only
copy of `full` (67 MB at 32k) hides at any T worth running. The backward does ~2x the
forward's work against the same bytes, so it hides earlier. bench/train_bench.py measures it.

On CPU tensors there is nothing to offload: pack returns the tensor (no-op), unless
`copy_cpu=True` (the tests), which runs the whole pack/dedup/restore path with plain CPU
copies so gradient equality is checked without a GPU. torch's own
`torch.autograd.graph.save_on_cpu` copies on the compute stream, does not deduplicate
storages, copies weights' views and fetches at use time (no prefetch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Optional

import torch
from torch import nn

from .constants import KEEP_LAST, MAX_INFLIGHT, MIN_BYTES, offloaded


class _Stored:
    """One storage copied to host, shared by every saved tensor that views it."""

    __slots__ = ("host", "device", "dev_copy")

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host = host  # uint8 (nbytes,), pinned when the source was on a GPU
        self.device = device
        self.dev_copy: Optional[torch.Tensor] = None  # uint8 on `device` while restored


class _Packed:
    """What autograd holds instead of a saved tensor: the storage and the view into it."""

    __slots__ = ("block", "stored", "dtype", "offset", "size", "stride")

    def __init__(self, block: _BlockState, stored: _Stored, t: torch.Tensor):
        self.block, self.stored = block, stored
        self.dtype, self.offset, self.size, self.stride = t.dtype, t.storage_offset(), t.shape, t.stride()


class _BlockState:
    """One block's offloaded storages in one forward pass; `prev` is the block before it."""

    def __init__(self, owner: ActivationOffload, module: nn.Module, keep: tuple, prev: Optional[_BlockState]):
        self.owner, self.module, self.prev = owner, module, prev
        self.keep = keep
        self.stored: list[_Stored] = []
        self.by_ptr: dict[int, _Stored] = {}  # dedup, during this block's forward only
        self.sources: list[torch.Tensor] = []  # device sources, alive until the forward ends
        self.pending = 0  # saved tensors not yet unpacked
        self.d2h_done: Optional[torch.cuda.Event] = None
        self.h2d_done: Optional[torch.cuda.Event] = None
        self.restored = False  # device copies issued
        self.waited = False  # compute stream ordered after them

    # ---- forward
    def _shares_param(self, ptr: int) -> bool:
        # at pack time (ZeRO-3 gathers a weight only around its module's forward)
        for t in (*self.module.parameters(), *self.module.buffers(), *self.keep):
            if t.untyped_storage().data_ptr() == ptr:
                return True
        return False

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.layout != torch.strided or t.device.type not in ("cuda", "cpu"):
            return t
        if t.device.type == "cpu" and not self.owner.copy_cpu:
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0 or storage.nbytes() < self.owner.min_bytes or self._shares_param(ptr):
            return t
        stored = self.by_ptr.get(ptr)
        if stored is None:
            stored = self._to_host(storage, t.device)
            self.owner.host_bytes += storage.nbytes()
            self.by_ptr[ptr] = stored
            self.stored.append(stored)
        self.pending += 1
        return _Packed(self, stored, t)

    def _to_host(self, storage, device: torch.device) -> _Stored:
        src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        # held until the block's forward ends: a freed storage's address could come back
        # for another tensor of this block and hit the dedup map
        self.sources.append(src)
        if device.type != "cuda":
            return _Stored(src.clone(), device)
        side = self.owner.side_stream(device)
        host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
        side.wait_stream(torch.cuda.current_stream(device))  # the producer has finished
        with torch.cuda.stream(side):
            host.copy_(src, non_blocking=True)
        src.record_stream(side)  # no reuse before the copy read it
        return _Stored(host, device)

    def forward_done(self) -> None:
        if self.stored and self.stored[0].device.type == "cuda":
            self.d2h_done = self.owner.side_stream(self.stored[0].device).record_event()
        self.by_ptr.clear()
        self.sources.clear()

    # ---- backward
    def prefetch(self) -> None:
        """Issue the host-to-device copies (on the side stream for GPU storages)."""
        if self.restored:
            return
        self.restored, self.waited = True, False
        for s in self.stored:
            if s.device.type != "cuda":
                s.dev_copy = s.host  # CPU: the copy is the restored storage
                continue
            side = self.owner.side_stream(s.device)
            with torch.cuda.stream(side):  # allocated on, and ordered by, the side stream
                s.dev_copy = torch.empty(s.host.numel(), dtype=torch.uint8, device=s.device)
                s.dev_copy.copy_(s.host, non_blocking=True)
        if self.stored and self.stored[0].device.type == "cuda":
            self.h2d_done = self.owner.side_stream(self.stored[0].device).record_event()

    def ensure(self) -> None:
        self.prefetch()
        if not self.waited:
            self.waited = True
            if self.h2d_done is not None:
                cur = torch.cuda.current_stream(self.stored[0].device)
                cur.wait_event(self.h2d_done)
                for s in self.stored:  # freed later only after the compute using it
                    assert s.dev_copy is not None  # prefetch() made it
                    s.dev_copy.record_stream(cur)

    def unpack(self, p: _Packed) -> torch.Tensor:
        self.ensure()
        if self.prev is not None and self.prev.pending > 0:
            self.prev.prefetch()  # the block the backward needs next
        buf = p.stored.dev_copy
        assert buf is not None  # ensure() prefetched it
        out = torch.empty(0, dtype=p.dtype, device=buf.device).set_(buf.untyped_storage(), p.offset, p.size, p.stride)
        self.pending -= 1
        if self.pending == 0:  # this block's backward has everything it needs
            for s in self.stored:
                s.dev_copy = None
            self.restored = False
        return out


def _unpack(p):
    return p.block.unpack(p) if isinstance(p, _Packed) else p


class ActivationOffload:
    """Offloads each block's saved activations; one instance per model.

    off.begin()                               # once per forward
    for i, layer in enumerate(layers):
        with off.block(layer, keep=(cos, sin)) if off.offloads(i, len(layers)) else nullcontext():
            h = layer(h, ...)
    off.end()
    """

    def __init__(
        self,
        min_bytes: int = MIN_BYTES,
        copy_cpu: bool = False,
        max_inflight: int = MAX_INFLIGHT,
        keep_last: int = KEEP_LAST,
        fraction: float = 1.0,
    ):
        self.min_bytes, self.copy_cpu, self.max_inflight = min_bytes, copy_cpu, max_inflight
        self.keep_last, self.fraction = keep_last, fraction
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last: Optional[_BlockState] = None
        self.host_bytes = 0  # bytes copied to host by the current (or last) forward

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def offloads(self, i: int, n: int) -> bool:
        """Block i of n goes through block(): not the last keep_last, and `fraction` of the rest, spread
        evenly (constants.offloaded; memory.offload_keep, memory.offload_fraction)."""
        return offloaded(i, n, self.keep_last, self.fraction)

    def begin(self) -> None:
        self._last = None
        self.host_bytes = 0

    def end(self) -> None:
        # The backward starts with the blocks kept on the device, then needs the last offloaded
        # one: bring it back now, behind its own device-to-host copies on the side stream, so
        # it arrives while the head and the kept blocks run their backward.
        if self._last is not None and self._last.pending > 0:
            self._last.prefetch()
        # the states now live only in the autograd graph (its packed handles): freed with it
        self._last = None

    @contextlib.contextmanager
    def block(self, module: nn.Module, keep: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        st = _BlockState(self, module, tuple(keep), self._last)
        # bound the copies in flight: wait for block i-max_inflight's device-to-host copies
        old: Optional[_BlockState] = st
        for _ in range(self.max_inflight):
            old = old.prev if old is not None else None
        if old is not None and old.d2h_done is not None:
            old.d2h_done.synchronize()
        try:
            with torch.autograd.graph.saved_tensors_hooks(st.pack, _unpack):
                yield
        finally:
            st.forward_done()
            self._last = st
