"""The footprint planner, checked against footprints computed by hand for Llama-2-7B."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from transformers import AutoModelForCausalLM

import megatrain_lightning
from megatrain_lightning.cli import main
from megatrain_lightning.engine.blocks import discover_blocks
from megatrain_lightning.engine.slots import RUN_ALIGN, SlotLayout
from megatrain_lightning.planner.plan import (
    COMPRESSIONS,
    DTYPE_BYTES,
    RESERVE,
    Machine,
    ModelShape,
    Workload,
    activation_bytes,
    load_shape,
    plan_for,
    recommend,
    shortfalls,
)
from megatrain_lightning.planner.table import LEGEND, format_plan
from megatrain_lightning.precision import SUPPORTED, MegaTrainPrecision
from megatrain_lightning.presets import llama_config, tiny_config
from megatrain_lightning.store.sizing import staging_bytes

GB = 1e9
# Llama-2-7B by hand: h=4096, i=11008, 32 layers, vocabulary 32000, untied head.
H, FF, L, V = 4096, 11008, 32, 32000
LAYER = 4 * H * H + 3 * H * FF + 2 * H  # q, k, v, o; gate, up, down; two RMSNorms
N_7B = L * LAYER + 2 * V * H + H  # layers, embedding and head, final norm
# Blocks on the device under bf16-mixed: the embedding in fp32, the head in bf16, a layer's matrices in
# bf16 and its two norms in fp32, the final norm in fp32 (no run needs padding at these sizes).
EMBED_7B, HEAD_7B, LAYER_7B, NORM_7B = 4 * V * H, 2 * V * H, (LAYER - 2 * H) * 2 + 2 * H * 4, 4 * H
SLOT_7B = EMBED_7B  # the largest block on the device
assert max(LAYER_7B, HEAD_7B) < SLOT_7B
SHADOW_7B = N_7B - V * H - (2 * L + 1) * H  # bf16 in the slots under bf16-mixed: all but embedding and norms
STAGING_7B = 2 * 4 * LAYER  # the gradient offload's two page-locked buffers, the largest block in fp32
TOKENS = 4096
# bf16 activations with per-block checkpointing: block inputs, one layer for the recompute, logits
# (bf16, an fp32 copy and its gradient).
ACT_7B = L * H * TOKENS * 2 + (10 * H + 4 * FF) * TOKENS * 2 + TOKENS * V * (2 + 8)


def test_7b_shape_matches_closed_form():
    shape = load_shape("7b")
    assert shape.num_params == N_7B == 6_738_415_616
    assert shape.largest_block == LAYER and shape.num_blocks == L + 3
    assert (shape.hidden_size, shape.mlp_width, shape.num_layers, shape.vocab_size) == (H, FF, L, V)
    assert activation_bytes(shape, TOKENS, 2) == ACT_7B


def test_7b_footprints_by_hand():
    plan = plan_for(llama_config("7b"), Machine(vram_gb=80, ram_gb=512, disk_gb=4000))
    assert plan.activations_gb == pytest.approx(ACT_7B / GB)
    plain, zero = plan.row("plain AdamW"), plan.row("ZeRO-Offload")
    assert plain.gpu_gb == pytest.approx((16 * N_7B + ACT_7B) / GB) and not plain.fits  # 110.9 GB
    assert zero.gpu_gb == pytest.approx((2 * N_7B + ACT_7B) / GB) and zero.host_gb == pytest.approx(
        16 * N_7B / GB
    )
    state = {
        "none": 8,
        "int8": 2 + 4 / 256 + 4 / 128,  # codes, then one fp32 scale per block of m and of v
        "int4": 1 + 4 / 64 + 4 / 128,
        "int3": 0.75 + 4 / 64 + 4 / 64,
        "int2": 0.5 + 4 / 32 + 4 / 64,
    }
    for name, state_bytes in state.items():
        row = plan.row(f"megatrain {name}")
        # store (4 B master + state), the bf16 shadow, the 4 B/param gradient buffer, all in RAM, and the staging
        host = (4 + state_bytes + 4) * N_7B + 2 * SHADOW_7B + STAGING_7B
        assert row.host_gb == pytest.approx(host / GB), name
        # every block has a slot of its own size (a pool per size), and the activations
        slots = EMBED_7B + HEAD_7B + L * LAYER_7B + NORM_7B
        assert row.gpu_gb == pytest.approx((slots + ACT_7B) / GB) and row.disk_gb == 0
        assert row.settings.slot_pools == ((EMBED_7B, 1), (LAYER_7B, L), (HEAD_7B, 1), (NORM_7B, 1))
        assert row.fits and row.settings.tier == "host"
        assert (row.settings.num_slots, row.settings.prefetch_depth) == (L + 3, L + 2)  # every block fits
    assert plan.row("megatrain none").host_gb == pytest.approx(107.81 + 13.21 + 1.62, abs=0.02)
    assert plan.row("megatrain int8").host_gb == pytest.approx(67.70 + 13.21 + 1.62, abs=0.02)
    assert plan.row("megatrain int4").host_gb == pytest.approx(61.28 + 13.21 + 1.62, abs=0.02)
    # Step bound: compute 6 N T / FLOP/s against the link; all blocks resident, so weights come in once (the
    # shadow's bf16, the fp32 embedding and norms), fp32 gradients go out.
    none = plan.row("megatrain none")
    assert plan.row("plain AdamW").step_s == pytest.approx(6 * N_7B * TOKENS / 400e12)
    weights = 2 * SHADOW_7B + 4 * (N_7B - SHADOW_7B)
    assert none.step_s == pytest.approx((weights + 4 * N_7B) / 25e9) and none.bound_by == "link"


def test_a_slow_host_adamw_bounds_the_offloading_rows():
    """megatrain and ZeRO-Offload update on the host: at 0.2 G parameters per second (the int4 kernel on
    a share of two cores), a 7B step cannot take less than 6.74 B / 0.2e9 s; plain AdamW updates on the GPU."""
    plan = plan_for("7b", Machine(vram_gb=80, ram_gb=512, disk_gb=4000, update_gparams=0.2))
    for name in ("ZeRO-Offload", "megatrain none", "megatrain int4"):
        row = plan.row(name)
        assert row.bound_by == "update" and row.step_s == pytest.approx(N_7B / 0.2e9), name
    assert plan.row("plain AdamW").bound_by == "compute"


def test_data_parallel_rows_are_one_ranks_share_with_the_network_as_a_bound():
    """16 ranks (8 per node): a rank holds 1/16 of megatrain's store (no shadow: a rank converts its share
    as it sends it) in its eighth of its node's RAM, 1/16 of ZeRO-Offload's state, all of plain AdamW's; per
    step it receives 15/16 of two gathers in the blocks' dtypes (bf16 weights, fp32 norms and embeddings)
    and one fp32 reduce-scatter of the model (megatrain), of DDP's all-reduce (plain), of a weight gather
    and a gradient reduce-scatter in bf16 (ZeRO-Offload)."""
    node = Machine(vram_gb=80, ram_gb=8 * 64, disk_gb=4000, ranks_per_node=8, nodes=2, network_gbps=25)
    plan = plan_for("7b", node)
    megatrain, plain, zero = plan.row("megatrain none"), plan.row("plain AdamW"), plan.row("ZeRO-Offload")
    assert megatrain.fits and megatrain.settings.tier == "host"  # 8.4 GB of 64 x 0.9 (one rank alone: 121)
    # no slots under data parallel: the block computing and the one gathered ahead, and the activations
    act = activation_bytes(plan.model, plan.workload.micro_tokens, 2)
    two_blocks = sum(sorted(plan.model.block_bytes(2))[-2:])
    assert megatrain.gpu_gb == pytest.approx((two_blocks + act) / GB)
    assert megatrain.settings.cache_gb == pytest.approx(16 * N_7B / 16 / GB)
    assert megatrain.host_gb == pytest.approx((N_7B + STAGING_7B) / GB)
    assert zero.host_gb == pytest.approx(16 * N_7B / 16 / GB)
    received = 15 / 16
    narrow = load_shape("7b").shadow_numel(2)
    assert 0.9 * N_7B < narrow < N_7B  # the decoder layers' and the head's linear weights
    gathered = 2 * narrow + 4 * (N_7B - narrow)
    assert megatrain.network_gb == pytest.approx((2 * gathered + 4 * N_7B) * received / GB)
    assert plain.network_gb == pytest.approx(2 * 4 * N_7B * received / GB)
    assert zero.network_gb == pytest.approx(2 * 2 * N_7B * received / GB)
    assert (
        megatrain.step_s == pytest.approx((2 * gathered + 4 * N_7B) * received / 25e9)
        and megatrain.bound_by == "network"
    )
    # The eight ranks share the node's host AdamW: each updates its 1/16 at an eighth of its rate.
    assert plan_for("7b", dataclasses.replace(node, update_gparams=0.2)).row("megatrain int4").step_s == (
        pytest.approx(N_7B / 16 / (0.2e9 / 8))
    )
    alone = plan_for("7b", Machine(vram_gb=80, ram_gb=64, disk_gb=4000))
    header = [
        next(line for line in format_plan(p).splitlines() if line.startswith("method")) for p in (alone, plan)
    ]
    assert all(r.network_gb == 0 for r in alone.rows) and "network" not in header[0]
    assert "network GB" in header[1] and "16 in all" in format_plan(plan)


def test_7b_on_a_small_gpu_pages_and_a_small_host_goes_to_disk():
    workload = Workload(tokens_per_step=8 * 2048, micro_batch_tokens=2048)
    plan = plan_for("7b", Machine(vram_gb=12, ram_gb=64, disk_gb=1000, disk_gbps=5), "int8", workload)
    s = plan.settings
    act = activation_bytes(plan.model, 2048, 2)
    # The two largest blocks (the fp32 embedding, a layer) first, then a slot for each size whose share
    # of slots is least, the head and the final norm, then as many layer slots as the rest holds.
    layers = 1 + int((12 * GB * (1 - RESERVE) - act - EMBED_7B - LAYER_7B - HEAD_7B - NORM_7B) // LAYER_7B)
    assert s.slot_pools == ((EMBED_7B, 1), (LAYER_7B, layers), (HEAD_7B, 1), (NORM_7B, 1)) and 1 < layers < L
    assert s.tier == "disk"  # 67.7 GB of store and gradients > 57.6 GB usable RAM
    row = plan.row("megatrain int8")
    assert row.disk_gb == pytest.approx((4 + 2 + 4 / 256 + 4 / 128 + 4) * N_7B / GB)
    assert s.cache_gb == pytest.approx(64 * (1 - RESERVE) - STAGING_7B / GB)  # the rest pins the staging
    link = (
        (2 * 8 * 4 + 8 * 4) * N_7B / 25e9
    )  # fwd + bwd fp32 weights (no shadow on disk), gradients, 8 micro-batches
    disk = (4 + 2 + 4 / 256 + 4 / 128) * N_7B / 5e9  # all cached: updated weights, m, v written once
    assert row.step_s == pytest.approx(max(link, disk)) and row.bound_by == "link"


@pytest.mark.parametrize(
    ("model", "machine"),
    [
        ("7b", Machine(80, 512, 4000)),
        ("7b", Machine(24, 64, 1000)),
        ("70b", Machine(80, 512, 4000)),
        ("70b", Machine(141, 2000, 0)),
        ("1b", Machine(16, 32, 100)),
    ],
)
def test_auto_settings_fit_the_machine(model, machine):
    plan = plan_for(model, machine)
    best = recommend(plan)
    assert best is not None and best.fits
    s = best.settings
    assert s.num_slots >= 1 and s.prefetch_depth <= max(s.num_slots - 1, 1)
    assert s.max_vram_gb + plan.activations_gb <= machine.vram_gb
    sizes = Counter(plan.model.block_bytes(2))  # a pool per block size, at most a slot per block
    assert all(count <= sizes[size] for size, count in s.slot_pools)
    assert s.slot_gb <= s.max_vram_gb
    assert best.host_gb <= machine.ram_gb and s.cache_gb <= machine.ram_gb
    assert best.disk_gb <= machine.disk_gb
    if s.tier == "disk":  # the RAM also holds the blocks in use next to the slots' fetches
        assert (s.num_slots + 7) * 4 * plan.model.largest_block <= machine.ram_gb * GB


def test_70b_does_not_fit_a_small_machine():
    plan = plan_for("70b", Machine(24, 64, 100))
    assert not any(r.fits for r in plan.rows) and recommend(plan) is None
    assert "does not fit" in format_plan(plan)


@pytest.mark.parametrize(
    "machine", [Machine(8, 64, 500), Machine(8, 64, 80), Machine(8, 64), Machine(4, 16, 40)]
)
def test_recommendation_is_no_lossier_than_asked_or_says_what_is_short(machine):
    plan = plan_for("7b", machine)
    for asked in COMPRESSIONS:
        best = recommend(plan, asked)
        last = format_plan(plan, asked).splitlines()[-1]
        if best is not None:
            assert COMPRESSIONS.index(best.method.split()[-1]) <= COMPRESSIONS.index(asked)
            fitting = [plan.row(f"megatrain {c}") for c in COMPRESSIONS[: COMPRESSIONS.index(asked) + 1]]
            fitting = [r for r in fitting if r.fits]
            less_lossy = fitting[: fitting.index(best)]
            if best.settings.tier == "disk":  # lossier only for a step bound more than 10% shorter
                assert best.step_s <= 1.1 * min(r.step_s for r in fitting)
                assert all(r.step_s > 1.1 * min(r.step_s for r in fitting) for r in less_lossy)
            assert last.startswith(f"recommended: {best.method} ")
            continue
        least = plan.row(f"megatrain {asked}")  # the one needing least of those allowed
        short = shortfalls(least, machine)
        assert short and all(what in last for what, _, _ in short), last
        assert ("no disk was given" in last) == (machine.disk_gb == 0 and "disk" in [w for w, _, _ in short])
        lossier = recommend(plan)
        assert (lossier is not None) == ("--compression" in last.split("fit this machine")[1])


def test_shapes_from_files_modules_and_moe(tmp_path):
    config = tiny_config("llama")
    config.save_pretrained(tmp_path)
    from_dir, from_file = load_shape(tmp_path), load_shape(tmp_path / "config.json")
    model = AutoModelForCausalLM.from_config(config)
    expected = tuple(b.numel for b in discover_blocks(model))
    assert (
        from_dir.block_numels
        == from_file.block_numels
        == ModelShape.from_module(model).block_numels
        == expected
    )
    assert load_shape("tiny") == from_dir
    moe = load_shape(tiny_config("qwen2_moe"))
    assert moe.mlp_width == 32 * 2 + 64  # two active experts and the shared expert
    with pytest.raises(ValueError, match="preset"):
        load_shape("13b")
    with pytest.raises(ValueError, match="compression"):
        plan_for("tiny", Machine(1, 1), compression="int1")


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2_moe"])
def test_planned_slots_are_the_engines(arch):
    """The planner sizes each block as the engine lays it out: fp32, or bf16-mixed with the embeddings
    and one-dimensional parameters in fp32 (where the engine aligns a run of one dtype, a little more)."""
    blocks = discover_blocks(AutoModelForCausalLM.from_config(tiny_config(arch)))
    shape = load_shape(tiny_config(arch))
    assert shape.block_bytes(4) == tuple(SlotLayout(blocks, torch.float32).block_bytes)
    mixed = SlotLayout(blocks, torch.bfloat16, mixed=True)
    for planned, laid_out, runs in zip(shape.block_bytes(2), mixed.block_bytes, mixed.runs, strict=True):
        assert planned <= laid_out < planned + RUN_ALIGN * len(runs)
    assert max(shape.block_bytes(2)) > 2 * shape.largest_block  # what stays fp32 sets it


def test_detect_reads_this_machine(tmp_path):
    machine = Machine.detect("cpu", offload_dir=tmp_path / "not" / "yet")
    assert machine.cpu and machine.vram_gb == 0  # the CPU computes in the RAM: no second memory
    assert machine.ram_gb > 0 and machine.disk_gb > 0
    with torch.device("meta"):
        tiny = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
    assert plan_for(tiny, machine).row("megatrain none").fits


def _table(text: str) -> dict[str, dict[str, str]]:
    """The rows of ``format_plan``'s table by method, each a dict by column header."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("method"))
    headers = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = dict(zip(headers, cells, strict=True))
    return rows


