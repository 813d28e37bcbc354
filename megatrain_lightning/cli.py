"""``megatrain``: the LightningCLI subcommands ``fit``, ``validate``, ``test``, ``predict``, and ``plan``.

The Lightning subcommands take ``CausalLMModule`` (``--model.*``) and ``TextDataModule`` (``--data.*``)
and every ``Trainer`` argument (``--trainer.*``), from flags or ``--config`` YAML files, e.g.::

    megatrain fit --config configs/cli/tiny.yaml --trainer.strategy=megatrain
    megatrain fit --trainer.strategy=megatrain_lightning.MegaTrainStrategy --trainer.strategy.max_vram_gb=2
    megatrain plan --model 7b --vram 80 --ram 512 --disk 4000

``plan``, ``export`` and ``convert`` are not ``Trainer`` methods: :data:`COMMANDS` routes them before
LightningCLI parses, and ``megatrain --help`` lists them.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import yaml
from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

import megatrain_lightning  # noqa: F401  (registers the "megatrain" strategy)
from megatrain_lightning.budgets import check_option_names
from megatrain_lightning.data import TextDataModule
from megatrain_lightning.models import CausalLMModule
from megatrain_lightning.planner.plan import COMPRESSIONS, DTYPE_BYTES, Machine, Workload, plan_for
from megatrain_lightning.planner.shape import PRESETS, hydra_models
from megatrain_lightning.planner.table import format_plan
from megatrain_lightning.serialization.checkpoint_dir import CheckpointError, missing_resume_path
from megatrain_lightning.serialization.export import export_hf
from megatrain_lightning.serialization.single_file import convert_checkpoint
from megatrain_lightning.strategy import MegaTrainStrategy
from megatrain_lightning.telemetry.monitor import with_progress_bar

# The strategy unless `--trainer.strategy` says otherwise; its options: `--trainer.strategy.max_vram_gb=2`.
DEFAULT_STRATEGY = {"class_path": "megatrain_lightning.MegaTrainStrategy"}


class MegaTrainCLI(LightningCLI):
    """LightningCLI whose trainers show the step total of ``max_steps`` runs in the progress bar, and
    whose megatrain strategy options are checked before anything is built."""

    @override
    def parse_arguments(self, parser: Any, args: Any) -> None:
        """A misspelt strategy option on the command line (``--trainer.strategy.max_vram=2``) is the same
        usage error as its value's mistakes, with the closest name (jsonargparse would print its union's
        whole search)."""
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, list):
            own = inspect.signature(MegaTrainStrategy.__init__).parameters
            names = [name for name in _strategy_option_names(argv) if name not in own]
            try:
                check_option_names(MegaTrainStrategy, dict.fromkeys(names))
            except MisconfigurationException as err:
                subcommand = argv[0] if argv else ""
                self._parser_of(subcommand, parser).error(f"--trainer.strategy: {err}")
        super().parse_arguments(parser, args)

    @override
    def before_instantiate_classes(self) -> None:
        """A mistake in the strategy's options is one usage error that names it (jsonargparse, trying the
        trainer's ``strategy`` union, would print a long traceback with the message in its middle); so is a
        ``ckpt_path`` that does not exist, found before the model and its store are built."""
        if problem := missing_resume_path(self._get(self.config, "ckpt_path")):
            self._parser_of(str(self.subcommand), self.parser).error(f"--ckpt_path: {problem}")
        strategy = self._get(self.config, "trainer.strategy")
        if not isinstance(strategy, Namespace) or not _is_megatrain(strategy.class_path):
            return
        init_args = strategy.get("init_args") or Namespace()
        options = {k: v for k, v in vars(init_args).items() if not isinstance(v, Namespace)}
        try:
            MegaTrainStrategy(**options)
        except MisconfigurationException as err:
            self._parser_of(str(self.subcommand), self.parser).error(f"--trainer.strategy: {err}")

    def _parser_of(self, subcommand: str, default: Any) -> Any:
        """The parser whose usage an error shows: the subcommand's (none without subcommands)."""
        return getattr(self, "_subcommand_parsers", {}).get(subcommand, default)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks)
        kwargs["callbacks"] = with_progress_bar(callbacks, config.get("enable_progress_bar") is not False)
        return super().instantiate_trainer(**kwargs)


_NOT_OPTIONS = {"class_path", "help", "dict_kwargs"}  # jsonargparse's own keys under a class


