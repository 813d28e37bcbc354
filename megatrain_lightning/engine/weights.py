"""The module's side of the engine: where its weights are, reachable without the engine.

A paged module holds placeholders and hooks, and those hold a :class:`StoredWeights`: the store, the
blocks, where each parameter sits, and a *weak* reference to the engine that trains the module now.
So the engine (slots, threads, gradients, optimizer state) belongs to whoever runs it, the trainer's
strategy, and is freed with it, while the module keeps its weights: ``state_dict``, a forward (the
placeholders then read their values from the store) and a later ``fit``, which builds a new engine on
the same store.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from megatrain_lightning.engine import hooks
from megatrain_lightning.engine.blocks import CallSite, bind
from megatrain_lightning.store.disk import DiskStore
from megatrain_lightning.store.host import HostStore
from megatrain_lightning.store.layout import Block
from megatrain_lightning.telemetry.progress import byte_progress

if TYPE_CHECKING:
    from megatrain_lightning.engine.runtime import Engine, EngineConfig


GRADIENT_HOOK = (
    "megatrain: `{name}` has a gradient hook of yours (`register_hook` or "
    "`register_post_accumulate_grad_hook`). megatrain takes each layer's gradients inside its paged call "
    "and sums them in its store, so the hook would never run (one that scales or masks the gradient would "
    "silently not). Change gradients in `on_before_optimizer_step` (`p.grad`), or freeze a weight with "
    "`requires_grad_(False)`."
)


def has_gradient_hooks(tensor: Tensor) -> bool:
    return bool(tensor._backward_hooks) or bool(getattr(tensor, "_post_accumulate_grad_hooks", None))


class StoredWeights:
    """A module's weights in a store, with the engine running the module now (if any)."""

    def __init__(self, store: HostStore, blocks: list[Block], built_for: EngineConfig) -> None:
        self.store = store
        self.blocks = blocks
        self.built_for = built_for  # the device and tier the store and placeholders were made for
        # Qualified parameter name (every alias of a tied weight) -> (block, index in block).
        self.locations: dict[str, tuple[int, int]] = {}
        self.placeholders: list[list[nn.Parameter]] = []
        self._engine: Callable[[], Engine | None] = lambda: None
        self._loaded_keys: set[str] = set()  # store-loaded state_dict keys (see load_hook)
        self.user_writes = [0] * len(blocks)  # in-place changes by user code, by block (see PagedCall)
        self._outside_hooks: dict[tuple[int, int], Any] = {}  # placeholders whose gradients engines take
        self._undo: list[Callable[[], None]] = []
        self.between_steps = 0  # blocks a step stopped in its backward had updated (Engine.end_stopped_run)

    @property
    def engine(self) -> Engine | None:
        return self._engine()

    def attach(self, engine: Engine) -> None:
        """From now on ``engine`` trains the module: the gradients are its (what a training loop of the
        user's left in the placeholders, without an engine, is cleared, as a fresh optimizer's would be)."""
        self._engine = weakref.ref(engine)
        for placeholders in self.placeholders:
            for placeholder in placeholders:
                torch._C.TensorBase.grad.__set__(placeholder, None)

    def train_on(self) -> None:
        """A training pass begins: weights that a step stopped in its backward left between two steps (no
        checkpoint loaded since) are said to be trained on, and from now on are this run's; a gradient hook
        put on a layer's weight since the setup is refused (``user_code`` refuses one put on before)."""
        if self.between_steps:
            rank_zero_warn(
                "megatrain: this model's last fit stopped during a step's backward after "
                f"{self.between_steps} of {len(self.blocks)} blocks were updated, so its weights are between "
                "two steps (plain Lightning's would be those before that step); this run trains on from "
                "them. To train as the uninterrupted run would, resume from the last checkpoint "
                "(`fit(ckpt_path=...)`)."
            )
            self.between_steps = 0
        for block, placeholders in enumerate(self.placeholders):
            for index, placeholder in enumerate(placeholders):
                if (block, index) not in self._outside_hooks and has_gradient_hooks(placeholder):
                    raise MisconfigurationException(GRADIENT_HOOK.format(name=placeholder._name))

    def install_hooks(self) -> None:
        self._undo = hooks.install(self)

    def uninstall_hooks(self) -> None:
        """Give the call sites back their own forwards and state-dict behaviour (parameters stay
        placeholders: the store keeps the weights)."""
        while self._undo:
            self._undo.pop()()

    def give_back(self, materialize: bool) -> None:
        """Leave the module plain: its own forwards and hooks, and real parameters in place of the
        placeholders, holding the stored weights (``materialize``) or on meta."""
        self.uninstall_hooks()
        for handle in self._outside_hooks.values():
            handle.remove()
        self._outside_hooks.clear()
        read = materialize and isinstance(self.store, DiskStore)  # the whole model into RAM: many GB
        with byte_progress(4 * sum(b.numel for b in self.blocks) if read else 0, "reading weights") as bar:
            for block, placeholders in zip(self.blocks, self.placeholders, strict=True):
                if materialize:
                    values = block.views(self.store.read(block.index, "param"))
                    bar.update(4 * block.numel)
                else:
                    values = [torch.empty(p.shape, device="meta") for p in block.params]
                flags = [p.requires_grad for p in placeholders]
                bind(block, [nn.Parameter(v, requires_grad=f) for v, f in zip(values, flags, strict=True)])
        self.placeholders.clear()

    def release(self) -> None:
        """Take the module out of megatrain for good: real parameters holding the stored weights (in RAM,
        the disk tier's too), its own forwards and hooks back, the store closed. What a cast or move of the
        module after training needs (:class:`.hooks.PagedApply`), as a plain model is cast."""
        engine = self.engine
        if engine is not None and engine.in_use:
            raise RuntimeError(
                "megatrain: the module cannot be cast or moved (`.to(...)`, `.half()`, `.cuda()`) while "
                "megatrain runs it: its weights are fp32 masters in megatrain's store. Set the Trainer's "
                "`precision` for the compute dtype, or cast the model after `fit`."
            )
        if engine is not None:
            engine.close(materialize=True)
        else:
            self.give_back(materialize=True)
            self.store.close()

    def release_training_state(self) -> None:
        """The engine that trained the module is gone: so are its gradients and optimizer state (a later
        ``fit`` starts its moments afresh, as Lightning does), unless another engine took over already."""
        if self.engine is None:
            self.store.release_all_but("param")

    def wait_all(self) -> None:
        engine = self.engine
        if engine is not None:
            engine.wait_all()

    # -- what placeholders ask (see megatrain_lightning.engine.placeholders) --

    def read_param(self, block: int, index: int) -> Tensor:
        """A copy of one parameter's current master weights (the store waits for a pending update)."""
        spec = self.blocks[block].params[index]
        return self.store.read_span(block, "param", (spec.offset, spec.offset + spec.numel)).view(spec.shape)

    def write_param(self, block: int, index: int, value: Tensor) -> None:
        """One parameter's master weights set to ``value`` (an in-place change by user code; the store's
        copy converts it to fp32 on the host)."""
        spec = self.blocks[block].params[index]
        self.store.write_span(block, "param", (spec.offset, spec.offset + spec.numel), value.detach())
        self.user_writes[block] += 1

    def note_outside_use(self, placeholder: nn.Parameter, func: Any) -> None:
        """``placeholder`` used outside its block with autograd on: an engine takes the gradient autograd
        sums in it (:mod:`.outside_uses`); without one it stays there, as in a plain parameter."""
        block, index = placeholder._block, placeholder._index
        engine = self.engine
        # A detached copy made a leaf by user code (`p.detach().requires_grad_()`) keeps its gradient itself.
        if engine is None or placeholder is not self.placeholders[block][index]:
            return
        engine.note_outside_use(placeholder, func)
        if (block, index) not in self._outside_hooks:
            hook = _OutsideGradHook(weakref.ref(self))
            self._outside_hooks[block, index] = placeholder.register_post_accumulate_grad_hook(hook)

    def user_grad(self, block: int, index: int, device: torch.device, dtype: torch.dtype) -> Tensor | None:
        """``p.grad`` while an engine trains the module: the gradient it summed (placeholders hold their
        own without one)."""
        return self._training_engine().grads.user_grad(block, index, device, dtype)

    def assign_grad(self, block: int, index: int, value: Tensor | None) -> None:
        """``p.grad = value`` while an engine trains the module: into its sums."""
        self._training_engine().grads.assign(block, index, value)

    def _training_engine(self) -> Engine:
        engine = self.engine
        if engine is None:
            raise RuntimeError("megatrain: no engine trains this module now; its placeholders hold `p.grad`.")
        return engine

    # -- the module's forward and state-dict hooks (see megatrain_lightning.engine.hooks) --

    def forward(self, site: CallSite, forward: Callable, *args: Any, **kwargs: Any) -> Any:
        """A call site's call: paged by the engine, or plainly, the placeholders reading their values from
        the store, without one or where the engine's slots do not hold what the call computes with."""
        engine = self.engine
        if engine is None or not engine.pages_calls_now():
            return forward(*args, **kwargs)
        return engine.paged_forward(site, forward, *args, **kwargs)

    def state_dict_hook(self, site: CallSite, module: nn.Module, state: dict, prefix: str, meta: Any) -> None:
        self.wait_all()
        views = site.block.views(self.store.read(site.block.index, "param"))
        for binding in site.bindings:
            key = prefix + binding.name
            if key in state:
                state[key] = views[binding.index]

    def load_hook(self, site: CallSite, module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        """Copy incoming weights into the store and take their keys out of the module's hands (its
        parameters are placeholders); a wrong shape is left for the module to report as usual."""
        self.wait_all()
        with self.store.rewriting(site.block.index) as flat:
            views = site.block.views(flat)
            for binding in site.bindings:
                key = prefix + binding.name
                value = state.get(key)
                if value is not None and value.shape == views[binding.index].shape:
                    views[binding.index].copy_(value)
                    del state[key]
                    self._loaded_keys.add(key)

    def forget_loaded_keys(self, module: nn.Module, incompatible: Any) -> None:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in self._loaded_keys]
        self._loaded_keys.clear()


class _OutsideGradHook:
    """A placeholder's post-accumulate-grad hook: hands the gradient to the engine of the weights, held
    weakly (torch's garbage collector does not see these hooks: a strong reference would keep the store,
    the whole model, alive for good)."""

    def __init__(self, weights: weakref.ref[StoredWeights]) -> None:
        self.weights = weights

    def __call__(self, placeholder: nn.Parameter) -> None:
        weights = self.weights()
        engine = weights.engine if weights is not None else None
        if engine is not None:
            engine.outside_grad_arrived(placeholder)
