"""The `megatrain` LightningCLI: fit and validate from YAML and from flags; strategy from class_path/init_args."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from omegaconf import OmegaConf

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.cli import COMMANDS, lightning_cli, main
from megatrain_lightning.telemetry.monitor import StepsProgressBar
from megatrain_lightning.train import run

REPO = Path(__file__).resolve().parents[1]
TINY_YAML = REPO / "configs" / "cli" / "tiny.yaml"
QUIET = [
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--data.seq_len=32",
    "--data.batch_size=2",
]


def test_fit_from_yaml_console_script(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [
        "megatrain",
        "fit",
        "--config",
        str(TINY_YAML),
        "--trainer.strategy=megatrain",
        "--trainer.max_steps=3",
        "--trainer.log_every_n_steps=1",
        "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=1",
        *QUIET,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "lightning_logs" / "tiny" / "version_0"
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert sum(1 for r in rows if r.get("train_loss")) == 3
    assert any(r.get("val_ppl") for r in rows) and any(r.get("tokens_per_s") for r in rows)
    # The flag replaced the YAML's class_path strategy by the registered name.
    assert "class_path: megatrain_lightning.MegaTrainStrategy" not in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize(
    "launcher",
    [
        ["megatrain"],
        ["torchrun", "--nproc_per_node=2", "--master_port={port}", "-m", "megatrain_lightning.cli"],
    ],
    ids=["console-script", "torchrun"],
)
def test_two_devices_from_the_console_script_as_the_readme_launches_them(tmp_path, launcher):
    """`--trainer.devices=2` with the strategy's default launcher (Lightning's, which runs the command again
    for rank 1) and under torchrun (its processes are the ranks), as the README says: both ranks train,
    and the checkpoint holds each rank's files."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MASTER_PORT"] = port = str(find_free_network_port())
    cmd = [
        *(arg.format(port=port) for arg in launcher),
        "fit",
        "--config",
        str(TINY_YAML),
        "--trainer.devices=2",
        "--trainer.max_steps=2",
        *QUIET,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checkpoint = tmp_path / "lightning_logs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    ranks = {name.split("-of-")[0][-5:] for name in os.listdir(checkpoint / "model") if "-rank-" in name}
    assert ranks == {"00000", "00001"}


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    """LightningCLI warns when sys.argv holds arguments besides ``args`` (here: pytest's)."""
    monkeypatch.setattr("sys.argv", ["megatrain"])


def test_validate_from_yaml_with_class_path_strategy(tmp_path):
    cli = lightning_cli(
        [
            "validate",
            "--config",
            str(TINY_YAML),
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.limit_val_batches=2",
            *QUIET,
        ]
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MegaTrainStrategy)
    assert strategy.max_vram_gb == 0.01 and strategy.optimizer_compression == "none"
    assert 4.5 < float(cli.trainer.callback_metrics["val_loss"]) < 6.5  # untrained: about ln(256)


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_subcommands_from_flags(tmp_path, subcommand):
    cli = lightning_cli(
        [
            subcommand,
            "--trainer.strategy=megatrain_lightning.MegaTrainStrategy",
            "--trainer.strategy.max_vram_gb=0.001",
            "--trainer.strategy.prefetch_depth=1",
            "--trainer.accelerator=cpu",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.limit_test_batches=1",
            "--trainer.limit_predict_batches=1",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--model.model=gpt2",
            *QUIET,
        ]
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MegaTrainStrategy)
    assert (strategy.max_vram_gb, strategy.prefetch_depth) == (0.001, 1)
    assert cli.model.config.model_type == "gpt2"
    if subcommand == "fit":
        assert cli.trainer.global_step == 2
    elif subcommand != "predict":
        assert {"validate": "val_loss", "test": "test_loss"}[subcommand] in cli.trainer.callback_metrics


def test_plan_subcommand_prints_the_table(capsys):
    main(
        [
            "plan",
            "--model",
            "7b",
            "--vram",
            "80",
            "--ram",
            "512",
            "--disk",
            "4000",
            "--tokens-per-step",
            "8192",
        ]
    )
    out = capsys.readouterr().out
    for method in ("plain AdamW", "ZeRO-Offload", "megatrain none", "megatrain int8", "megatrain int4"):
        assert method in out
    assert "recommended: megatrain none with the store in host RAM" in out
    assert "network GB" not in out  # one rank: neither the column nor its legend
    main(["plan", "--model", "7b", "--vram", "80", "--ram", "512", "--ranks", "8", "--nodes", "2"])
    assert "network GB" in capsys.readouterr().out


def test_megatrain_is_the_default_strategy_and_help_lists_every_subcommand(capsys):
    quiet = [q for q in QUIET if "progress_bar" not in q]
    cli = lightning_cli(["--trainer.strategy.max_vram_gb=0.5", *quiet], run=False)
    assert isinstance(cli.trainer.strategy, MegaTrainStrategy) and cli.trainer.strategy.max_vram_gb == 0.5
    assert isinstance(cli.trainer.progress_bar_callback, StepsProgressBar) or not _RICH_AVAILABLE
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for subcommand in ("fit", "validate", "test", "predict", *COMMANDS):
        assert subcommand in out, subcommand
    assert {"plan", "export"} <= set(COMMANDS)


def test_plan_usage_error_is_one_line_naming_the_presets(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "13b", "--vram", "80", "--ram", "512"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "13b" in err and "tiny, 170m, 1b, 3b, 7b, 70b" in err


def _plan_lines(capsys, *args: str) -> list[str]:
    main(["plan", "--model", "7b", "--vram", "8", "--ram", "64", *args])
    return capsys.readouterr().out.splitlines()


def test_plan_compression_bounds_the_recommendation(capsys):
    """`--compression X`: the recommendation's optimizer state is no lossier than X, or the last line says
    why X does not fit and which lossier one does."""
    # int2's step bound is within 10% of int4's: the less lossy one is recommended
    assert _plan_lines(capsys, "--disk", "500")[-1].startswith("recommended: megatrain int4 ")
    assert _plan_lines(capsys, "--disk", "500", "--compression", "none")[-1].startswith(
        "recommended: megatrain none with the store on disk"
    )
    assert _plan_lines(capsys, "--disk", "500", "--compression", "int4")[-1].startswith(
        "recommended: megatrain int4 "
    )
    last = _plan_lines(capsys, "--disk", "80", "--compression", "none")[-1]
    assert "--compression none (no lossier state): does not fit this machine" in last
    assert "megatrain none needs 107.8 GB of disk (80.0 GB usable)" in last
    assert last.endswith("megatrain int8 fits (--compression int8 allows it).")


def test_plan_without_a_disk_says_none_was_given(capsys):
    last = _plan_lines(capsys)[-1]
    assert "does not fit this machine" in last and "no disk was given (--disk GB)" in last


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--vram", "-5", "must be at least 0, got -5"),
        ("--ram", "-1", "must be at least 0, got -1"),
        ("--disk", "-500", "must be at least 0, got -500"),
        ("--disk", "inf", "must be at least 0, got inf"),
        ("--tflops", "0", "must be more than 0, got 0"),
        ("--ranks", "0", "must be at least 1, got 0"),
        ("--tokens-per-step", "-4096", "must be at least 1, got -4096"),
        ("--pcie-gbps", "fast", "expected a number more than 0, got 'fast'"),
    ],
)
def test_plan_refuses_negative_sizes_as_usage_errors(capsys, flag, value, message):
    argv = ["plan", "--model", "7b", "--vram", "8", "--ram", "64", flag, value]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"megatrain plan: error: argument {flag}: {message}"