def _strategy_option_names(argv: list[str]) -> list[str]:
    """The option names of ``--trainer.strategy.NAME`` flags where the strategy is megatrain's (the
    default, or named so by a flag or a ``--config`` file); none where it is another or unknown (a
    config file that cannot be read): jsonargparse reports those."""
    names: list[str] = []
    strategy: str | None = "megatrain"
    args = iter(argv)
    for arg in args:
        key, sep, value = arg.partition("=")
        if key in ("--config", "--trainer.strategy", "--trainer.strategy.class_path"):
            value = value if sep else next(args, "")
            strategy = _configured_strategy(value, strategy) if key == "--config" else value
        elif key.startswith("--trainer.strategy."):
            name = key.removeprefix("--trainer.strategy.").removeprefix("init_args.").split(".")[0]
            if name not in _NOT_OPTIONS:
                names.append(name)
    return names if _names_megatrain(strategy) else []


def _configured_strategy(path: str, before: str | None) -> str | None:
    """The strategy a ``--config`` file names (its class path), ``before`` where it names none, ``None``
    where the file cannot be read."""
    try:
        with open(path) as file:
            config = yaml.safe_load(file)
    except (OSError, yaml.YAMLError):
        return None
    trainer = config.get("trainer") if isinstance(config, dict) else None
    strategy = trainer.get("strategy") if isinstance(trainer, dict) else None
    if isinstance(strategy, dict):
        strategy = strategy.get("class_path")
    return strategy if isinstance(strategy, str) else before


def _names_megatrain(strategy: str | None) -> bool:
    """Whether ``strategy`` (a registered name, a class name or path) is megatrain's."""
    if strategy in ("megatrain", "MegaTrainStrategy"):
        return True
    try:
        return strategy is not None and _is_megatrain(strategy)
    except Exception:  # not a class path: jsonargparse says so
        return False


def _is_megatrain(class_path: str) -> bool:
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None) if module else None
    return isinstance(cls, type) and issubclass(cls, MegaTrainStrategy)


