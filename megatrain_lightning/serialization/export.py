"""A megatrain checkpoint out as a Hugging Face ``save_pretrained`` directory, one tensor at a time."""

from __future__ import annotations

import json
import os
import re
import shutil

from megatrain_lightning.serialization.checkpoint_dir import CheckpointDir
from megatrain_lightning.serialization.hf import INDEX_NAME, SINGLE_NAME
from megatrain_lightning.serialization.publish import is_checkpoint_dir, recover, remove_entry, replace_dir
from megatrain_lightning.serialization.safetensors_io import (
    PiecedEntry,
    ShardWriter,
    TensorEntry,
    read_tensor,
)
from megatrain_lightning.telemetry.progress import byte_progress

# What an earlier save of the weights left, replaced by this one (as ``save_pretrained`` removes them).
_WEIGHTS = re.compile(r"config\.json|(model|pytorch_model).*\.(safetensors|bin)(\.index\.json)?")


def export_hf(ckpt_dir: str, out_dir: str, max_shard_bytes: int = 5 << 30) -> None:
    """Write a megatrain checkpoint as a ``save_pretrained`` directory (config.json, sharded safetensors
    with index), one tensor in memory at a time. Into an existing folder as ``save_pretrained`` writes:
    its other files (a tokenizer, a model card) stay, the earlier weights and config are replaced; the
    whole folder is swapped in at once, so a failed export leaves it as it was."""
    ckpt = CheckpointDir.verify(ckpt_dir)
    recover(out_dir)  # what a killed export left
    _check_out_dir(ckpt.path, out_dir)
    config = ckpt.hf_config()
    prefix = ckpt.manifest["hf_prefix"]
    entries = {name[len(prefix) :]: entry for name, entry in ckpt.weights().entries.items()}
    tmp = f"{out_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=False)
    try:
        _write_weights(entries, tmp, max_shard_bytes, os.path.basename(out_dir.rstrip(os.sep)))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(config)
        if os.path.isdir(out_dir):
            _keep_other_files(out_dir, tmp)
        replace_dir(tmp, out_dir)
    except BaseException:
        remove_entry(tmp)
        raise


def _write_weights(
    entries: dict[str, TensorEntry | PiecedEntry], tmp: str, max_shard_bytes: int, name: str
) -> None:
    shards: list[list[str]] = [[]]
    size = 0
    for tensor, entry in entries.items():
        if shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += entry.nbytes
    weight_map = {}
    total = sum(e.nbytes for e in entries.values())
    with byte_progress(total, f"exporting {name}") as progress:
        for i, names in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else SINGLE_NAME
            writer = ShardWriter(
                os.path.join(tmp, file),
                [(n, entries[n].dtype, entries[n].shape) for n in names],
                {"format": "pt"},
            )
            for tensor in names:
                writer.write(tensor, read_tensor(entries[tensor]))
                weight_map[tensor] = file
                progress.update(entries[tensor].nbytes)
            writer.close()
    if len(shards) > 1:
        with open(os.path.join(tmp, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def _check_out_dir(ckpt: str, out_dir: str) -> None:
    """Refuse, before writing anything, an output that would take the checkpoint, another checkpoint, a
    file or the current folder with it."""
    out, source, here = (os.path.realpath(p) for p in (out_dir, ckpt, os.getcwd()))
    if os.path.commonpath([out, source]) in (out, source):
        problem = "is the checkpoint, or holds it or lies inside it"
    elif is_checkpoint_dir(out_dir):
        problem = "is a megatrain checkpoint"
    elif os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        problem = "exists and is not a folder"
    elif os.path.commonpath([out, here]) == out:
        problem = "is the current folder or holds it"
    else:
        return
    raise FileExistsError(
        f"megatrain: {out_dir} {problem}; nothing was written. Export to a new folder, or to a "
        "Hugging Face model folder (its other files stay, its weights are replaced)."
    )


def _keep_other_files(out_dir: str, tmp: str) -> None:
    """Every entry of ``out_dir`` but earlier weights and config into the new folder, as hard links where
    the filesystem has them (no bytes copied) and as copies elsewhere."""
    for name in os.listdir(out_dir):
        if _WEIGHTS.fullmatch(name):
            continue
        source, target = os.path.join(out_dir, name), os.path.join(tmp, name)
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(source, target)


def _link_or_copy(source: str, target: str) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