def test_plan_takes_what_is_not_given_from_this_machine_and_says_so(capsys, monkeypatch):
    class Memory:
        available = 31.5e9

    monkeypatch.setattr("psutil.virtual_memory", lambda: Memory)
    main(["plan", "--model", "tiny_llama", "--device", "cpu"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "planning with this machine's free memory: --ram 31.5 (GB)"
    assert out[2].startswith("machine: CPU only: 31.5 GB RAM")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main(["plan", "--model", "7b", "--vram", "80"])  # planning a GPU machine from one without: RAM only
    assert (
        capsys.readouterr().out.splitlines()[0] == "planning with this machine's free memory: --ram 31.5 (GB)"
    )
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "7b", "--ram", "64"])
    assert exit_.value.code == 2
    assert "required: --vram (this machine has no GPU) or --device cpu" in capsys.readouterr().err


def test_plan_of_a_file_that_is_not_a_config_names_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", str(REPO / "README.md"), "--vram", "8", "--ram", "64"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "README.md' is a file but not a Hugging Face config.json" in err


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "missing.ckpt is not a megatrain checkpoint directory"),
        ("out is a directory", "is a directory; name the single checkpoint file to write"),
        ("disk full", "No space left on device"),
    ],
)
def test_convert_refusals_are_usage_errors(tmp_path, capsys, monkeypatch, case, message):
    """As `megatrain export`'s: one line and exit code 2 (a bug would keep its traceback)."""
    checkpoint, out = tmp_path / "missing.ckpt", tmp_path / "out.ckpt"
    if case == "out is a directory":
        out.mkdir()
    if case == "disk full":

        def full(path, out):
            raise OSError(28, "No space left on device", str(out))

        monkeypatch.setattr("megatrain_lightning.cli.convert_checkpoint", full)
    with pytest.raises(SystemExit) as exit_:
        main(["convert", str(checkpoint), str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatrain convert: error: ") and message in err


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.ckpt is not a megatrain checkpoint directory" in err


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("offload_dir={file}", "exists and is not a directory"),
        ("max_vram_gb=-1", "must be a positive number of GB"),
        ("max_vram=2", "has no option `max_vram`. Did you mean `max_vram_gb`?"),
        ("init_args.max_vram=2", "has no option `max_vram`. Did you mean `max_vram_gb`?"),
    ],
)
def test_a_strategy_option_mistake_is_a_usage_error_naming_it(tmp_path, capsys, option, message):
    (tmp_path / "a_file").touch()
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "fit",
                "--config",
                str(TINY_YAML),
                f"--trainer.strategy.{option.format(file=tmp_path / 'a_file')}",
            ]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("names", ["flag", "config"])