@pytest.mark.parametrize(
    ("model", "machine"),
    [
        ("7b", Machine(80, 512, 4000)),  # every block resident: the slots fill the GPU column
        ("7b", Machine(8, 16, 1000)),  # disk tier: the cache is the RAM used
        ("70b", Machine(80, 512, 4000)),
        ("1b", Machine(16, 32, 100)),
        ("70b", Machine(24, 64, 100)),  # nothing fits
    ],
)
def test_printed_columns_and_recommendation_agree(model, machine):
    plan = plan_for(model, machine)
    text = format_plan(plan)
    assert all(line in text for line in LEGEND)
    rows = _table(text)
    assert set(rows) == {r.method for r in plan.rows}
    for method, row in rows.items():
        gpu, host = float(row["GPU GB"]), float(row["host GB"])
        if row["fits"] == "yes":
            assert gpu <= machine.vram_gb and host <= machine.ram_gb, method
            assert float(row["disk GB"]) <= machine.disk_gb, method
        if row["slots"] != "-" and row["fits"] == "yes":
            settings = plan.row(method).settings
            assert int(row["slots"]) == settings.num_slots, method
            assert settings.slot_gb + plan.activations_gb == pytest.approx(gpu, abs=0.06), method
            staging = staging_bytes(plan.model.largest_block) / GB  # page-locked beside the cache
            # two printed figures, each rounded to 0.1 GB
            assert float(row["cache GB"]) + staging == pytest.approx(host, abs=0.1 + 1e-9), method
    best = recommend(plan)
    line = text.splitlines()[-1]
    if best is None:
        assert "does not fit" in line
        return
    row = rows[best.method]
    match = re.search(
        r"recommended: (megatrain \w+) .*?, (\d+) slots \(([\d.]+) GB; ([\d.]+) GB on the GPU", line
    )
    assert match is not None, line
    assert match[1] == best.method and row["fits"] == "yes"
    assert int(match[2]) == int(row["slots"])
    assert float(match[3]) <= float(row["GPU GB"]) and float(match[4]) == float(row["GPU GB"])
    assert best.settings.cache_gb <= best.host_gb


