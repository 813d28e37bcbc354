"""The store: the authoritative host copy of every block.

Each block owns one flat, page-aligned fp32 buffer of master weights (kind ``"param"``) and,
beside it, flat buffers of the same layout for gradients and optimizer state (other kinds).
Everything that reads or writes a block's numbers goes through ``pinned``, so the disk tier
(:class:`megatrain_lightning.store.disk.DiskStore`) only changes where these buffers live and when
they move. In this host tier every buffer stays in RAM for the store's whole life, except the gradient
sums (``POOLED_KINDS``): a block's exist from its first gradient to the update that consumes them, and
their buffer then goes back to a pool for the next block of its size. Without accumulation or clipping
the sums of a few blocks exist at a time, not 4 bytes per parameter of the model.

A block's buffers are also cut into *chunks* (``spans``: the same element ranges for every kind), the unit
the disk tier caches, reads and writes: callers on the hot path (fetch, gradient add, update) pin one
``span`` at a time, so the memory they need is a few chunks, whatever the block size.

Under bf16 compute the host tier also keeps a *shadow* (kind ``SHADOW``): the weights that sit in the
device slots in bf16, already rounded to bf16 (``define_shadow``), so 2 bytes per parameter cross the
link instead of 4 and nothing is converted on the device. It always equals the master rounded
(:mod:`megatrain_lightning.optim.bf16`): the update refreshes what it changes in the same pass, every
other writer of the weights (``rewriting``, a failed update) leaves it stale, and a stale or freed
shadow is rebuilt from the weights when next read. The disk tier keeps none: its slots convert.

The store also keeps the rule that makes asynchronous updates safe: whoever is about to change a
block's weights says so first (``will_change``, with the future of an update running elsewhere).
That moves the block's ``version`` on, so every copy taken before (a device slot) knows it is stale,
and reads of the block wait until the change is done. Readers never need to know who changes what.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

import torch
from torch import Tensor

from megatrain_lightning.engine.chaos import point
from megatrain_lightning.engine.futures import result_of
from megatrain_lightning.store.layout import CHUNK_NUMEL, Block, chunk_spans
from megatrain_lightning.store.memory import host_empty
from megatrain_lightning.telemetry.stats import EngineStats

log = logging.getLogger(__name__)

SHADOW = "shadow"  # bf16 copies of the weights that are bf16 on the device (see the module docstring)
POOLED_KINDS = frozenset({"grad", "grad_pass"})  # buffers that live from a backward to their update
Runs = list[tuple[int, int]]  # a block's element ranges [start, stop) in order, apart


def shadow_index(runs: Runs, element: int) -> int:
    """Where block element ``element`` (or the first after it in ``runs``) sits in the shadow of ``runs``:
    the shadow holds the elements of ``runs`` one after another."""
    return sum(min(max(element, a), b) - a for a, b in runs)


class HostStore:
    """Per-block flat host buffers by kind (``param``, ``grad``, ``exp_avg``, ...), all in RAM."""

    _shadow_runs: list[Runs] | None = None  # per block, the elements the shadow holds (None: no shadow)

    def __init__(
        self,
        blocks: list[Block],
        pin_memory: bool = False,
        stats: EngineStats | None = None,
        chunk_numel: int = CHUNK_NUMEL,
    ) -> None:
        self.blocks = blocks
        self.chunk_numel = chunk_numel
        self.pin_memory = pin_memory
        self.stats = stats or EngineStats()
        self._buffers: dict[tuple[int, str], Tensor] = {}
        self._joints: dict[int, Tensor] = {}  # block -> its weights and shadow in one buffer (``joined``)
        self._joined_shadow = False
        self._pool: dict[tuple[torch.dtype, int], list[Tensor]] = {}  # free POOLED_KINDS buffers by size
        self._kinds: dict[str, tuple[torch.dtype, Callable[[Block], int], Span]] = {}
        self._lock = threading.Lock()
        self._versions = [0] * len(blocks)
        self._changes: dict[int, Future] = {}  # block -> the update changing it (kept once done)
        self._stale_shadows: set[int] = set()  # blocks whose shadow buffer no longer equals the weights
        self._shadow_writes = [0] * len(blocks)  # moves on with every other write of a block's weights
        self._shadow_lock = threading.Lock()  # one rebuild of a stale shadow at a time

    def define_kind(
        self, kind: str, dtype: torch.dtype, numel: Callable[[Block], int], span: Span | None = None
    ) -> None:
        """Buffers of ``kind`` hold ``numel(block)`` elements of ``dtype`` (default: fp32, block layout);
        ``span(block, start, stop)`` is the range of them that block elements ``[start, stop)`` own
        (default: the same range). Over a block's ``spans`` these ranges must cover the buffer in order."""
        self._kinds[kind] = (dtype, numel, span or _same_span)

    def define_shadow(self, runs: list[Runs] | None, joined: bool = False) -> None:
        """Keep a bf16 shadow of each block's element ranges ``runs[block]`` (the weights that are bf16 on the
        device), or none (``None``); ``joined``: each block's shadow right after its weights in one buffer
        (:meth:`joined`). Buffers of another definition are freed; the new ones are filled from the weights
        when first read. Not while updates run."""
        runs = [list(r) for r in runs] if runs and any(runs) else None
        joined = joined and runs is not None
        if (runs, joined) == (self._shadow_runs, self._joined_shadow):
            return
        with self._lock:
            for key in [key for key in self._buffers if key[1] == SHADOW]:
                del self._buffers[key]
            for block in list(self._joints):  # the weights move to a buffer of their own
                weights = self._buffers[(block, "param")]
                self._buffers[(block, "param")] = host_empty(weights.numel(), weights.dtype, self.pin_memory)
                self._buffers[(block, "param")].copy_(weights)
                del self._joints[block]
            self._shadow_runs, self._joined_shadow = runs, joined
            if runs is None:
                self._kinds.pop(SHADOW, None)
                return
            self._kinds[SHADOW] = (
                torch.bfloat16,
                lambda b: shadow_index(runs[b.index], b.numel),
                lambda b, start, stop: (
                    shadow_index(runs[b.index], start),
                    shadow_index(runs[b.index], stop),
                ),
            )

    @property
    def has_shadow(self) -> bool:
        return self._shadow_runs is not None

    def shadow_runs(self, block: int) -> Runs:
        """The element ranges of ``block`` the shadow holds (none without a shadow)."""
        return self._shadow_runs[block] if self._shadow_runs is not None else []

    def shadow_is_current(self, block: int) -> bool:
        """Whether ``block``'s shadow buffer exists and equals its weights rounded: an update then refreshes
        the parts it changes (else the next read rebuilds it whole)."""
        return (block, SHADOW) in self._buffers and block not in self._stale_shadows

    def layout(self, block: int, kind: str) -> tuple[torch.dtype, int]:
        return self.block_layout(block, kind)

    def block_layout(self, block: int, kind: str) -> tuple[torch.dtype, int]:
        """``kind``'s dtype and elements for the whole block (what a checkpoint holds; a sharded store's
        ``layout`` is its rank's share)."""
        dtype, numel, _ = self._kinds.get(kind, _FP32)
        return dtype, numel(self.blocks[block])

    def spans(self, block: int) -> list[tuple[int, int]]:
        """``block``'s chunks: consecutive element ranges of at most ``chunk_numel`` covering it."""
        return chunk_spans(self.blocks[block].numel, self.chunk_numel)

    def copy_spans(self, block: int) -> list[tuple[int, int]]:
        """The element ranges a device copy of ``block`` reads one at a time: here all of its ``spans`` in
        one (its buffers are in RAM, pinned whole on CUDA: on an H200, 16 MB pieces reached 0.79 of a raw
        pinned copy's rate, whole blocks 0.92); the disk tier's cached chunks one by one."""
        spans = self.spans(block)
        return [(spans[0][0], spans[-1][1])] if spans else []

    def kind_span(self, block: int, kind: str, span: tuple[int, int] | None) -> tuple[int, int]:
        """The range of ``kind``'s buffer that block elements ``span`` (``None``: all) own."""
        if span is None:
            return 0, self.layout(block, kind)[1]
        return self.block_kind_span(block, kind, span)

    def block_kind_span(self, block: int, kind: str, span: tuple[int, int]) -> tuple[int, int]:
        """The range of the whole block's ``kind`` (what a checkpoint holds) that elements ``span`` own."""
        return self._kinds.get(kind, _FP32)[2](self.blocks[block], *span)

    def will_change(self, block: int, done: Future | None = None) -> None:
        """``block``'s weights are about to change: copies taken before are stale from now on, and until
        ``done`` (the change running in another thread) resolves, reads of the block wait for it."""
        with self._lock:
            self._versions[block] += 1
            if done is None:
                self._changes.pop(block, None)
            else:
                self._changes[block] = done

    def version(self, block: int) -> int:
        """Moves on whenever ``block``'s weights are about to change; a copy taken at one version is
        current while the version stays."""
        return self._versions[block]

    def wait_for_change(self, block: int) -> None:
        """Wait until the change announced for ``block`` (if any) is done; raise if it failed (its weights
        are then neither the old nor the new ones: nothing may read them)."""
        point("store.wait")
        with self._lock:
            change = self._changes.get(block)
        if change is None:
            return
        if not change.done():
            start = time.perf_counter()
            change.exception()
            self.stats.add(optimizer_wait_s=time.perf_counter() - start)
        result_of(change)

    def accept_failed_changes(self) -> None:
        """The run whose changes failed has stopped and reported it: read those blocks as they are (their
        shadows, perhaps half refreshed, are rebuilt from them)."""
        with self._lock:
            for block, change in list(self._changes.items()):
                if change.done() and change.exception() is not None:
                    del self._changes[block]
                    self._stale_shadows.add(block)
                    self._shadow_writes[block] += 1

    @contextlib.contextmanager
    def pinned(
        self, block: int, kind: str, write: bool = False, span: tuple[int, int] | None = None
    ) -> Iterator[Tensor]:
        """The flat buffer of ``kind`` for ``block`` (zeros until first written; a gradient buffer from the
        pool holds what its last block left: gradients are read only where written), or the part of it that
        block elements ``span`` own, held for the context. A read waits for the block's announced change;
        a writer is the change, or ordered after it. Weights are written by the block's update (which
        refreshes the shadow of what it changes) or through ``rewriting``."""
        if not write:
            self.wait_for_change(block)
            if kind == SHADOW:
                self._rebuild_shadow(block)
        start, stop = self.kind_span(block, kind, span)
        yield self._buffer(block, kind)[start:stop]

    @contextlib.contextmanager
    def rewriting(
        self, block: int, kind: str = "param", span: tuple[int, int] | None = None
    ) -> Iterator[Tensor]:
        """``pinned(write=True)`` for a change made in this thread (loading weights), of the block or of
        its elements ``span``: after the block's pending change, copies taken before go stale, and the new
        contents are written back."""
        self.wait_for_change(block)
        self.will_change(block)
        if kind != "param":
            with self.pinned(block, kind, write=True, span=span) as flat:
                yield flat
            self.written(block, [kind], span)
            return
        self._invalidate_shadow(block)  # before (a failed write leaves it stale) and after (a rebuild
        try:  # that read the weights meanwhile does not count)
            with self.pinned(block, kind, write=True, span=span) as flat:
                yield flat
        finally:
            self._invalidate_shadow(block)
        self.written(block, [kind], span)

    @contextlib.contextmanager
    def pinned_all(
        self, block: int, kinds: Iterable[str], write: bool = False, span: tuple[int, int] | None = None
    ) -> Iterator[dict[str, Tensor]]:
        """``pinned`` for several kinds of ``block`` at once (what an update uses), by kind."""
        with contextlib.ExitStack() as stack:
            yield {kind: stack.enter_context(self.pinned(block, kind, write, span)) for kind in kinds}

    def read(self, block: int, kind: str) -> Tensor:
        """The current contents, for callers that keep them (state dicts): the buffer itself here."""
        self.wait_for_change(block)
        if kind == SHADOW:
            self._rebuild_shadow(block)
        return self._buffer(block, kind)

    def joined(self, block: int) -> Tensor:
        """``block``'s weights and, right after them, its shadow, as the bytes of one buffer (the CPU computes
        on both, bound in place: one storage, as a device slot is), once the block's announced change is
        done and its shadow current."""
        if not self._joined_shadow or not self.shadow_runs(block):
            return self.read(block, "param").view(torch.uint8)
        self.read(block, SHADOW)  # after the change; makes the joint buffer if new, rebuilds a stale shadow
        return self._joints[block]

    def joint_offset(self, block: int, element: int, shadowed: bool) -> int:
        """The byte in :meth:`joined`'s buffer where weight ``element`` (``shadowed``: its bf16 copy) sits."""
        if not shadowed:
            return 4 * element
        return 4 * self.blocks[block].numel + 2 * shadow_index(self.shadow_runs(block), element)

    def read_span(self, block: int, kind: str, span: tuple[int, int]) -> Tensor:
        """A copy of block elements ``span`` of ``kind`` (one parameter's values)."""
        with self.pinned(block, kind, span=span) as flat:
            return flat.clone()

    def write_span(self, block: int, kind: str, span: tuple[int, int], values: Tensor) -> None:
        """Set block elements ``span`` of ``kind`` to ``values`` (one parameter's weights changed in place
        by user code or by its block's forward), ordered after the block's pending change; copies taken
        before go stale."""
        with self.rewriting(block, kind, span) as flat:
            flat.copy_(values.reshape(-1))

    def written(self, block: int, kinds: Iterable[str], span: tuple[int, int] | None = None) -> None:
        """``kinds`` of ``block`` (of the chunk ``span``) changed: the disk tier writes them back (nothing
        to do here)."""

    def discard(self, block: int, kind: str, span: tuple[int, int] | None = None) -> None:
        """The contents of ``kind`` (of the chunk ``span``) are no longer needed (a consumed gradient). A
        gradient buffer goes back to the pool with its block's last chunk (callers discard in order)."""
        if kind not in POOLED_KINDS or (span is not None and span[1] < self.spans(block)[-1][1]):
            return
        with self._lock:
            buf = self._buffers.pop((block, kind), None)
            if buf is not None:
                self._pool.setdefault((buf.dtype, buf.numel()), []).append(buf)

    def hint(self, future: Iterable[tuple[int, tuple[str, ...]]]) -> None:
        """The predicted coming accesses, in order, each a block and the kinds it will use; a tier
        with a cache ranks what it holds by them and loads ahead."""

    def claim(self, block: int, kinds: Iterable[str]) -> None:
        """``kinds`` of ``block`` are pinned next, ahead of every predicted access (a submitted update)."""

    def describe(self) -> str:
        """Where the store is, for the line a run starts with."""
        return "in RAM"

    def nbytes(self, *kinds: str) -> int:
        """Bytes of host memory the store holds (for ``kinds``, or all): whole pages, as allocated (and
        page-locked, for pinned weights); of a joint buffer of weights and shadow, each one's bytes."""
        joints = {joint.untyped_storage().data_ptr() for joint in list(self._joints.values())}

        def size(b: Tensor) -> int:
            storage = b.untyped_storage()
            return b.nbytes if storage.data_ptr() in joints else storage.nbytes()

        held = sum(size(b) for (_, k), b in list(self._buffers.items()) if not kinds or k in kinds)
        if kinds and POOLED_KINDS.isdisjoint(kinds):
            return held
        return held + sum(b.untyped_storage().nbytes() for pool in self._pool.values() for b in pool)

    def forget_read_failures(self) -> None:
        """The run a failed read stopped is over (or a new one starts): the files are whole, so reads may
        be tried again (the disk tier refuses every pin after a failed read until then)."""

    def release_all_but(self, *kinds: str) -> None:
        """Free every buffer not of ``kinds`` (the state of a run that ended); a shadow in one buffer with
        weights that stay stays too (its memory could not be freed alone). Without the lock, by single
        dict operations: this runs from a finalizer, which may interrupt any thread, even one holding it."""
        joined = set(self._joints) if "param" in kinds else set()
        for key in [key for key in list(self._buffers) if key[1] not in kinds]:
            if not (key[1] == SHADOW and key[0] in joined):
                self._buffers.pop(key, None)
        self._pool = {}

    def flush(self) -> None:
        """Make the authoritative copy complete (the disk tier writes its dirty cache back)."""

    def close(self) -> None:
        """Release resources (files, threads); the host tier has none."""

    def _buffer(self, block: int, kind: str) -> Tensor:
        key = (block, kind)
        buf = self._buffers.get(key)
        if buf is None:
            with self._lock:
                buf = self._buffers.get(key)
                joined = self._joined_shadow and kind in ("param", SHADOW) and self.shadow_runs(block)
                if buf is None and joined:
                    self._join(block)
                    buf = self._buffers[key]
                elif buf is None:
                    dtype, numel = self.layout(block, kind)
                    pool = self._pool.get((dtype, numel)) if kind in POOLED_KINDS else None
                    # Only weights cross to the device; gradients and optimizer state stay pageable.
                    pinned = self.pin_memory and kind in ("param", SHADOW)
                    buf = pool.pop() if pool else host_empty(numel, dtype, pinned)  # new: zeros
                    self._buffers[key] = buf
        return buf

    def _join(self, block: int) -> Tensor:
        """(Lock held.) ``block``'s joint buffer, made on first use: fp32 weights (moved in if they exist)
        then the shadow, padded to whole fp32 elements; a shadow view made here is stale until rebuilt."""
        numel = self.blocks[block].numel
        split, end = self.joint_offset(block, numel, False), self.joint_offset(block, numel, True)
        joint = self._joints.get(block)
        if joint is None:
            joint = host_empty(-(-end // 4) * 4, torch.uint8, self.pin_memory)
            weights = self._buffers.get((block, "param"))
            if weights is not None:
                joint[:split].view(torch.float32).copy_(weights)
            self._buffers[(block, "param")] = joint[:split].view(torch.float32)
            self._joints[block] = joint
        if (block, SHADOW) not in self._buffers:
            self._buffers[(block, SHADOW)] = joint[split:end].view(torch.bfloat16)
            self._stale_shadows.add(block)
        return joint

    def _rebuild_shadow(self, block: int) -> None:
        """Make ``block``'s shadow its weights rounded, if stale or not there (after the block's change)."""
        if self.shadow_is_current(block) or not self.shadow_runs(block):
            return
        from megatrain_lightning.optim.bf16 import to_bf16_  # the kernel's rounding (optim builds it)

        with self._shadow_lock:
            if self.shadow_is_current(block):
                return
            with self._lock:  # a change that runs meanwhile (or begins) leaves the copy stale, as a slot's
                self._stale_shadows.add(block)  # until filled: a new buffer is zeros, a failed fill is stale
                change = self._changes.get(block)
                settled = change is None or change.done()
                before = self._shadow_writes[block], self._versions[block]
            runs, shadow, weights = (
                self.shadow_runs(block),
                self._buffer(block, SHADOW),
                self._buffer(block, "param"),
            )
            for a, b in runs:
                start = shadow_index(runs, a)
                to_bf16_(weights[a:b], shadow[start : start + b - a])
            with self._lock:
                if settled and (self._shadow_writes[block], self._versions[block]) == before:
                    self._stale_shadows.discard(block)

    def _invalidate_shadow(self, block: int) -> None:
        with self._lock:
            self._stale_shadows.add(block)
            self._shadow_writes[block] += 1


Span = Callable[[Block, int, int], tuple[int, int]]


def _same_span(block: Block, start: int, stop: int) -> tuple[int, int]:
    return start, stop


_FP32 = (torch.float32, lambda b: b.numel, _same_span)
