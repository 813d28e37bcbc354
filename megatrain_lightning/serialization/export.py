"""A megatrain checkpoint out as a Hugging Face ``save_pretrained`` directory, one tensor at a time."""

from __future__ import annotations

import json
import os

from megatrain_lightning.serialization.checkpoint_dir import CheckpointDir
from megatrain_lightning.serialization.hf import INDEX_NAME, SINGLE_NAME
from megatrain_lightning.serialization.publish import replace_dir
from megatrain_lightning.serialization.safetensors_io import ShardWriter, read_tensor


def export_hf(ckpt_dir: str, out_dir: str, max_shard_bytes: int = 5 << 30) -> None:
    """Write a megatrain checkpoint as a ``save_pretrained`` directory (config.json, sharded safetensors
    with index), one tensor in memory at a time."""
    ckpt = CheckpointDir.verify(ckpt_dir)
    config = ckpt.hf_config()
    prefix = ckpt.manifest["hf_prefix"]
    entries = {name[len(prefix) :]: entry for name, entry in ckpt.weights().entries.items()}
    tmp = f"{out_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=False)
    shards: list[list[str]] = [[]]
    size = 0
    for name, entry in entries.items():
        if shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += entry.nbytes
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else SINGLE_NAME
        writer = ShardWriter(
            os.path.join(tmp, file),
            [(n, entries[n].dtype, entries[n].shape) for n in names],
            {"format": "pt"},
        )
        for name in names:
            writer.write(name, read_tensor(entries[name]))
            weight_map[name] = file
        writer.close()
    if len(shards) > 1:
        total = sum(e.nbytes for e in entries.values())
        with open(os.path.join(tmp, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        f.write(config)
    replace_dir(tmp, out_dir)