HYDRA_MODELS = Path(megatrain_lightning.__file__).parent / "configs" / "model"


def _plan_out(capsys, *args: str) -> str:
    main(["plan", *args])
    return capsys.readouterr().out


def test_hydra_model_names_plan_the_model_the_app_builds(capsys):
    """`megatrain-train model=llama_7b` and `megatrain plan --model llama_7b` name one model: every model
    config the package ships (but `hf`, which is given its directory) plans as what its `model` builds."""
    names = sorted(path.stem for path in HYDRA_MODELS.glob("*.yaml"))
    assert {"llama_7b", "tiny_llama", "tiny_moe", "hf"} <= set(names)
    built = {"llama_7b": load_shape("7b"), "tiny_llama": load_shape("tiny")}
    built["tiny_moe"] = load_shape(tiny_config("qwen2_moe"))
    built["tiny_gpt2"] = load_shape(tiny_config("gpt2"))
    for name, shape in built.items():
        assert load_shape(name) == shape, name
    for name in set(names) - {"hf"}:
        assert load_shape(name).num_params > 0, name
    machine = ["--vram", "80", "--ram", "512"]
    assert _plan_out(capsys, "--model", "llama_7b", *machine) == _plan_out(capsys, "--model", "7b", *machine)
    with pytest.raises(ValueError, match="model directory given as model.model=PATH: give that directory"):
        load_shape("hf")
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "llama_13b", *machine])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tiny, 170m, 1b, 3b, 7b, 70b" in err and ", ".join(names) in err


