"""``benchmarks/convergence.py``'s optimizer is the evidence for compressed state, so its fp32 reference
must be torch's AdamW, and its compressed tensors must step as that reference does: the same step count
(the bias correction) on both paths."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import convergence  # noqa: E402


def _model_and_twin() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two copies of one byte-level Llama (its 64 x 64 projections get compressed state)."""
    model, twin = (convergence.make_model(hidden=64, layers=1, seed=0) for _ in range(2))
    return model, twin


def _step_both(model, twin, ours, theirs, steps: int, lr: float = 1e-2) -> None:
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 9))
        for m in (model, twin):
            m.zero_grad()
            convergence.lm_loss(m, tokens).backward()
        ours.step(lr)
        theirs.step()


def _torch_adamw(model: torch.nn.Module, lr: float = 1e-2) -> torch.optim.AdamW:
    params = list(model.parameters())
    groups = [
        dict(params=[p for p in params if p.dim() >= 2], weight_decay=convergence.WEIGHT_DECAY),
        dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0),
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=convergence.BETAS, eps=convergence.EPS, fused=True)


def test_fp32_state_is_torch_adamw_bitwise():
    model, twin = _model_and_twin()
    _step_both(model, twin, convergence.StateAdamW(model, None, None), _torch_adamw(twin), steps=5)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("mode", ["int8", "int4", "int8:m-only", "int4:v-only"])
def test_compressed_tensors_take_adamws_first_step(mode):
    """From zero state the first update uses the exact new moments (the codes only store them), so every
    tensor, compressed or not, moves as AdamW moves it: a step count off by one scales it by 0.74."""
    model, twin = _model_and_twin()
    compression, stochastic, only, _ = convergence.parse_mode(mode)
    ours = convergence.StateAdamW(model, convergence.COMPRESSIONS[compression], stochastic, only=only)
    assert ours.round_trip if only else any(len(state) == 4 for state in ours.state.values())
    _step_both(model, twin, ours, _torch_adamw(twin), steps=1)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_another_rounding_stream_changes_only_the_draws():
    """``int4/r1`` rounds with other random numbers: the same first step (no rounding has acted yet), then
    another trajectory; ``int4/r0`` is ``int4``."""
    assert convergence.parse_mode("int4:sr-v/r2") == ("int4", ("v",), None, 2)
    assert convergence.parse_mode("int4/r0") == convergence.parse_mode("int4")
    for bad in ("none/r1", "int4/rx", "int4/"):
        with pytest.raises(SystemExit, match="mode"):
            convergence.parse_mode(bad)
    runs = {}
    for stream in (0, 1):
        model, twin = _model_and_twin()
        ours = convergence.StateAdamW(model, 4, None, rounding_seed=stream)
        torch.manual_seed(0)
        _step_both(model, twin, ours, _torch_adamw(twin), steps=1)
        first = [p.detach().clone() for p in model.parameters()]
        _step_both(model, twin, ours, _torch_adamw(twin), steps=1)
        runs[stream] = first, [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def test_a_later_files_run_replaces_an_earlier_one_in_the_report():
    """``--report a.json b.json``: a rerun in b of a's (mode, lr, seed) is the one the table and the plot
    read, once (the plot's legend counted both before)."""

    def run(mode: str, seed: int, final: float) -> dict:
        return dict(mode=mode, lr=1e-3, seed=seed, final=final, curve=[[1, final]])

    first = [run("none", 0, 1.0), run("int8", 0, 1.5), run("int8", 1, 1.2)]
    merged = convergence.merge_results([first, [run("int8", 0, 1.01)]])
    assert sorted((r["mode"], r["seed"], r["final"]) for r in merged) == [
        ("int8", 0, 1.01),
        ("int8", 1, 1.2),
        ("none", 0, 1.0),
    ]
    table = convergence.report(merged, ["none", "int8"])
    assert "+1.00%" in table[-1] and "+50.00%" not in table[-1]


def test_the_report_pairs_each_run_with_fp32_state_on_its_own_machine():
    """fp32 rounds differently on another CPU, so a run is compared with fp32 state's run of its own
    machine, in a row of its own, and a later file's run of another machine does not replace it."""

    def run(mode: str, final: float, machine: str) -> dict:
        windows = [final] * 4
        return dict(mode=mode, lr=1e-3, seed=0, final=final, held_out=final, windows=windows, machine=machine)

    xeon = [run("none", 1.0, "Xeon"), run("int8", 1.01, "Xeon")]
    epyc = [run("none", 1.1, "EPYC"), run("int8", 1.1, "EPYC")]
    merged = convergence.merge_results([xeon, epyc])
    assert len(merged) == 4
    table = convergence.report(merged, ["none", "int8"])
    rows = {row.split(" | ")[0]: row for row in table[2:]}
    assert rows.keys() == {"| 0.001 (A)", "| 0.001 (B)"}  # A: EPYC, B: Xeon
    assert "+0.00%" in rows["| 0.001 (A)"] and "+1.00%" in rows["| 0.001 (B)"]
    held_out = convergence.held_out_report(merged, ["none", "int8"], curve_windows=4)
    assert [row.split(" | ")[:2] for row in held_out[2:]] == [["| 0.001 (A)", "0"], ["| 0.001 (B)", "0"]]
    assert "+1.00%" in held_out[-1] and "+0.00%" in held_out[-2]


def test_report_keeps_only_the_modes_asked_for(tmp_path, monkeypatch, capsys):
    """``--report a.json --modes none int3``: a file's runs of other modes (say of a format changed since)
    are left out of the table and the plot."""

    def run(mode: str, final: float) -> dict:
        return dict(mode=mode, lr=1e-3, seed=0, final=final, curve=[[1, 2.0], [2, final]], machine="EPYC")

    results = [run("none", 1.0), run("int8", 1.5), run("int3", 1.01)]
    data = tmp_path / "grid.json"
    data.write_text(json.dumps(dict(header="proxy", args=dict(val_batches=1), results=results)))
    plot = tmp_path / "grid.png"
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--report", str(data), "--modes", "none", "int3"])
    convergence.main()
    table = capsys.readouterr().out
    assert "int3 change" in table and "+1.00%" in table
    assert "int8" not in table and "+50.00%" not in table
    assert plot.stat().st_size > 0
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--report", str(data), "--modes", "int4"])
    with pytest.raises(SystemExit, match="--modes int4: no such runs"):
        convergence.main()
