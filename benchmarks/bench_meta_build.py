"""Building a model in ``configure_model`` under megatrain (on meta, its initialization recorded) against a
plain build on the CPU, side by side: seconds per build and their ratio.

    python benchmarks/bench_meta_build.py                     # a 1.1B Llama, three alternations
    python benchmarks/bench_meta_build.py --layers 4 --rounds 1

A plain build draws every weight's random numbers; the recorded one draws them too (on a scratch tensor,
so that later draws are a plain build's) and keeps none: the ratio says what the recording adds.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from megatrain_lightning.serialization.initialization import InitRecorder
from megatrain_lightning.serialization.meta import init_on_meta


def plain_build(config: LlamaConfig) -> None:
    AutoModelForCausalLM.from_config(config)


def recorded_build(config: LlamaConfig) -> None:
    with init_on_meta(), InitRecorder() as recorder:
        model = AutoModelForCausalLM.from_config(config)
    recorder.install(model)


def seconds(build: object, config: LlamaConfig) -> float:
    gc.collect()
    torch.manual_seed(0)
    start = time.perf_counter()
    build(config)  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two builds")
    args = parser.parse_args()
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=4,
    )
    times: dict[str, list[float]] = {"plain": [], "recorded on meta": []}
    for _ in range(args.rounds):
        times["plain"].append(seconds(plain_build, config))
        times["recorded on meta"].append(seconds(recorded_build, config))
    for name, values in times.items():
        print(f"{name:>17}: " + ", ".join(f"{v:.2f}" for v in values) + " s")
    ratio = statistics.median(times["recorded on meta"]) / statistics.median(times["plain"])
    print(f"recorded / plain (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