def test_largest_block_line_says_what_the_device_holds():
    """Under bf16 a 7B decoder layer (the largest block, 202 M) holds 0.40 GB on the device; the fp32
    embedding (131 M) holds more, 0.52 GB, and sets the largest slot: the line names both."""
    line = format_plan(plan_for("7b", Machine(80, 512))).splitlines()[0]
    assert f"largest 202.38 M ({LAYER_7B / GB:.1f} GB on the device in bf16)" in line
    assert f"largest on the device a block of 131.07 M in {EMBED_7B / GB:.2f} GB (bf16-mixed keeps" in line
    fp32 = format_plan(plan_for("7b", Machine(80, 512), workload=Workload(compute_dtype="fp32")))
    assert f"largest 202.38 M ({4 * LAYER / GB:.2f} GB on the device in fp32); activations" in fp32


def test_plan_offers_only_the_compute_dtypes_the_strategy_accepts(capsys):
    """The strategy's precisions compute in fp32 or bf16 and refuse fp16: so does the plan."""
    assert {MegaTrainPrecision(p).compute_dtype.itemsize for p in SUPPORTED} == set(DTYPE_BYTES.values())
    assert set(DTYPE_BYTES) == {"fp32", "bf16"}
    with pytest.raises(MisconfigurationException):
        MegaTrainPrecision("16-mixed")
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        plan_for("tiny", Machine(1, 1), workload=Workload(compute_dtype="fp16"))
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "7b", "--vram", "24", "--ram", "64", "--compute-dtype", "fp16"])
    assert exit_.value.code == 2 and "invalid choice: 'fp16'" in capsys.readouterr().err