def test_options_of_another_strategy_are_left_to_jsonargparse(tmp_path, capsys, names):
    ddp = "lightning.pytorch.strategies.DDPStrategy"
    (tmp_path / "ddp.yaml").write_text(f"trainer:\n  strategy:\n    class_path: {ddp}\n")
    strategy = (
        [f"--trainer.strategy.class_path={ddp}"]
        if names == "flag"
        else ["--config", str(tmp_path / "ddp.yaml")]
    )
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "fit",
                "--config",
                str(TINY_YAML),
                *strategy,
                "--trainer.strategy.find_unused_parameters=true",
                "--print_config",
            ]
        )
    assert exit_.value.code == 0, capsys.readouterr().err
    assert "find_unused_parameters: true" in capsys.readouterr().out


def test_a_misspelt_strategy_option_is_a_usage_error_without_subcommands_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        lightning_cli(["--trainer.strategy.max_vram=2"], run=False)
    assert exit_.value.code == 2 and "Did you mean `max_vram_gb`?" in capsys.readouterr().err


def test_fit_resumes_from_ckpt_path(tmp_path):
    """`megatrain fit --ckpt_path`: a checkpoint of a run with omegaconf hyperparameters (as the Hydra app
    writes) loads with weights_only=True and training goes on from its step."""
    from omegaconf import OmegaConf

    args = [
        "--trainer.accelerator=cpu",
        "--trainer.logger=false",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={tmp_path}",
        *QUIET,
    ]
    first = lightning_cli(["--trainer.max_steps=2", *args], run=False)
    first.model = type(first.model)(betas=OmegaConf.create([0.9, 0.95]))  # what Hydra's instantiate passes
    first.trainer.fit(first.model, datamodule=first.datamodule)
    ckpt = tmp_path / "first.ckpt"
    first.trainer.save_checkpoint(ckpt)
    second = lightning_cli(["fit", "--trainer.max_steps=3", f"--ckpt_path={ckpt}", *args])
    assert second.trainer.global_step == 3 and isinstance(second.trainer.strategy, MegaTrainStrategy)


def test_a_ckpt_path_that_does_not_exist_is_said_before_anything_is_built(tmp_path, capsys):
    """Lightning finds it missing only after the model and its store are built (minutes for a large
    model): the CLI and the Hydra app say so first, and build nothing."""
    missing = tmp_path / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *QUIET, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={missing}"])
    assert exit_.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="does not exist .* nothing was built"):
        run(OmegaConf.create({"ckpt_path": str(missing), "seed": 0}))
    assert not any(tmp_path.iterdir())


def test_text_where_the_trainer_takes_a_number_is_said_by_name():
    """Lightning would take `trainer.max_steps=abc` and fail inside its loop with a TypeError."""
    for option, message in (
        ("max_steps", "takes int; got 'abc'"),
        ("gradient_clip_val", "takes int or float"),
    ):
        with pytest.raises(MisconfigurationException, match=f"trainer.{option} {message}"):
            run(OmegaConf.create({"trainer": {option: "abc"}, "seed": 0}))
