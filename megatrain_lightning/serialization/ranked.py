"""Checkpoints of a data-parallel run, written by every rank at once: each streams its own share of the
store into the checkpoint directory (ZeRO-Infinity's bandwidth-centric saving; on several nodes the
directory must be on a filesystem they share, as for any sharded checkpoint).

Rank 0 checks the space and opens the temporary directory; every rank writes its pieces of every block
(``block-NNNNN-rank-RRRRR-of-WWWWW.safetensors``, see :func:`.checkpoint.write_share`), rank 0 also
Lightning's state; once every rank reported its files written and synced, rank 0 adds them to the
manifest and publishes the directory. A failure on any rank removes the temporary directory and raises
on every rank, so none waits for the others; the ranks leave the save only once it is removed
(:func:`_raise_together`). Loading puts the pieces together (:class:`.checkpoint_dir.CheckpointDir`): a
checkpoint loads into any number of ranks, each reading its own share; its checks and loads are collective
in the same way (:func:`on_every_rank`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch.distributed as dist
from torch import nn

from megatrain_lightning.serialization.checkpoint import (
    check_free_space,
    checkpoint_bytes,
    raise_write_failure,
    write_rest,
    write_share,
)
from megatrain_lightning.serialization.checkpoint_dir import CheckpointDir, CheckpointError
from megatrain_lightning.serialization.publish import CheckpointIOError, CheckpointWriter

if TYPE_CHECKING:
    from megatrain_lightning.engine.distributed import Shard

T = TypeVar("T")


def save(path: str, engine: Any, module: nn.Module, lightning_state: dict[str, Any], optimizer: Any) -> None:
    """Collective: every rank calls it with the same ``path``."""
    first = engine.config.shard.rank == 0
    writer, failure = None, None
    if first:
        try:
            need = checkpoint_bytes(engine, optimizer)
            check_free_space(path, need)
            writer = CheckpointWriter(path, expected_bytes=need // engine.config.shard.world)
        except BaseException as err:
            failure = err
    tmp = _from_first(failure, writer.tmp if writer is not None else None, path)
    writer = writer or CheckpointWriter(path, tmp)
    try:
        write_share(writer, engine, optimizer)
        if first:
            write_rest(writer, engine, module, lightning_state, optimizer)
    except BaseException as err:
        failure = err
    reports: list[Any] = [None] * engine.config.shard.world
    dist.all_gather_object(reports, (writer.files, _reason(failure)))
    reasons = [reason for _, reason in reports]
    if any(reasons):  # every rank knows: each raises, no rank waits for another
        _raise_together(failure, reasons, writer if first else None, writer.path)
    if first:
        for files, _ in reports:
            writer.files.update(files)
        try:
            writer.publish()
        except BaseException as err:
            failure = err
            writer.abandon()
    _from_first(failure, None, path)


def verify(path: str, shard: Shard | None) -> CheckpointDir:
    """:meth:`CheckpointDir.verify`; data parallel, with the checksums divided among the ranks (each reads
    1/world of the files), and collective (:func:`on_every_rank`)."""
    share = None if shard is None else (shard.rank, shard.world)
    return on_every_rank(shard, lambda: CheckpointDir.verify(path, share=share))


def on_every_rank(shard: Shard | None, load: Callable[[], T]) -> T:
    """``load`` (a part of loading a checkpoint) on this rank; data parallel, collective: if it fails on
    any rank, every rank raises (its own error, or one naming the rank that failed), so that none goes on
    to wait in a collective for a rank that stopped."""
    if shard is None:
        return load()
    result, failure = None, None
    try:
        result = load()
    except BaseException as err:
        failure = err
    reasons: list[str | None] = [None] * shard.world
    dist.all_gather_object(reasons, _reason(failure))
    _raise_any(failure, reasons, None)
    return cast(T, result)


def _from_first(failure: BaseException | None, value: Any, path: str) -> Any:
    """Rank 0's ``value``; or, where rank 0 passes the error it met, that error raised on every rank."""
    message = [value, _reason(failure)]
    dist.broadcast_object_list(message, src=0)
    _raise_any(failure, [message[1]], path)
    return message[0]


def _raise_together(
    failure: BaseException | None, reasons: list[str | None], abandon: CheckpointWriter | None, path: str
) -> None:
    """Every rank raises (:func:`_raise_any`), none before ``abandon`` (rank 0's writer) removed the temporary
    directory: the ranks leave the save together, from a barrier. A rank that ended earlier would have the
    launcher stop the others (SIGTERM), and Lightning's SIGTERM handler runs a collective, which fails against
    the ended rank: its error would stop the removal halfway, leaving a partial copy, and replace the rank's
    own. An error met on the way (such a handler's, a lost rank's) becomes the raised error's context."""
    try:
        try:
            if abandon is not None:
                abandon.abandon()
        finally:
            dist.barrier()
    except Exception:  # raised in here, this rank's error has it as its context
        _raise_any(failure, reasons, path)
    _raise_any(failure, reasons, path)


def _raise_any(failure: BaseException | None, reasons: list[str | None], writing: str | None) -> None:
    """Raise this rank's own error, else one naming the first rank that failed (``reasons``, by rank), of
    writing the checkpoint ``writing`` or (``None``) of loading one."""
    if isinstance(failure, OSError) and writing is not None:
        raise_write_failure(failure, writing)
    if failure is not None:
        raise failure
    for rank, reason in enumerate(reasons):
        if reason is None:
            continue
        if writing is not None:
            raise CheckpointIOError(
                f"megatrain: the checkpoint was not written: rank {rank} failed ({reason}); the previous "
                "checkpoint there is unchanged."
            )
        raise CheckpointError(f"megatrain: rank {rank} could not load the checkpoint: {reason}")


def _reason(failure: BaseException | None) -> str | None:
    return None if failure is None else f"{type(failure).__name__}: {failure}"