def test_cpu_only_counts_activations_and_slots_in_ram():
    """No GPU: the store, the activations and any slots share the RAM. On the host tier blocks compute on
    the store's weights (no slots, no staging buffers); the disk tier keeps slots for the two largest
    blocks and gives the rest of the RAM to its cache. No link bounds a step; ZeRO-Offload needs a GPU."""
    plan = plan_for("7b", Machine(vram_gb=0, ram_gb=256, tflops=2, cpu=True))
    assert "ZeRO-Offload" not in {r.method for r in plan.rows}
    plain, none = plan.row("plain AdamW"), plan.row("megatrain none")
    assert plain.gpu_gb == 0 and plain.host_gb == pytest.approx((16 * N_7B + ACT_7B) / GB) and plain.fits
    assert none.fits and none.settings.tier == "host" and none.settings.slot_pools == ()
    assert none.gpu_gb == 0 and none.host_gb == pytest.approx(
        ((4 + 8 + 4) * N_7B + 2 * SHADOW_7B + ACT_7B) / GB
    )
    assert none.bound_by == "compute" and none.step_s == pytest.approx(6 * N_7B * TOKENS / 2e12)
    slow = plan_for("7b", Machine(vram_gb=0, ram_gb=256, update_gparams=0.2, cpu=True)).row("plain AdamW")
    assert slow.bound_by == "update" and slow.step_s == pytest.approx(N_7B / 0.2e9)  # AdamW on the CPU too
    disk = plan_for("7b", Machine(vram_gb=0, ram_gb=64, disk_gb=1000, cpu=True), "int8")
    s, row = disk.settings, disk.row("megatrain int8")
    assert row.fits and s.tier == "disk" and s.slot_pools == ((EMBED_7B, 1), (LAYER_7B, 1))
    usable = 64 * (1 - RESERVE)
    assert s.cache_gb == pytest.approx(usable - (ACT_7B + EMBED_7B + LAYER_7B) / GB)
    assert row.gpu_gb == 0 and row.host_gb == pytest.approx(usable)
    # 48 GB of RAM: the host tier's 124 GB do not fit, nor does the disk tier without a disk.
    short = plan_for("7b", Machine(vram_gb=0, ram_gb=48, cpu=True)).row("megatrain int2")
    assert [what for what, _, _ in shortfalls(short, Machine(0, 48, cpu=True))] == ["disk"]


