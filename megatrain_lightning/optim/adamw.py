"""CPU AdamW over the store's flat buffers, one block at a time, in worker threads.

The user's ``torch.optim.AdamW``/``Adam`` is rebuilt as this optimizer over the very same param-group
dicts (which keep pointing at the module's parameters), so every LR scheduler, including one that
holds the dicts itself (``SequentialLR``, ``ChainedScheduler``), steers it; the numbers live in the
store. A block's update is submitted as soon as its
gradients are final, which during the last backward of an accumulation window is while the
backward of the other blocks still runs; with gradient clipping the updates wait until the
global norm is known and then overlap the next forward. Either way a block is fetched again
only after its update completed (``wait``), so results equal plain PyTorch AdamW.

The update is torch's own functional Adam/AdamW, with the implementation the user chose
(``foreach``/``fused``; the default on CPU is the single-tensor one), applied to runs of adjacent
parameters of the flat buffers: the arithmetic, and so the result, is bitwise the reference's.
``fused=True`` is the fast choice.

Threads: the compute thread runs forward/backward, submits updates (``block_ready``, ``step``) and
waits; on CUDA the gradient-offload worker submits too (``block_ready`` after a block's gradients
reached the host); the pager's prefetch worker waits (``wait``) before it loads a block; the pool's
workers run the updates. ``_pending``, ``_submitted`` and ``_failure`` are shared between them under
``_lock``; a block's step counters and store buffers are touched only by that block's update (or, by
the compute thread, once it has waited for it).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_any
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adam import adam

from megatrain_lightning.blocks import align_up
from megatrain_lightning.futures import fresh_copy
from megatrain_lightning.grads import HostGrads
from megatrain_lightning.optim import codecs
from megatrain_lightning.optim.quantized import quantized_adamw_
from megatrain_lightning.stats import EngineStats
from megatrain_lightning.store import HostStore
from megatrain_lightning.timeline import TIMELINE

log = logging.getLogger(__name__)

_SUPPORTED = (torch.optim.AdamW, torch.optim.Adam)
_STATE = ("exp_avg", "exp_avg_sq")  # fp32 moments (every block without compression; small params with it)
_CODES = ("m_codes", "m_scales", "v_codes", "v_scales")  # block-quantized moments of large parameters
COMPRESSIONS = {"none": None, "int8": 8, "int4": 4}


@dataclass(frozen=True)
class _GroupHparams:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    foreach: bool | None  # the implementation the user chose: results match it bitwise
    fused: bool | None


@dataclass(frozen=True)
class _Clip:
    value: float | None = None  # clamp each gradient to [-value, value]
    coef: Tensor | None = None  # multiply each gradient (global-norm clipping)


class CPUAdamW(Optimizer):
    """Adam/AdamW whose state and parameters live in a :class:`HostStore`.

    Args:
        params: param groups over the module's (meta) parameters, as for ``torch.optim.AdamW``.
        store: the store holding the master weights; ``exp_avg``/``exp_avg_sq`` are added to it.
        grads: the host gradient accumulator the engine offloads into.
        locate: ``id(param) -> (block, index)`` for every parameter in ``params``.
        before_update: called with a block index right before that block's weights change.
        decoupled_weight_decay: AdamW (``True``) or Adam with L2 weight decay (``False``).
        compression: ``"none"`` (fp32 moments: bitwise torch), ``"int8"`` or ``"int4"``: the moments of
            the large parameters of repeated blocks (decoder layers) are stored block-quantized
            (:mod:`megatrain_lightning.optim.codecs`) and updated by one fused pass
            (:mod:`megatrain_lightning.optim.quantized`); small parameters, embeddings and the head keep
            fp32 moments unless ``compress_all_blocks``.
        threads: worker threads running block updates.
    """

    def __init__(
        self,
        params: Iterable[Any],
        store: HostStore,
        grads: HostGrads,
        locate: dict[int, tuple[int, int]],
        before_update: Callable[[int], None] = lambda block: None,
        stats: EngineStats | None = None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = True,
        decoupled_weight_decay: bool = True,
        compression: str = "none",
        compress_all_blocks: bool = False,
        threads: int = 1,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
        )
        # Per block: (group index, parameter indices), filled by ``add_param_group`` as groups arrive.
        self._locate = locate
        self._plan: list[list[tuple[int, list[int]]]] = [[] for _ in store.blocks]
        self._order: list[tuple[int, int]] = []  # (block, index) in param-group order, as torch iterates
        super().__init__(params, defaults)
        self.store = store
        self.grads = grads
        self.decoupled_weight_decay = decoupled_weight_decay
        self.defer_updates = False
        self.stats = stats or EngineStats()
        self._before_update = before_update
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="megatrain-adamw")
        self.max_queued = 2 * threads
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}  # block -> its latest update (kept once done)
        self._submitted: set[int] = set()  # blocks submitted in the step running now
        # The first failed update: the weights are no longer one step's, so every later wait raises it
        # (whichever thread saw it first) until this optimizer is closed; ``_reported``: raised to someone.
        self._failure: BaseException | None = None
        self._reported = False
        self._in_step = False
        self._hparams: list[_GroupHparams] = []
        self._clip = _Clip()
        self._steps = [[0] * len(b.params) for b in store.blocks]
        if compression not in COMPRESSIONS:
            raise MisconfigurationException(
                f"`compression` must be one of {tuple(COMPRESSIONS)}; got {compression!r}."
            )
        self.compression = compression
        self._bits = COMPRESSIONS[compression]
        # Where each block's quantized region ends (0: all fp32); fp32 moments cover the rest.
        self._quantized = [
            b.large_numel if self._bits and (b.repeated or compress_all_blocks) else 0 for b in store.blocks
        ]
        self._define_state_kinds()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as torch does; also later, e.g. ``BaseFinetuning`` unfreezing a layer) and plan
        which block buffers its parameters' updates cover."""
        super().add_param_group(param_group)
        group = len(self.param_groups) - 1
        by_block: dict[int, list[int]] = {}
        for p in self.param_groups[group]["params"]:
            if id(p) not in self._locate:
                raise MisconfigurationException(
                    f"megatrain: the optimizer was given a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the LightningModule; megatrain updates only the module's parameters."
                )
            block, index = self._locate[id(p)]
            by_block.setdefault(block, []).append(index)
            self._order.append((block, index))
        for block, indices in by_block.items():
            self._plan[block].append((group, indices))

    @classmethod
    def from_optimizer(cls, optimizer: Optimizer, **kwargs: Any) -> CPUAdamW:
        """Rebuild a ``torch.optim.AdamW``/``Adam`` (any param groups) as a ``CPUAdamW``.

        The new optimizer shares ``optimizer``'s param-group dicts (so whatever changes their ``lr`` or
        ``betas`` changes this one's) and its class name (``LearningRateMonitor`` logs ``lr-AdamW``);
        its state starts empty, like a new torch optimizer's. Rebind schedulers with
        :func:`rebind_scheduler`.
        """
        if type(optimizer) not in _SUPPORTED:
            raise MisconfigurationException(
                "megatrain runs the optimizer on the CPU and supports `torch.optim.AdamW` and "
                f"`torch.optim.Adam`; `configure_optimizers` returned {type(optimizer).__name__}. "
                "Return one of those instead."
            )
        if any(group.get("amsgrad") for group in optimizer.param_groups):
            raise MisconfigurationException(
                "megatrain's CPU AdamW does not support `amsgrad=True`; set it to False."
            )
        decoupled = type(optimizer) is torch.optim.AdamW or bool(
            optimizer.defaults.get("decoupled_weight_decay")
        )
        return _named_like(cls, type(optimizer).__name__)(
            optimizer.param_groups, decoupled_weight_decay=decoupled, **kwargs
        )

    def _define_state_kinds(self) -> None:
        bits, q = self._bits, self._quantized
        for kind in _STATE:
            self.store.define_kind(kind, torch.float32, lambda b: b.numel - q[b.index])
        if bits:
            code = lambda b: codecs.code_bytes(q[b.index], bits)  # noqa: E731
            self.store.define_kind("m_codes", torch.uint8, code)
            self.store.define_kind("v_codes", torch.uint8, code)
            self.store.define_kind(
                "m_scales", torch.float32, lambda b: codecs.num_scales(q[b.index], "m", bits)
            )
            self.store.define_kind(
                "v_scales", torch.float32, lambda b: codecs.num_scales(q[b.index], "v", bits)
            )

    @property
    def state_kinds(self) -> tuple[str, ...]:
        """The store kinds holding this optimizer's moments."""
        return (*_STATE, *_CODES) if self._bits else _STATE

    def state_bytes(self) -> int:
        """Bytes the store's layout gives the moments (and their scales), over all blocks."""
        return sum(
            self.store.layout(b, kind)[1] * self.store.layout(b, kind)[0].itemsize
            for b in range(len(self.store.blocks))
            for kind in self.state_kinds
        )

    # -- stepping --

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (forward + backward; blocks may update during it), then update the rest."""
        self._opt_called = True  # what an LR scheduler's step-order check looks for
        self._hparams = [self._snapshot(group) for group in self.param_groups]
        self._in_step = True
        try:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
        finally:
            self._in_step = False
        self.grads.flush()
        for block in range(len(self.store.blocks)):
            if block not in self._submitted and self.grads.present(block):
                self._submit(block)
        self._submitted.clear()
        self._clip = _Clip()
        return loss

    @property
    def stepping(self) -> bool:
        """Whether the pass running now ends in an update (its closure runs inside ``step``)."""
        return self._in_step

    def block_ready(self, block: int) -> None:
        """The engine's signal that ``block``'s gradients are final for this backward."""
        if self._in_step and not self.defer_updates:
            self._submit(block)

    def wait(self, block: int) -> None:
        """Block until ``block``'s pending update (if any) has been applied; raise if any update failed."""
        with self._lock:
            future = self._pending.get(block)
        if future is not None and not future.done():
            start = time.perf_counter()
            future.exception()  # waits without raising
            self.stats.optimizer_wait_s += time.perf_counter() - start
        self._raise_failure()

    def wait_all(self) -> None:
        with self._lock:
            futures = list(self._pending.values())
        for future in futures:
            future.exception()
        self._raise_failure()

    def wait_for_room(self) -> None:
        """Back-pressure for the backward pass: return once at most ``max_queued`` updates are queued or
        running. A backward that runs far ahead of the updates only piles up gradients (which the disk
        tier must then spill); the updates, not the backward, decide when the next forward can start."""
        with self._lock:
            queued = [f for f in self._pending.values() if not f.done()]
        if len(queued) > self.max_queued:
            start = time.perf_counter()
            wait_for_any(queued, return_when=FIRST_COMPLETED)
            self.stats.optimizer_wait_s += time.perf_counter() - start
        self._raise_failure()

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wait_all()
        self.grads.clear()

    def close(self) -> None:
        """Wait for the updates still running and stop the workers. A failure already raised to the user is
        not raised again (a later ``fit`` starts clean with a new optimizer); one never raised is logged."""
        with self._lock:
            futures = list(self._pending.values())
        for future in futures:
            future.exception()
        self._pool.shutdown(wait=True)
        if self._failure is not None and not self._reported:
            log.error(f"megatrain: a block update failed and nobody waited for it: {self._failure!r}")

    def _raise_failure(self) -> None:
        with self._lock:
            failure = self._failure
            self._reported = self._reported or failure is not None
        if failure is not None:
            raise fresh_copy(failure) from failure

    def _fail(self, future: Future, err: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = err
        future.set_exception(err)

    # -- clipping (called by the precision plugin after the closure) --

    def _check_can_clip(self) -> None:
        if self._submitted:
            raise RuntimeError(
                "megatrain: gradients were clipped after some blocks were already updated. Set "
                "`Trainer(gradient_clip_val=...)` (or override `configure_gradient_clipping` before fit) so "
                "that the strategy defers updates until the gradients are final."
            )

    def clip_grad_value_(self, clip_value: float) -> None:
        self._check_can_clip()
        self._clip = _Clip(value=float(clip_value), coef=self._clip.coef)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Global-norm clipping with exactly ``torch.nn.utils.clip_grad_norm_``'s arithmetic."""
        self._check_can_clip()
        self.grads.flush()
        norms: dict[tuple[int, int], Tensor] = {}
        for block in range(len(self.store.blocks)):
            present = self.grads.present(block)
            if not present:
                continue
            with self.store.pinned(block, "grad", write=self._clip.value is not None) as flat:
                views = self.store.blocks[block].views(flat)
                grads = [views[i] for i in present]
                if self._clip.value is not None:
                    self._clamp(grads, self._clip.value)
                norms.update(zip(((block, i) for i in present), torch._foreach_norm(grads, 2.0), strict=True))
        self._clip = _Clip()
        if not norms:
            return torch.tensor(0.0)
        # Stacked in torch's order (param groups, then parameters) so the total is bitwise torch's.
        total = torch.linalg.vector_norm(
            torch.stack([norms[key] for key in self._order if key in norms]), 2.0
        )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._clip = _Clip(coef=coef)
        return total

    # -- internals --

    @staticmethod
    def _snapshot(group: dict[str, Any]) -> _GroupHparams:
        beta1, beta2 = group["betas"]
        return _GroupHparams(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            maximize=bool(group.get("maximize", False)),
            foreach=group.get("foreach"),
            fused=group.get("fused"),
        )

    @staticmethod
    def _clamp(grads: list[Tensor], value: float) -> None:
        torch._foreach_clamp_min_(grads, -value)
        torch._foreach_clamp_max_(grads, value)

    def _submit(self, block: int) -> None:
        """Queue ``block``'s update. Its future is registered first, so that a load of the block that
        starts after ``before_update`` forgot the cached copy waits for it; it resolves on every path."""
        self._raise_failure()  # after a failed update nothing more changes
        future: Future = Future()
        with self._lock:
            self._submitted.add(block)
            self._pending[block] = future
        try:
            self._before_update(block)
            self.store.claim(block, self.update_kinds)
            self._pool.submit(self._run, block, future, self._hparams, self._clip)
        except BaseException as err:
            self._fail(future, fresh_copy(err))  # err's traceback holds this thread's frames (result_of)
            raise

    def _run(self, block: int, future: Future, hparams: list[_GroupHparams], clip: _Clip) -> None:
        try:
            start = time.perf_counter()
            self._update(block, hparams, clip)
            end = time.perf_counter()
            TIMELINE.record("optimizer", start, end)
            self.stats.optimizer_s += end - start
            future.set_result(None)
        except BaseException as err:  # re-raised in whoever waits next
            self._fail(future, err)

    @property
    def update_kinds(self) -> tuple[str, ...]:
        """The store kinds a block's update reads and writes."""
        return ("param", "grad", *self.state_kinds)

    def _update(self, block: int, hparams: list[_GroupHparams], clip: _Clip) -> None:
        with self.store.pinned_all(block, self.update_kinds, write=True) as flats:
            self._update_pinned(block, flats, hparams, clip)
        self.store.discard(block, "grad")
        self.store.written(block, ("param", *self.state_kinds))

    def _update_pinned(
        self, block: int, flats: dict[str, Tensor], hparams: list[_GroupHparams], clip: _Clip
    ) -> None:
        present = set(self.grads.present(block))
        steps = self._steps[block]
        q = self._quantized[block]  # elements [0, q) have quantized moments, [q, numel) fp32 ones
        for group, indices in self._plan[block]:
            runs = self._runs(block, [i for i in indices if i in present])
            if not runs:
                continue
            grads = [flats["grad"][a:b] for a, b, _ in runs]
            if clip.value is not None:
                self._clamp(grads, clip.value)
            if clip.coef is not None:
                torch._foreach_mul_(grads, clip.coef)
            h = hparams[group]
            self._start_fresh(block, flats, [run for run in runs if steps[run[2][0]] == 0])
            fp32 = [(run, grad) for run, grad in zip(runs, grads, strict=True) if run[0] >= q]
            if fp32:
                adam(
                    [flats["param"][a:b] for (a, b, _), _ in fp32],
                    [grad for _, grad in fp32],
                    [flats["exp_avg"][a - q : b - q] for (a, b, _), _ in fp32],
                    [flats["exp_avg_sq"][a - q : b - q] for (a, b, _), _ in fp32],
                    [],
                    [torch.tensor(float(steps[members[0]])) for (_, _, members), _ in fp32],
                    foreach=h.foreach,
                    fused=h.fused,
                    decoupled_weight_decay=self.decoupled_weight_decay,
                    amsgrad=False,
                    beta1=h.beta1,
                    beta2=h.beta2,
                    lr=h.lr,
                    weight_decay=h.weight_decay,
                    eps=h.eps,
                    maximize=h.maximize,
                )
            for (a, b, members), grad in zip(runs, grads, strict=True):
                if a < q:
                    codes, m_scales, v_scales = codecs.state_slices(a, b, self._bits)
                    quantized_adamw_(
                        flats["param"][a:b],
                        grad,
                        flats["m_codes"][codes],
                        flats["m_scales"][m_scales],
                        flats["v_codes"][codes],
                        flats["v_scales"][v_scales],
                        bits=self._bits,
                        step=steps[members[0]] + 1,
                        lr=h.lr,
                        beta1=h.beta1,
                        beta2=h.beta2,
                        eps=h.eps,
                        weight_decay=h.weight_decay,
                        decoupled_weight_decay=self.decoupled_weight_decay,
                        maximize=h.maximize,
                    )
            for _, _, members in runs:
                for i in members:
                    steps[i] += 1

    def _start_fresh(
        self, block: int, flats: dict[str, Tensor], runs: list[tuple[int, int, list[int]]]
    ) -> None:
        """Zero the moments of parameters on their first step: like a new torch optimizer's, whatever the
        store still holds from an earlier optimizer (a second ``fit``) or a partial ``load_state_dict``."""
        q = self._quantized[block]
        for a, b, _ in runs:
            if a >= q:
                for kind in _STATE:
                    flats[kind][a - q : b - q].zero_()
            else:  # zero codes and scales decode to zero moments; a run's codes and scales are its own
                codes, m_scales, v_scales = codecs.state_slices(a, b, self._bits)
                for kind, where in zip(_CODES, (codes, m_scales, codes, v_scales), strict=True):
                    flats[kind][where].zero_()

    def _runs(self, block: int, indices: list[int]) -> list[tuple[int, int, list[int]]]:
        """Neighbouring parameters with equal step counts and fp32 moments, merged: ``(start, end,
        members)`` in the flat buffer. Adam's arithmetic is elementwise, so one run computes bitwise what
        its parameters would one by one (the zero padding between them stays zero). Parameters with
        quantized moments stay alone, so that their last scale block never includes padding.
        """
        specs = self.store.blocks[block].params
        steps = self._steps[block]
        q = self._quantized[block]
        runs: list[tuple[int, int, list[int]]] = []
        for i in sorted(indices, key=lambda i: specs[i].offset):
            p = specs[i]
            if (
                runs
                and align_up(runs[-1][1]) == p.offset
                and steps[runs[-1][2][0]] == steps[i]
                and runs[-1][0] >= q
                and p.offset >= q
            ):
                runs[-1] = (runs[-1][0], p.offset + p.numel, [*runs[-1][2], i])
            else:
                runs.append((p.offset, p.offset + p.numel, [i]))
        return runs

    # -- checkpoints: one block's state at a time --

    def block_state(self, block: int) -> dict[str, Tensor]:
        """``block``'s optimizer state as flat tensors: each state buffer and per-parameter step counts."""
        self.wait(block)
        state = {kind: self.store.read(block, kind) for kind in self.state_kinds}
        state["step"] = torch.tensor(self._steps[block], dtype=torch.int64)
        return state

    def load_block_state(self, block: int, tensors: dict[str, Tensor]) -> None:
        self.wait(block)
        for kind in self.state_kinds:
            with self.store.pinned(block, kind, write=True) as flat:
                if tensors[kind].shape != flat.shape or tensors[kind].dtype != flat.dtype:
                    raise ValueError(
                        f"megatrain: saved optimizer state {kind!r} of block {block} has another layout"
                    )
                flat.copy_(tensors[kind])
        self._steps[block] = tensors["step"].tolist()
        self.store.written(block, self.state_kinds)

    def load_param_groups(self, groups: list[dict[str, Any]]) -> None:
        """Hyperparameters (lr, betas, ...) of saved param groups; the parameters stay this optimizer's."""
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("megatrain: the optimizer state does not match this model's param groups")
        for group, saved in zip(self.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})

    # -- state dict: torch.optim.AdamW's format; with compression, the compressed blocks as stored --

    def state_dict(self) -> dict[str, Any]:
        self.wait_all()
        if self._bits:
            blocks = {b: self.block_state(b) for b in range(len(self.store.blocks))}
            return {"state": {}, "param_groups": self.param_groups_state(), "blocks": blocks}
        state: dict[int, dict[str, Tensor]] = {}
        views: dict[int, list[list[Tensor]]] = {}
        for i, (block, index) in enumerate(self._order):
            step = self._steps[block][index]
            if step == 0:
                continue
            if block not in views:
                views[block] = [
                    self.store.blocks[block].views(self.store.read(block, kind)) for kind in _STATE
                ]
            m, v = (kind_views[index] for kind_views in views[block])
            state[i] = {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": v}
        return {"state": state, "param_groups": self.param_groups_state()}

    def param_groups_state(self) -> list[dict[str, Any]]:
        """The param groups as ``torch.optim`` saves them: hyperparameters, parameters by number."""
        groups, start = [], 0
        for group in self.param_groups:
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(entry)
        return groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_all()
        self.load_param_groups(state_dict["param_groups"])
        if self._bits or "blocks" in state_dict:
            if self._bits is None or "blocks" not in state_dict:
                raise ValueError("megatrain: optimizer state saved with another `optimizer_compression`")
            for block, tensors in state_dict["blocks"].items():
                self.load_block_state(int(block), tensors)
            return
        for i, (block, index) in enumerate(self._order):
            saved = state_dict["state"].get(i, state_dict["state"].get(str(i)))
            if saved is None:
                self._steps[block][index] = 0
                continue
            self._steps[block][index] = int(saved["step"])
            for kind in _STATE:
                with self.store.pinned(block, kind, write=True) as flat:
                    self.store.blocks[block].views(flat)[index].copy_(saved[kind])


@functools.cache
def _named_like(cls: type[CPUAdamW], name: str) -> type[CPUAdamW]:
    """``cls`` under the name of the user's optimizer class, which Lightning shows to users (the
    ``LearningRateMonitor`` keys ``lr-AdamW/pg1``, the optimizer's ``repr``)."""
    return type(name, (cls,), {"__module__": cls.__module__, "__qualname__": name})


def rebind_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Point ``scheduler`` and the schedulers it drives (``SequentialLR``, ``ChainedScheduler``) at
    ``optimizer``, the one Lightning steps (their step-order checks read it)."""
    scheduler.optimizer = optimizer
    for inner in getattr(scheduler, "_schedulers", ()):
        rebind_scheduler(inner, optimizer)


# LR schedulers built on the user's optimizer are rebound to this one; mark ``step`` the way their
# constructor would have, so they do not warn that it was overridden.
CPUAdamW.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