def lightning_cli(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """The LightningCLI of ``megatrain``; ``run=False`` only parses and instantiates (for tests)."""
    return MegaTrainCLI(
        CausalLMModule,
        TextDataModule,
        args=args,
        run=run,
        trainer_defaults={"strategy": DEFAULT_STRATEGY},
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": _description()},
    )


def _bounded(number: type[float] | type[int], least: float, strict: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number of at least ``least`` (above it if ``strict``), so that a negative
    size or a zero rate is a usage error naming the flag, not a plan computed from it."""
    bound = f"{'more than' if strict else 'at least'} {least:g}"
    kind = "an integer" if number is int else "a number"

    def parse(text: str) -> float:
        try:
            value = number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind} {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < least or (strict and value == least):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


def plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatrain plan",
        description="Memory needs (GB) of plain AdamW, ZeRO-Offload and megatrain for a model on a machine, "
        "the settings megatrain would choose, and a step-time lower bound.",
    )
    add = parser.add_argument
    add(
        "--model",
        required=True,
        help=f"a preset ({', '.join(PRESETS)}), a Hydra model config (model=NAME of megatrain-train: "
        f"{', '.join(hydra_models())}), a config.json or a model directory",
    )
    size, rate, count = _bounded(float, 0), _bounded(float, 0, strict=True), _bounded(int, 1)
    add(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="the compute device: a GPU, or the CPU alone (no GPU: activations and slots take the RAM)",
    )
    add(
        "--vram",
        type=size,
        default=None,
        help="GPU memory, GB (default: this machine's GPU's free memory; none with --device cpu)",
    )
    add("--ram", type=size, default=None, help="host memory, GB (default: this machine's available RAM)")
    add("--disk", type=size, default=0.0, help="free space for the disk tier, GB (default: none)")
    add("--pcie-gbps", type=rate, default=25.0, help="host<->GPU bandwidth, GB/s")
    add("--disk-gbps", type=rate, default=6.0, help="disk bandwidth, GB/s")
    add(
        "--tflops",
        type=rate,
        default=None,
        help="compute in the compute dtype, TFLOP/s (default: 400, a GPU's; with --device cpu 1, a many-core "
        "server CPU's in fp32: give yours)",
    )
    add("--update-gparams", type=rate, default=5.0, help="the host's AdamW, G parameters updated per s")
    add("--ranks", type=count, default=1, help="data parallel: ranks (GPUs) per node; figures per rank")
    add("--nodes", type=count, default=1, help="data parallel: nodes")
    add("--network-gbps", type=rate, default=25.0, help="data parallel: each rank's collective GB/s")
    add("--tokens-per-step", type=count, default=4096, help="tokens per optimizer step (on each rank)")
    add(
        "--micro-batch-tokens",
        type=count,
        default=None,
        help="tokens per micro-batch (default: one per step)",
    )
    add(
        "--compute-dtype",
        choices=tuple(DTYPE_BYTES),
        default=None,
        help="the compute dtype of a precision megatrain accepts: fp32 (32-true) or bf16 (planned as "
        "bf16-mixed, which keeps embeddings, norms and biases fp32 on the device; bf16-true needs no more); "
        "default: bf16 on a GPU, fp32 with --device cpu (the Trainer's defaults there)",
    )
    add(
        "--compression",
        choices=COMPRESSIONS,
        default=None,
        help="the lossiest optimizer state to recommend (default: any; `none`: fp32 only)",
    )
    add("--no-activation-checkpointing", action="store_true", help="keep all activations")
    return parser


def _this_machines_memory(vram: float | None, ram: float | None, cpu: bool) -> tuple[float, float]:
    """GPU memory and RAM, GB: as given, or this machine's free GPU memory and available RAM (said so)."""
    taken = []
    if vram is None and not cpu:
        vram = Machine.detect("cuda").vram_gb
        taken.append(f"--vram {vram:.1f}")
    if ram is None:
        ram = Machine.detect("cpu").ram_gb
        taken.append(f"--ram {ram:.1f}")
    if taken:
        print(f"planning with this machine's free memory: {' '.join(taken)} (GB)")
    return vram or 0.0, ram


def plan_main(argv: list[str]) -> None:
    """``megatrain plan``: print the planner's table; a model it cannot read is a one-line usage error."""
    parser = plan_parser()
    a = parser.parse_args(argv)
    cpu = a.device == "cpu"
    if cpu and a.vram is not None:
        parser.error("argument --vram: a CPU-only run (--device cpu) has no GPU memory; its memory is --ram")
    if not cpu and a.vram is None and not torch.cuda.is_available():
        parser.error("the following arguments are required: --vram (this machine has no GPU) or --device cpu")
    vram, ram = _this_machines_memory(a.vram, a.ram, cpu)
    tflops = a.tflops or (1.0 if cpu else 400.0)
    speeds = (a.pcie_gbps, a.disk_gbps, tflops, a.update_gparams)
    machine = Machine(vram, ram, a.disk, *speeds, a.ranks, a.nodes, a.network_gbps, cpu)
    dtype = a.compute_dtype or ("fp32" if cpu else "bf16")
    workload = Workload(a.tokens_per_step, a.micro_batch_tokens, dtype, not a.no_activation_checkpointing)
    try:
        plan = plan_for(a.model, machine, a.compression or "none", workload)
    except (ValueError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(format_plan(plan, a.compression))


def export_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="megatrain export", description="Write a megatrain checkpoint as a save_pretrained directory."
    )
    parser.add_argument("checkpoint", help="a megatrain checkpoint directory (e.g. .../last.ckpt)")
    parser.add_argument("out", help="the Hugging Face model directory to write")
    parser.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="largest safetensors file, GB (default 5)"
    )
    args = parser.parse_args(argv)
    try:
        export_hf(args.checkpoint, args.out, max_shard_bytes=int(args.max_shard_gb * 1e9))
    except (CheckpointError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(f"wrote {args.out}")


def convert_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="megatrain convert",
        description="Write a megatrain checkpoint directory as a standard single-file Lightning checkpoint "
        "(for `torch.load`, `load_from_checkpoint` and any strategy); the model must fit in RAM.",
    )
    parser.add_argument("checkpoint", help="a megatrain checkpoint directory (e.g. .../last.ckpt)")
    parser.add_argument("out", help="the .ckpt file to write")
    args = parser.parse_args(argv)
    try:
        convert_checkpoint(args.checkpoint, args.out)
    except (CheckpointError, OSError) as err:  # as export's: a usage error; a bug keeps its traceback
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(f"wrote {args.out}")


# Subcommands that are not Trainer methods: name -> (function of the remaining arguments, one-line help).
COMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "plan": (plan_main, "will a model fit this machine: memory, megatrain's settings, a step-time bound"),
    "export": (export_main, "write a megatrain checkpoint as a Hugging Face save_pretrained directory"),
    "convert": (convert_main, "write a megatrain checkpoint as a standard single-file Lightning checkpoint"),
}


def _description() -> str:
    others = "; ".join(f"{name}: {help_}" for name, (_, help_) in COMMANDS.items())
    return (
        "Train Hugging Face causal LMs with Lightning and the megatrain strategy (the default "
        f"`--trainer.strategy`). Lightning's subcommands below; also {others}. "
        f"`megatrain SUBCOMMAND --help` for each ({', '.join(COMMANDS)} too)."
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point; ``argv`` defaults to ``sys.argv[1:]`` (LightningCLI reads it itself then)."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in COMMANDS:
        COMMANDS[args[0]][0](args[1:])
    else:
        lightning_cli(argv)


if __name__ == "__main__":
    main()