def test_plan_device_cpu_prints_one_memory(capsys):
    default = _plan_out(capsys, "--model", "7b", "--device", "cpu", "--ram", "256").splitlines()
    assert "on the device in fp32" in default[0] and ", 1 TFLOP/s," in default[1]  # a CPU's defaults
    out = _plan_out(
        capsys, "--model", "7b", "--device", "cpu", "--ram", "256", "--tflops", "2", "--compute-dtype", "bf16"
    )
    lines = out.splitlines()
    assert lines[1].startswith("machine: CPU only: 256 GB RAM (the device's memory too), 0 GB disk; no link")
    rows = _table(out)
    assert "GPU GB" not in rows["megatrain none"] and "ZeRO-Offload" not in rows
    assert float(rows["megatrain none"]["host GB"]) == pytest.approx(124.1, abs=0.05)
    assert lines[-1].startswith("recommended: megatrain none with the store in host RAM, no slots")
    with pytest.raises(SystemExit) as exit_:  # --vram missing on a machine without a GPU: test_cli
        main(["plan", "--model", "7b", "--ram", "64", "--device", "cpu", "--vram", "8"])
    message = "argument --vram: a CPU-only run (--device cpu) has no GPU"
    assert exit_.value.code == 2 and message in capsys.readouterr().err
