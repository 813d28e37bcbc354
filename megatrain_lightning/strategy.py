"""``MegaTrainStrategy``: the Lightning glue around the engine (``Trainer(strategy="megatrain")``)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Generator, Iterable, Mapping
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from megatrain_lightning import budgets, user_code
from megatrain_lightning.engine.distributed import ShardedGrads
from megatrain_lightning.engine.placeholders import converting_modules
from megatrain_lightning.engine.runtime import Engine, EngineConfig
from megatrain_lightning.engine.threads import update_workers
from megatrain_lightning.interrupts import FinishesStepsOnCtrlC
from megatrain_lightning.optim import state_dict as adam_state
from megatrain_lightning.optim.adamw import CPUAdamW
from megatrain_lightning.optim.rebuild import cpu_adamw_from, rebind_scheduler
from megatrain_lightning.optim.sharded import ShardedCPUAdamW
from megatrain_lightning.precision import MegaTrainPrecision
from megatrain_lightning.ranks import RankedStrategy, StartMethod
from megatrain_lightning.serialization import checkpoint as checkpointing
from megatrain_lightning.serialization import ranked as ranked_checkpoint
from megatrain_lightning.serialization.hooked_state_dict import HandedStateDict, meta_state_dict
from megatrain_lightning.serialization.initialization import InitRecorder
from megatrain_lightning.serialization.meta import init_on_meta
from megatrain_lightning.serialization.publish import recover
from megatrain_lightning.store import sizing
from megatrain_lightning.store.disk import DiskStore
from megatrain_lightning.store.layout import Block
from megatrain_lightning.store.preflight import (
    check_host_ram,
    check_offload_dir,
    check_state_dict_fits,
    remove_empty_dirs,
)
from megatrain_lightning.telemetry.stats import EngineStats


def _nothing() -> None:
    """A callable that pickles (the spawn launcher pickles the strategy), unlike a lambda."""


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)


class MegaTrainStrategy(FinishesStepsOnCtrlC, RankedStrategy):
    """Train a model larger than device memory: weights and optimizer state live in host memory, blocks
    stream through fixed pools of device slots (one per block size), gradients stream back, a CPU AdamW
    updates the weights.

    With ``Trainer(devices=N, num_nodes=M)`` and ``N * M > 1`` it trains data parallel on
    ``torch.distributed`` (Lightning's launchers and cluster environments, as DDP): each rank holds
    1/world of every block's weights, gradients and Adam state, and gathers a block for its forward and
    backward (:mod:`megatrain_lightning.engine.distributed`). With one process nothing of that runs.

    Args:
        max_vram_gb: device memory for parameter slots, in GB, shared out per block size (a slot per block
            when it holds the model; ``engine/slots.py``). ``None``: all of the device's free memory
            minus a fifth for activations on CUDA, the whole model on CPU.
        max_cpu_gb: host memory for the disk tier's cache of the store, in GB (``None``: the store's size,
            at most half the available RAM). Never more than the available RAM.
        offload_dir: folder for the disk tier: master weights and optimizer state live in files under
            it, in RAM only through the cache. ``"auto"``: ``<default_root_dir>/megatrain_offload``.
            ``None``: everything stays in host RAM.
        keep_offload_dir: keep the store's files when the model is freed (they are removed otherwise).
        optimizer_compression: Adam moments in the store: ``"none"`` (fp32, exact), ``"int8"``,
            ``"int4"``, ``"int3"`` or ``"int2"`` (block-quantized, ``optim/codecs.py``; ``True`` means
            ``"int4"``). Weights, gradients and the update arithmetic stay fp32.
        block_classes: classes (or class names) of the repeated layers; default: the Hugging Face
            model's ``_no_split_modules``.
        activation_checkpointing: keep only block-boundary activations and recompute each block in backward.
        prefetch_depth: how many blocks to fetch ahead of compute (``"auto"``: as many as free slots allow;
            data parallel: one gathered ahead).
        optimizer_threads: worker threads for block updates; ``None``: one, or none on the CPU without
            ``offload_dir`` (each update then runs in the compute thread, see ``engine/threads.py``).
        io_threads: disk tier: blocks read or written at once.
        io_chunk_mb: the store's chunk, in MB of fp32: blocks are cached, read, written and updated in
            pieces of this size, so the host RAM the disk tier needs is a few chunks, whatever the block size
            (``None``: 16; the host tier, all in RAM, then works on whole blocks where it keeps no shadow).
        zero_copy: on the CPU with the host tier, blocks compute on the store's weights themselves (in
            bf16 on its bf16 shadow; no slots, nothing copied); ``False`` copies them into slots as on a GPU.
        start_method: how Lightning starts the ranks of one node with ``devices > 1``, as for DDP:
            ``"popen"`` (runs the script again per rank; also right under torchrun or SLURM), ``"spawn"``,
            ``"fork"`` or ``"forkserver"`` (``ddp_spawn``'s multiprocessing launcher).
        process_group_backend: ``torch.distributed`` backend (default: gloo on the CPU; on CUDA
            ``"cpu:gloo,cuda:nccl"``: NCCL gathers the blocks on the GPUs, gloo exchanges host tensors).
        timeout: how long a collective waits for the other ranks before it fails.
    """

    strategy_name = "megatrain"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        max_vram_gb: float | None = None,
        max_cpu_gb: float | None = None,
        offload_dir: str | os.PathLike | None = None,
        keep_offload_dir: bool = False,
        optimizer_compression: str | bool = "none",
        block_classes: Iterable[str | type[nn.Module]] | None = None,
        activation_checkpointing: bool = True,
        prefetch_depth: int | str = "auto",
        optimizer_threads: int | None = None,
        io_threads: int = 4,
        io_chunk_mb: float | None = None,
        zero_copy: bool = True,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        **kwargs: Any,
    ) -> None:
        budgets.check_option_names(type(self), kwargs)
        super().__init__(
            accelerator=accelerator,
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            **kwargs,
        )
        self.max_vram_gb = budgets.gb_option("max_vram_gb", max_vram_gb)
        self.max_cpu_gb = budgets.gb_option("max_cpu_gb", max_cpu_gb)
        if offload_dir is not None and not isinstance(offload_dir, (str, os.PathLike)):
            raise MisconfigurationException(
                f"`offload_dir` must be a path, 'auto' or None; got {offload_dir!r}."
            )
        self.offload_dir = None if offload_dir is None else os.fspath(offload_dir)
        self.keep_offload_dir = bool(keep_offload_dir)
        self.optimizer_compression = budgets.compression_option(optimizer_compression)
        self.block_classes = list(block_classes) if block_classes else None
        self.activation_checkpointing = bool(activation_checkpointing)
        self.prefetch_depth = budgets.int_option("prefetch_depth", prefetch_depth, least=0, auto=True)
        if optimizer_threads is not None:
            budgets.int_option("optimizer_threads", optimizer_threads, least=1)
        self.optimizer_threads = optimizer_threads
        self.zero_copy = bool(zero_copy)
        self.io = budgets.io_option(io_threads, io_chunk_mb)
        if self.offload_dir is not None and self.offload_dir != "auto":
            check_offload_dir(self.offload_dir)  # created when the store is, removed with it
        self._created_dirs: list[str] = []
        self._hf_checkpointing: Callable[[], None] = _nothing  # puts the user's checkpointing back
        if self.max_cpu_gb is not None:
            check_host_ram(self.max_cpu_gb)
        self.engine: Engine | None = None
        self._checkpoint_size_logged = False
        self._handed: HandedStateDict | None = None  # the state dict the checkpoint hooks were handed

    # -- ranks (see megatrain_lightning.ranks) --

    @override
    def release_disk_store(self) -> None:
        """Close the disk tier's store now and remove its files and the folders made for them (unless kept):
        for a rank process that ends without running finalizers. No collectives: its peers may be gone."""
        if self.engine is not None and isinstance(self.engine.store, DiskStore):
            self.engine.store.close()

    # -- precision: a string precision from the Trainer arrives as a generic plugin; make it ours --

    @property
    @override
    def precision_plugin(self) -> MegaTrainPrecision:
        return self._precision_plugin if self._precision_plugin is not None else MegaTrainPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, MegaTrainPrecision):
            plugin = MegaTrainPrecision(plugin.precision, device=getattr(plugin, "device", None))
        self._precision_plugin = plugin

    @property
    def stats(self) -> EngineStats:
        """Engine counters (``peak_slot_bytes``, ``fetch_wait_s``, ``host_bytes``, ...)."""
        return self.engine.stats if self.engine is not None else EngineStats()

    # -- building --

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Parameters created here go to the meta device; buffers stay real (on the CPU). What a plain
        build would draw for them is recorded, so the store starts from the same weights as under the
        default strategy with the same seed (:mod:`megatrain_lightning.serialization.initialization`)."""
        with init_on_meta(), self.precision_plugin.tensor_init_context(), InitRecorder() as recorder:
            yield
        if self.lightning_module is not None:
            recorder.install(self.lightning_module)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        user_code.check_before_training(trainer)
        self._hf_checkpointing = user_code.take_over_hf_checkpointing(trainer, self.activation_checkpointing)
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        try:
            self.engine = Engine.attach(module, self.block_classes, self._engine_config)
        finally:
            self._remove_created_dirs_with_store()
        self.precision_plugin.device = self.root_device.type
        with converting_modules():
            self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            where = self.engine.store.describe()
            if self.precision_plugin.precision == "bf16-true":  # the default strategy steps bf16 weights
                where += "; the blocks compute in bf16 from them (bf16-true) and AdamW steps the fp32 weights"
            rank_zero_info(f"megatrain: the model's fp32 weights and optimizer state are {where}")
            self.setup_optimizers(trainer)
        if (fitting and self.optimizer_compression != "none") or self.engine.store.has_shadow:
            from megatrain_lightning.optim import kernel

            # Here, not in the first update or the first fetch (which rounds the shadow): no step waits
            # for a compiler, and what it waits for is said.
            kernel.prepare()
        self.setup_precision_plugin()

    def _engine_config(self, blocks: list[Block]) -> EngineConfig:
        config, self._created_dirs = budgets.engine_config(self, blocks)
        if self.data_parallel:
            config, self._created_dirs = self.rank_engine_config(config, self._created_dirs)
        return config

    def _remove_created_dirs_with_store(self) -> None:
        """The folders ``offload_dir`` needed go when the store's files do (at once if there is no store)."""
        dirs, self._created_dirs = self._created_dirs, []
        store = self.engine.store if self.engine is not None else None
        if isinstance(store, DiskStore):
            store.made_dirs.extend(dirs)
        else:
            remove_empty_dirs(dirs)

    @override
    def model_to_device(self) -> None:
        """Only buffers move: parameters live in the store and visit the device through slots."""
        assert self.model is not None
        _move_buffers(self.model, self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        engine = self.engine
        assert engine is not None
        if len(self.optimizers) != 1:
            raise MisconfigurationException(
                f"megatrain supports one optimizer; `configure_optimizers` returned {len(self.optimizers)}. "
                "Return one AdamW with a param group for each (its own lr, betas, weight decay); in manual "
                "optimization step it once where you stepped them."
            )
        module = self.lightning_module
        locate = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            locate[id(param)] = engine.locations[name]
        optimizer = cpu_adamw_from(
            self.optimizers[0],
            cls=ShardedCPUAdamW if engine.config.shard is not None else CPUAdamW,
            store=engine.store,
            grads=engine.grads,
            locate=locate,
            stats=engine.stats,
            compression=self.optimizer_compression,
            threads=update_workers(
                engine.config.device, engine.config.offload_dir is None, self.optimizer_threads
            ),
        )
        optimizer.defer_updates = bool(trainer.gradient_clip_val) or user_code.reads_final_gradients(trainer)
        # Clipped by norm on one rank: the norms are taken during the backward (data parallel adds shards').
        optimizer.norms.early = (
            bool(trainer.gradient_clip_val)
            and (trainer.gradient_clip_algorithm or "norm") == "norm"
            and engine.config.shard is None
        )
        if isinstance(engine.grads, ShardedGrads):  # manual optimization: every backward reduces, as DDP's
            engine.grads.reduce_at_once = not module.automatic_optimization
        if engine.optimizer is not None:
            engine.optimizer.close()
        engine.optimizer = optimizer
        for config in self.lr_scheduler_configs:
            rebind_scheduler(config.scheduler, optimizer)
        self.optimizers = [optimizer]

    # -- steps: each begins a pass of the trace --

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.engine.begin_pass("train")
        return super().training_step(*args, **kwargs)

    @override
    def post_training_step(self) -> None:
        self.engine.update_host_bytes()
        if self.engine.optimizer is not None:
            self.engine.stats.optimizer_state_bytes = self.engine.optimizer.state_bytes()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._begin_eval("validate")
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._begin_eval("test")
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._begin_eval("predict")
        return super().predict_step(*args, **kwargs)

    def _begin_eval(self, kind: str) -> None:
        self.engine.wait_all()
        self.engine.begin_pass(kind)

    # -- checkpoints: directories streamed from and into the store --

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the store must exist to load into

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full fp32 weights, like a plain ``state_dict``: views of the store in the host tier, a copy
        read from disk in the disk tier (an error where that copy would not fit in RAM). Lightning's own
        checkpointing gets the views, or nothing in the disk tier (``save_checkpoint`` streams the weights
        block by block); what it gets is kept, to refuse a hook's change of it."""
        if self.engine is not None and checkpointing.called_by_checkpoint_connector():
            state_dict = super().lightning_module_state_dict() if self.offload_dir is None else {}
            self._handed = HandedStateDict.of(state_dict)
            return state_dict
        if self.offload_dir is not None and self.engine is not None:
            check_state_dict_fits(sizing.region_bytes(self.engine.blocks))
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Only the param groups: ``save_checkpoint`` streams the per-block state itself."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return {"state": {}, "param_groups": adam_state.param_groups_state(optimizer)}

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """A checkpoint directory at ``filepath`` (:mod:`megatrain_lightning.serialization.checkpoint`). Data
        parallel: every rank writes its share of the blocks, rank 0 the rest and, after all, the manifest
        (:mod:`megatrain_lightning.serialization.ranked`); any number of ranks can load it."""
        engine = self.engine
        assert engine is not None
        handed, self._handed = self._handed, None
        if handed is not None:
            handed.check_saved(checkpoint.get("state_dict"))
        engine.wait_all()
        if not checkpointing.between_steps(engine, filepath):
            return
        state = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        state |= checkpointing.rng_states(self.root_device)
        state[checkpointing.SCHEDULE_KEY] = engine.schedule_state()
        optimizer = engine.optimizer if checkpoint.get("optimizer_states") else None
        if not self._checkpoint_size_logged:
            self._checkpoint_size_logged = True
            checkpointing.announce_size(os.fspath(filepath), engine, optimizer)
        save = ranked_checkpoint.save if engine.config.shard is not None else checkpointing.save
        save(os.fspath(filepath), engine, self.lightning_module, state, optimizer)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.is_global_zero:  # a save killed mid-replace left the previous one aside: one rank restores it
            recover(checkpoint_path)
        self.barrier()
        if not os.path.isdir(checkpoint_path):  # a directory is ours: ``verify`` says what it lacks
            with checkpointing.loaded_safely(checkpoint_path):
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        ckpt = ranked_checkpoint.verify(checkpoint_path, self.engine.config.shard)
        checkpointing.check_compatible(ckpt, self.engine)
        state = ckpt.lightning_state()
        state["state_dict"] = meta_state_dict(ckpt)  # what the hooks see: names, shapes, dtypes
        self._handed = HandedStateDict.of(state["state_dict"])
        state["megatrain_checkpoint"] = ckpt
        return state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        ckpt = checkpoint.get("megatrain_checkpoint")
        if ckpt is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        handed, self._handed = self._handed, None
        if handed is not None:
            handed.check_loaded(checkpoint.get("state_dict"))
        load = functools.partial(checkpointing.load_weights, ckpt, self.engine, self.lightning_module)
        ranked_checkpoint.on_every_rank(self.engine.config.shard, load)
        checkpointing.restore_rng(checkpoint, self.root_device)
        if checkpointing.SCHEDULE_KEY in checkpoint:  # absent in checkpoints of earlier versions
            self.engine.load_schedule_state(checkpoint[checkpointing.SCHEDULE_KEY])

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        load = functools.partial(checkpointing.load_optimizer, checkpoint, self.engine, self.engine.optimizer)
        ranked_checkpoint.on_every_rank(self.engine.config.shard, load)

    # -- the end --

    @override
    def teardown(self) -> None:
        """Wait for pending updates and move buffers back; the store stays, so ``state_dict`` still works.
        After a failure the same error would surface again from the waits: it is the one already on its
        way to the user, and raising here would skip the rest of Lightning's teardown (its signal
        handlers, which hold the trainer and so the whole model, would stay installed)."""
        if self.engine is not None:
            failed = self.lightning_module is not None and self.lightning_module.trainer.interrupted
            with contextlib.suppress(Exception) if failed else contextlib.nullcontext():
                self.engine.settle()
            if failed:
                self.engine.end_stopped_run()
        if self.lightning_module is not None:
            _move_buffers(self.lightning_module, torch.device("cpu"))
        self._hf_checkpointing()  # the user's own back
        self._hf_checkpointing = _nothing
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        if self.data_parallel and self.cluster_environment is not None:
            self.cluster_environment.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Block-paged training of models larger than GPU memory"
        )
        strategy_registry.register(
            "megatrain_nvme",
            cls,
            description="megatrain with the store on disk under <default_root_dir>/megatrain_offload",
            offload_dir="auto",
        )
