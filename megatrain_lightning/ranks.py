"""What makes :class:`megatrain_lightning.MegaTrainStrategy` a parallel strategy: its ranks, the launcher
that starts them and the collectives Lightning asks of a strategy, as DDP's. With one process none of it
runs: no launcher, no process group, and the collectives return their input."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from megatrain_lightning.engine.distributed import Shard
from megatrain_lightning.engine.runtime import EngineConfig
from megatrain_lightning.store.preflight import missing_dirs

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


def backend_for(device: torch.device, asked: str | None) -> str:
    """The default group's backend: gloo on the CPU; on CUDA NCCL for the device's tensors and gloo for the
    host's, one group carrying both (``"cpu:gloo,cuda:nccl"``): the store's shards, checkpoint records and
    clipping norms are exchanged on the host. A plain ``"nccl"`` is given gloo for the host so."""
    if asked is None:
        return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    return "cpu:gloo,cuda:nccl" if asked == "nccl" else asked


class _RankLauncher(_MultiProcessingLauncher):
    """``ddp_spawn``'s launcher. Its ranks end with ``os._exit``, which runs no finalizer, so each releases
    its disk-tier store once its results are collected (its weights were sent by then)."""

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # the error on its way to the user is the one to see
                self._strategy.release_disk_store()
            raise
        self._strategy.release_disk_store()


class RankedStrategy(ParallelStrategy):
    """Ranks as under DDP: ``start_method`` picks Lightning's launcher, ``process_group_backend`` and
    ``timeout`` the process group (see :class:`megatrain_lightning.MegaTrainStrategy`)."""

    def __init__(
        self,
        accelerator: Any = None,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            **kwargs,
        )
        self._num_nodes = 1
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    def rank_engine_config(
        self, config: EngineConfig, created_dirs: list[str]
    ) -> tuple[EngineConfig, list[str]]:
        """``config`` for this rank: its shard of every block, its files in ``offload_dir/rank<N>`` (ranks may
        share a disk); and the folders to remove with its store: every folder a rank made for this run
        (the last rank out removes them)."""
        offload_dir = config.offload_dir
        if offload_dir is not None:
            made: list[list[str]] = [[] for _ in range(self.world_size)]
            torch.distributed.all_gather_object(made, created_dirs)
            shared = sorted({path for paths in made for path in paths}, key=lambda p: -p.count(os.sep))
            offload_dir = os.path.join(offload_dir, f"rank{self.global_rank}")
            created_dirs = missing_dirs(offload_dir) + shared
        if not config.activation_checkpointing:
            rank_zero_warn(
                "megatrain: data parallel without activation checkpointing keeps every gathered block until "
                "its backward: the whole model in the compute dtype on each device. "
                "`activation_checkpointing=True` holds the block computing and the one gathered ahead."
            )
        shard = Shard(self.global_rank, self.world_size, self._exchange_device())
        return dataclasses.replace(config, offload_dir=offload_dir, shard=shard), created_dirs

    def _exchange_device(self) -> torch.device:
        """Where the ranks exchange blocks: the GPU where NCCL carries its tensors, else the host (gloo)."""
        nccl = "nccl" in (self._process_group_backend or "")
        return self.root_device if self.root_device.type == "cuda" and nccl else torch.device("cpu")

    def release_disk_store(self) -> None:
        """Free what a rank holds outside the process (files) before it ends without finalizers."""

    @property
    @override
    def root_device(self) -> torch.device:
        if self.parallel_devices:
            return self.parallel_devices[self.local_rank if self.data_parallel else 0]
        return torch.device("cpu")

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def data_parallel(self) -> bool:
        """Whether this run has more than one rank (set by the Trainer's ``devices`` and ``num_nodes``)."""
        return self.num_nodes * self.num_processes > 1

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning for custom strategies: distributed samplers, ``sync_dist``."""
        return self.data_parallel

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def _configure_launcher(self) -> None:
        """One process: no launcher (the Trainer's own). More: Lightning's, as for DDP."""
        if not self.data_parallel:
            self._launcher = None
            return
        if self.root_device.type not in ("cpu", "cuda"):
            raise MisconfigurationException(
                f"megatrain trains on {self.num_nodes * self.num_processes} devices on CPUs (gloo) or CUDA "
                f"GPUs (NCCL); this run asks for accelerator {self.root_device.type!r}. Use one of those, "
                "or `Trainer(devices=1, num_nodes=1)`."
            )
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = _RankLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.data_parallel:
            reset_seed()
            self.set_world_ranks()
            backend = backend_for(self.root_device, self._process_group_backend)
            self._process_group_backend = backend
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
            # Lightning destroys the group at exit for a plain "nccl" only. Left to the interpreter's
            # finalization, gloo's worker threads abort a rank now and then after its work is done
            # ("terminate called without an active exception", pytorch/pytorch#190489): once for every group.
            atexit.unregister(_destroy_dist_connection)
            atexit.register(_destroy_dist_connection)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> Tensor | Any:
        if not (isinstance(tensor, Tensor) and self.data_parallel):
            return tensor
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if mean and tensor.device.type == "cpu" and _distributed_is_initialized():
            # gloo has no AVG, and Lightning sums and divides only where the group is plain "gloo", not
            # "cpu:gloo,cuda:nccl" (integer tensors, e.g. a logged metric's batch count, would fail)
            world = torch.distributed.get_world_size(group)
            _sync_ddp_if_available(tensor, group, reduce_op="sum")
            return tensor.div_(world) if torch.is_floating_point(tensor) else tensor.copy_(tensor / world)
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def barrier(self, name: str | None = None) -> None:
        if self.data_parallel and _distributed_is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not (self.data_parallel and _distributed_is_initialized()):
            return obj
        objects = [obj]
        torch.distributed.broadcast_object_list(objects, src)
        return objects[0]
