"""CPU AdamW over the store's flat buffers, one block at a time, in worker threads.

The user's ``torch.optim.AdamW``/``Adam`` is rebuilt as this optimizer over the very same param-group
dicts (which keep pointing at the module's parameters), so every LR scheduler, including one that
holds the dicts itself (``SequentialLR``, ``ChainedScheduler``), steers it; the numbers live in the
store. A block's update is submitted as soon as its gradients are final, which during the last
backward of an accumulation window is while the backward of the other blocks still runs; with
gradient clipping (and in manual optimization) the updates wait until the global norm is known and
then overlap the next forward. Either way a block is fetched again only after its update completed
(``wait``), so results equal plain PyTorch AdamW. A new optimizer starts from zero moments, like a
new torch optimizer, whatever an earlier one left in the store.

The update is torch's own functional Adam/AdamW, with the implementation the user chose
(``foreach``/``fused``; the default on CPU is the single-tensor one), applied to runs of adjacent
parameters of the flat buffers: the arithmetic, and so the result, is bitwise the reference's.
``fused=True`` is the fast choice.

Threads: the updates run in an :class:`~megatrain_lightning.optim.updates.UpdateQueue` (whose docstring
is the thread contract); a block's step counters and buffers are touched only by its update.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adam import adam

from megatrain_lightning.engine.grads import HostGrads
from megatrain_lightning.optim import state_dict
from megatrain_lightning.optim.bf16 import to_bf16_
from megatrain_lightning.optim.clipping import GradNorms, clamp_
from megatrain_lightning.optim.hparams import Clip, GroupHparams
from megatrain_lightning.optim.quantized import quantized_adamw_
from megatrain_lightning.optim.state_dict import FP32_MOMENTS
from megatrain_lightning.optim.updates import UpdateQueue
from megatrain_lightning.store.host import SHADOW, HostStore
from megatrain_lightning.store.layout import align_up
from megatrain_lightning.telemetry.stats import EngineStats
from megatrain_lightning.telemetry.timeline import TIMELINE

log = logging.getLogger(__name__)

_CODES = ("m_codes", "m_scales", "v_codes", "v_scales")  # block-quantized moments of large parameters
COMPRESSIONS = {"none": None, "int8": 8, "int4": 4, "int3": 3, "int2": 2}  # name -> codecs.FORMATS key


class CPUAdamW(Optimizer):
    """Adam/AdamW whose state and parameters live in a :class:`HostStore`.

    Args:
        params: param groups over the module's (meta) parameters, as for ``torch.optim.AdamW``.
        store: the store holding the master weights; ``exp_avg``/``exp_avg_sq`` are added to it.
        grads: the host gradient accumulator the engine offloads into.
        locate: ``id(param) -> (block, index)`` for every parameter in ``params``.
        decoupled_weight_decay: AdamW (``True``) or Adam with L2 weight decay (``False``).
        compression: ``"none"`` (fp32 moments: bitwise torch), ``"int8"``, ``"int4"``, ``"int3"`` or
            ``"int2"`` (:data:`megatrain_lightning.optim.codecs.FORMATS`): the moments of
            the large parameters of repeated blocks (decoder layers) are stored block-quantized
            (:mod:`megatrain_lightning.optim.codecs`) and updated by one fused pass
            (:mod:`megatrain_lightning.optim.quantized`); small parameters, embeddings and the head keep
            fp32 moments unless ``compress_all_blocks``.
        threads: worker threads running block updates (``0``: in the thread that submits them).
    """

    def __init__(
        self,
        params: Iterable[Any],
        store: HostStore,
        grads: HostGrads,
        locate: dict[int, tuple[int, int]],
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
        self.stats = stats or EngineStats()
        # One object shared with Lightning's wrapper of this optimizer (which copies ``__dict__``).
        self.updates = UpdateQueue(threads, self.stats, grads.device)
        super().__init__(params, defaults)
        self.store = store
        self.grads = grads
        self.decoupled_weight_decay = decoupled_weight_decay
        self.defer_updates = False
        self.norms = GradNorms(store, grads)
        self._in_step = False
        self._hparams: list[GroupHparams] = []
        self._clip = Clip()
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
        state_dict.define_kinds(store, self._quantized, self._bits)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as torch does; also later, e.g. ``BaseFinetuning`` unfreezing a layer) and plan
        which block buffers its parameters' updates cover."""
        self.updates.wait_all()  # no update may read the plan while it grows
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

    @property
    def state_kinds(self) -> tuple[str, ...]:
        """The store kinds holding this optimizer's moments."""
        return (*FP32_MOMENTS, *_CODES) if self._bits else FP32_MOMENTS

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
        self._hparams = [GroupHparams.of(group) for group in self.param_groups]
        self.norms.clear()
        # An asynchronous offload of an earlier micro-batch that is still running would otherwise see the
        # step begun and submit its block's update with part of the gradient.
        self.grads.flush()
        self._in_step = True
        try:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
        finally:
            self._in_step = False
        self.grads.ready()  # with what user code did to `p.grad` (clipped it in a hook)
        for block in range(len(self.store.blocks)):
            if not self.updates.submitted(block) and self.grads.present(block):
                self._submit(block)
        self.updates.new_step()
        self._clip = Clip()
        return loss

    @property
    def stepping(self) -> bool:
        """Whether the pass running now ends in an update (its closure runs inside ``step``)."""
        return self._in_step

    @property
    def updated_before_a_failure(self) -> int:
        """Blocks a step updated before its closure raised (a backward stopped by an exception, Ctrl-C):
        their weights are a step ahead of the others'. 0 between whole steps."""
        return 0 if self._in_step else self.updates.submitted_count()

    def block_ready(self, block: int) -> None:
        """The engine's signal that ``block``'s gradients are final for this backward: in a stepping pass its
        update starts now, or with deferred updates its norms are taken for clipping (if clipped by norm)."""
        if self._in_step and self.defer_updates:
            self.norms.block_final(block)
        elif self._in_step:
            self._submit(block)

    def wait(self, block: int) -> None:
        """Block until ``block``'s pending update (if any) has been applied; raise if any update failed."""
        self.updates.wait(block)

    def wait_all(self) -> None:
        self.updates.wait_all()

    def wait_for_room(self) -> None:
        self.updates.wait_for_room()

    def claim_gradients(self, block: int) -> None:
        """``block``'s gradient sums are about to be completed and its update follows at once (a pass that
        steps, without deferred updates): the store keeps them cached until the update used them."""
        if self._in_step and not self.defer_updates:
            self.store.claim(block, ("grad",))

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wait_all()
        self.grads.clear()

    def close(self) -> None:
        """Wait for the running updates and stop; a failure among them was the run's end, already
        reported, so the store reads the blocks as they are from now on."""
        self.updates.close()
        self.store.accept_failed_changes()

    # -- clipping (called by the precision plugin after the closure) --

    def _check_can_clip(self) -> None:
        if self.updates.any_submitted():
            raise RuntimeError(
                "megatrain: gradients were clipped after some blocks were already updated. Set "
                "`Trainer(gradient_clip_val=...)` (or override `configure_gradient_clipping` before fit) so "
                "that the strategy defers updates until the gradients are final."
            )

    def clip_grad_value_(self, clip_value: float) -> None:
        self._check_can_clip()
        self._clip = Clip(value=float(clip_value), coef=self._clip.coef)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Global-norm clipping with exactly torch's arithmetic (:mod:`.clipping`)."""
        self._check_can_clip()
        total = self.norms.total(self._order, self._clip.value)
        self._clip = Clip()
        if total is None:
            return torch.tensor(0.0)
        self._clip = Clip(coef=torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    # -- internals --

    def _submit(self, block: int) -> None:
        hparams, clip = self._hparams, self._clip

        def prepare(done: Future) -> None:
            self.store.will_change(block, done)  # copies of the block go stale; its readers wait
            self.store.claim(block, self.update_kinds)

        self.updates.submit(block, prepare, functools.partial(self._run, block, hparams, clip))

    def _run(self, block: int, hparams: list[GroupHparams], clip: Clip) -> None:
        start = time.perf_counter()
        self._update(block, hparams, clip)
        end = time.perf_counter()
        TIMELINE.record("optimizer", start, end)
        self.stats.add(optimizer_s=end - start)

    @property
    def update_kinds(self) -> tuple[str, ...]:
        """The store kinds a block's update reads and writes."""
        return ("param", "grad", *self.state_kinds)

    def _update(self, block: int, hparams: list[GroupHparams], clip: Clip) -> None:
        """The block's update, one store chunk at a time (so it needs a chunk of each kind in RAM, not a
        block): AdamW is elementwise and the quantized moments are block-wise with chunks cut at whole
        quantization blocks, so the result is bitwise that of one pass over the whole block."""
        present = set(self.grads.present(block))
        steps = self._steps[block]
        plan = []  # per param group with gradients: hyperparameters, runs, runs on their first step
        for group, indices in self._plan[block]:
            runs = self._runs(block, [i for i in indices if i in present])
            if runs:
                plan.append((hparams[group], runs, {a for a, _, members in runs if steps[members[0]] == 0}))
        # The shadow of the weights (bf16 compute, host tier) is refreshed in the same pass, if current.
        shadow = self.store.shadow_runs(block) and self.store.shadow_is_current(block)
        kinds = (*self.update_kinds, SHADOW) if shadow else self.update_kinds
        for span in self.store.spans(block):
            with self.store.pinned_all(block, kinds, write=True, span=span) as flats:
                self._update_pinned(block, span, flats, plan, clip)
            self.store.discard(block, "grad", span)
            self.store.written(block, ("param", *self.state_kinds), span)
        for _, runs, _ in plan:
            for _, _, members in runs:
                for i in members:
                    steps[i] += 1
        self.grads.mark_consumed(block)

    def _update_pinned(
        self,
        block: int,
        span: tuple[int, int],
        flats: dict[str, Tensor],
        plan: list[tuple[GroupHparams, list[tuple[int, int, list[int]]], set[int]]],
        clip: Clip,
    ) -> None:
        """Update the parts of ``plan``'s runs inside ``span``, whose buffers (by kind) are ``flats``."""
        lo, hi = span
        steps = self._steps[block]
        q = self._quantized[block]  # elements [0, q) have quantized moments, [q, numel) fp32 ones
        origins = {kind: self.store.kind_span(block, kind, span)[0] for kind in flats}

        def part(kind: str, a: int, b: int) -> Tensor:
            start, stop = self.store.kind_span(block, kind, (a, b))
            return flats[kind][start - origins[kind] : stop - origins[kind]]

        for h, runs, fresh in plan:
            # (start, end, members, on its first step) of each run's part in this chunk
            parts = [
                (max(a, lo), min(b, hi), members, a in fresh) for a, b, members in runs if a < hi and b > lo
            ]
            if not parts:
                continue
            grads = [part("grad", a, b) for a, b, _, _ in parts]
            if clip.value is not None:
                clamp_(grads, clip.value)
            if clip.coef is not None:
                torch._foreach_mul_(grads, clip.coef)
            for a, b, _, first in parts:
                if first:  # like a new torch optimizer's moments, whatever the store still holds
                    for kind in FP32_MOMENTS if a >= q else _CODES:
                        part(kind, a, b).zero_()  # zero codes and scales decode to zero moments
            fp32 = [(run, grad) for run, grad in zip(parts, grads, strict=True) if run[0] >= q]
            if fp32:
                adam(
                    [part("param", a, b) for (a, b, _, _), _ in fp32],
                    [grad for _, grad in fp32],
                    [part("exp_avg", a, b) for (a, b, _, _), _ in fp32],
                    [part("exp_avg_sq", a, b) for (a, b, _, _), _ in fp32],
                    [],
                    [torch.tensor(float(steps[members[0]])) for (_, _, members, _), _ in fp32],
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
                for (a, b, _, _), _ in fp32:  # the shadow, while the new weights are in cache
                    for x, y in self._shadowed(block, a, b, flats):
                        to_bf16_(part("param", x, y), part(SHADOW, x, y))
            for (a, b, members, _), grad in zip(parts, grads, strict=True):
                if a < q:
                    shadow = [part(SHADOW, x, y) for x, y in self._shadowed(block, a, b, flats)]
                    quantized_adamw_(
                        part("param", a, b),
                        grad,
                        *(part(kind, a, b) for kind in _CODES),
                        bits=self._bits,
                        step=steps[members[0]] + 1,
                        lr=float(h.lr),
                        beta1=float(h.beta1),
                        beta2=float(h.beta2),
                        eps=h.eps,
                        weight_decay=h.weight_decay,
                        decoupled_weight_decay=self.decoupled_weight_decay,
                        maximize=h.maximize,
                        seed=block,  # stochastic rounding's stream: the block's flat buffer
                        offset=a,
                        shadow=shadow[0] if shadow else None,  # a parameter is in the shadow whole, or not
                    )

    def _shadowed(self, block: int, a: int, b: int, flats: dict[str, Tensor]) -> list[tuple[int, int]]:
        """The parts of elements ``[a, b)`` that the store's shadow holds, if this update refreshes it."""
        if SHADOW not in flats:
            return []
        return [(max(a, x), min(b, y)) for x, y in self.store.shadow_runs(block) if max(a, x) < min(b, y)]

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

    # -- state: torch.optim.AdamW's format (see :mod:`.state_dict`) --

    @property
    def order(self) -> list[tuple[int, int]]:
        """``(block, index)`` of every parameter, in param-group order (torch's ``state_dict`` numbering)."""
        return self._order

    @property
    def steps(self) -> list[list[int]]:
        """Per block, each parameter's step count."""
        return self._steps

    @property
    def bits(self) -> int | None:
        """The compressed moments' format (a key of ``codecs.FORMATS``), ``None`` for fp32."""
        return self._bits

    def state_dict(self) -> dict[str, Any]:
        return state_dict.save(self)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state_dict.load(self, saved)


# LR schedulers built on the user's optimizer are rebound to this one; mark ``step`` the way their
# constructor would have, so they do not warn that it was overridden.
CPUAdamW.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
