"""Which low-bit Adam state format tracks fp32 Adam best: measured on real gradients, not guessed.

Run: ``python benchmarks/codec_candidates.py [--steps 300 --lr 3e-3]``; with ``--shipped [--beta2 B]``
the shipped formats of ``codecs.py`` (both moments quantized), rounding to nearest or stochastically;
``--steady`` and ``--stopped``: their fused step on a gradient small beside its block's largest, and on one
that stops (the bias of rounding to nearest).

1. *State error on real gradient statistics.* A small byte-level Llama trains on the Python standard
   library's sources (``realtext.py``) with fp32 AdamW. For a few weight matrices of its decoder layers,
   every candidate format replays the same gradient stream (teacher forced: decode the stored state,
   update it in fp32 with this step's gradient, re-encode), beside the exact fp32 moments. Reported: the
   RMS relative error ``||x_q - x|| / ||x||`` of m, of v and of the resulting Adam update
   ``m_hat / (sqrt(v_hat) + eps)`` with the other moment exact (and, for m, the update's gain), averaged
   over steps (after the first 10) and tensors.
2. *Final loss.* The most promising combinations train the model themselves (their quantized state fed
   back), and their held-out validation loss is compared with fp32 state's. Step 1 ranks, step 2 decides:
   a 4-bit m map with 11-14% less update error than the shipped one trained worse (RESULTS.md).

The candidates here are plain whole-tensor torch (research code); the chosen formats live in
``megatrain_lightning/optim/codecs.py`` and the fused kernel.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from realtext import batches, stdlib_tokens
from torch import Tensor
from transformers import AutoModelForCausalLM

from megatrain_lightning.optim import codecs
from megatrain_lightning.presets import tiny_config

M4_DE = list(codecs.M_SORTED[4])  # Li et al.'s dynamic-exponent map: int4's and int3's m
M3_DE = [-0.75, -0.3, -0.06, 0.0, 0.06, 0.3, 0.65, 1.0]
M3_LIN = [-0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0]
M2 = [-0.5, 0.0, 0.5, 1.0]


def m4_power(p: float, negative: str = "same") -> list[float]:
    """16 values up to +1 (a block's element of largest magnitude), finer near zero for p > 1: 0 and
    (k/8)^p (k = 1..8), and seven negatives: ``same`` -(k/8)^p (k = 1..7; down to -(7/8)^p), ``stretched``
    -(k/7)^p (k = 1..7; down to -1), ``ended`` -(k/8)^p (k = 1..6) and -1."""
    negatives = {
        "same": [(k / 8) ** p for k in range(1, 8)],
        "stretched": [(k / 7) ** p for k in range(1, 8)],
        "ended": [(k / 8) ** p for k in range(1, 7)] + [1.0],
    }[negative]
    return [-x for x in reversed(negatives)] + [(k / 8) ** p for k in range(9)]


def m4_normal(top: float = 0.9677) -> list[float]:
    """16 values at equal-probability quantiles of a normal distribution (QLoRA's NF4 construction:
    7 negative, zero, 8 positive), scaled to a largest of 1."""
    ndtri = torch.special.ndtri
    pos, neg = ndtri(torch.linspace(0.5, top, 9))[1:], ndtri(torch.linspace(0.5, top, 8))[1:]
    return (torch.cat([-neg.flip(0), torch.zeros(1), pos]) / pos.max()).tolist()


# -- stochastic rounding helpers --


class Noise:
    """Uniform [0, 1) numbers, seeded per (tensor, step): reproducible."""

    def __init__(self, tensor_id: int) -> None:
        self.tensor_id, self.step = tensor_id, 0

    def __call__(self, shape: torch.Size) -> Tensor:
        g = torch.Generator().manual_seed(self.tensor_id * 100_003 + self.step)
        return torch.rand(shape, generator=g)


def _round_table(y: Tensor, table: Tensor, u: Tensor | None) -> Tensor:
    """Nearest table value (or stochastic between the two neighbours when ``u`` is given)."""
    if u is None:
        mids = (table[1:] + table[:-1]) / 2
        return table[torch.bucketize(y, mids)]
    lo = (torch.bucketize(y, table, right=True) - 1).clamp(0, table.numel() - 2)
    a, b = table[lo], table[lo + 1]
    frac = ((y - a) / (b - a)).clamp(0, 1)
    return torch.where(u < frac, b, a)


def _blocks(x: Tensor, size: int) -> tuple[Tensor, int]:
    flat = x.reshape(-1)
    pad = -flat.numel() % size
    return torch.cat([flat, flat.new_zeros(pad)]).view(-1, size), flat.numel()


# -- candidate codecs: x -> decode(encode(x)) --


def m_table(table: list[float], block: int, sr: bool = False) -> Callable:
    t = torch.tensor(table)

    def codec(x: Tensor, noise: Noise) -> Tensor:
        b, n = _blocks(x, block)
        amax = b.abs().amax(1)
        pos = b.clamp(min=0).amax(1)
        signed = torch.where(pos >= amax, amax, -amax)
        scale = torch.where(signed == 0, torch.ones_like(signed), signed)[:, None]
        y = b / scale
        out = _round_table(y, t, noise(y.shape) if sr else None) * scale
        return out.reshape(-1)[:n].view_as(x)

    return codec


def m_e4m3(block: int = 256) -> Callable:
    def codec(x: Tensor, noise: Noise) -> Tensor:
        return codecs.dequantize(*codecs.quantize(x, "m", 8), "m", 8, x.numel()).view_as(x)

    return codec


def v_linear(bits: int, block: int, sr: bool = False, power: float = 1.0) -> Callable:
    """Linear map without zero, code c -> (c + 1) / 2^bits of the block max, applied to v^power."""
    levels = 1 << bits

    def codec(x: Tensor, noise: Noise) -> Tensor:
        b, n = _blocks(x.clamp(min=0) ** power, block)
        amax = b.amax(1, keepdim=True).clamp(min=2.0**-100)
        q = b / amax * levels
        c = torch.floor(q + noise(q.shape)) if sr else torch.round(q)
        out = (c.clamp(1, levels) / levels * amax) ** (1 / power)
        return out.reshape(-1)[:n].view_as(x)

    return codec


def v_rank1(bits: int, sr: bool = False, power: float = 1.0) -> Callable:
    """Li et al. 2023: scale of (i, j) = min(row max i, column max j), linear map without zero."""
    levels = 1 << bits
    fallback = v_linear(bits, 128, sr, power)

    def codec(x: Tensor, noise: Noise) -> Tensor:
        if x.dim() != 2:
            return fallback(x, noise)
        y = x.clamp(min=0) ** power
        scale = torch.minimum(y.amax(1, keepdim=True), y.amax(0, keepdim=True)).clamp(min=2.0**-100)
        q = y / scale * levels
        c = torch.floor(q + noise(q.shape)) if sr else torch.round(q)
        return (c.clamp(1, levels) / levels * scale) ** (1 / power)

    return codec


def v_log(bits: int, block: int, octaves_per_code: float, sr: bool = False) -> Callable:
    """Dynamic exponent without zero: code c -> block max * 2^(-c * octaves_per_code)."""
    levels = 1 << bits

    def codec(x: Tensor, noise: Noise) -> Tensor:
        b, n = _blocks(x.clamp(min=0), block)
        amax = b.amax(1, keepdim=True).clamp(min=2.0**-100)
        k = -torch.log2((b / amax).clamp(min=2.0**-126)) / octaves_per_code
        c = torch.floor(k + noise(k.shape)) if sr else torch.round(k)
        out = amax * torch.exp2(-c.clamp(0, levels - 1) * octaves_per_code)
        return out.reshape(-1)[:n].view_as(x)

    return codec


FACTORED = "factored"  # Adafactor's rows x columns second moment (not a codec: its own state)


M_CANDIDATES: dict[str, Callable | None] = {
    "fp32": None,
    "int8 E4M3 b256 (today)": m_e4m3(),
    "4b DE b128": m_table(M4_DE, 128),
    "4b DE b64": m_table(M4_DE, 64),
    "4b DE b32": m_table(M4_DE, 32),
    "4b DE b128 SR": m_table(M4_DE, 128, sr=True),
    "4b DE b64 SR (today)": m_table(M4_DE, 64, sr=True),
    **{
        f"4b pow{p} stretched b64{sr}": m_table(m4_power(p, "stretched"), 64, sr=bool(sr))
        for p in (1.0, 1.5, 2.0, 2.5, 3.0)
        for sr in ("", " SR")
    },
    **{
        f"4b pow{p} {negative} b64 SR": m_table(m4_power(p, negative), 64, sr=True)
        for p in (1.5, 1.75, 2.0, 2.5)
        for negative in ("same", "stretched", "ended")
    },
    "4b normal b64": m_table(m4_normal(), 64),
    "4b normal b64 SR": m_table(m4_normal(), 64, sr=True),
    "3b DE b64": m_table(M3_DE, 64),
    "3b DE b32": m_table(M3_DE, 32),
    "3b DE b64 SR": m_table(M3_DE, 64, sr=True),
    "3b DE b32 SR": m_table(M3_DE, 32, sr=True),
    "3b lin b64 SR": m_table(M3_LIN, 64, sr=True),
    "2b b32 SR": m_table(M2, 32, sr=True),
    "2b b32": m_table(M2, 32),
}
V_CANDIDATES: dict[str, Callable | str | None] = {
    "fp32": None,
    "int8 lin b128 (today)": v_linear(8, 128),
    "4b lin b128 (today)": v_linear(4, 128),
    "4b lin b128 SR": v_linear(4, 128, sr=True),
    "4b lin b32": v_linear(4, 32),
    "4b rank-1 lin (Li)": v_rank1(4),
    "4b rank-1 lin SR": v_rank1(4, sr=True),
    "4b sqrt-lin b128": v_linear(4, 128, power=0.5),
    "4b sqrt-lin b128 SR": v_linear(4, 128, sr=True, power=0.5),
    "4b rank-1 sqrt-lin": v_rank1(4, power=0.5),
    "4b rank-1 sqrt-lin SR": v_rank1(4, sr=True, power=0.5),
    "4b log 0.5oct b128": v_log(4, 128, 0.5),
    "4b log 0.5oct b128 SR": v_log(4, 128, 0.5, sr=True),
    "4b log 0.33oct b128": v_log(4, 128, 1 / 3),
    "4b log 0.75oct b128": v_log(4, 128, 0.75),
    "4b log 0.5oct b32": v_log(4, 32, 0.5),
    "3b log 1oct b128": v_log(3, 128, 1.0),
    "3b log 0.75oct b64": v_log(3, 64, 0.75),
    "2b log 2oct b64": v_log(2, 64, 2.0),
    "3b sqrt-lin b128 SR": v_linear(3, 128, sr=True, power=0.5),
    "3b rank-1 sqrt-lin SR": v_rank1(3, sr=True, power=0.5),
    "3b log 1oct b128 SR": v_log(3, 128, 1.0, sr=True),
    "2b rank-1 sqrt-lin SR": v_rank1(2, sr=True, power=0.5),
    "factored (Adafactor)": FACTORED,
    "8b sqrt-lin b128": v_linear(8, 128, power=0.5),
    "8b log 1/16oct b128": v_log(8, 128, 1 / 16),
    "8b log 1/16oct b128 SR": v_log(8, 128, 1 / 16, sr=True),
}


# -- Adam with a candidate state format, one tensor --


@dataclass
class Hyper:
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


class QAdamState:
    """m and v of one tensor, stored through the candidate codecs (``None``: fp32)."""

    def __init__(self, shape: torch.Size, m_codec, v_codec, tensor_id: int) -> None:
        self.m = torch.zeros(shape)
        self.m_codec, self.v_codec = m_codec, v_codec
        self.factored = v_codec == FACTORED and len(shape) == 2
        if self.factored:
            self.rows, self.cols = torch.zeros(shape[0]), torch.zeros(shape[1])
        else:
            self.v = torch.zeros(shape)
        self.noise = Noise(tensor_id)
        self.step = 0

    def moments(self, grad: Tensor, h: Hyper) -> tuple[Tensor, Tensor]:
        """This step's (m, v) as used by the update; the stored state becomes their encodings."""
        self.step += 1
        self.noise.step = self.step
        m = self.m * h.beta1 + grad * (1 - h.beta1)
        g2 = grad * grad
        if self.factored:
            self.rows = self.rows * h.beta2 + g2.mean(1) * (1 - h.beta2)
            self.cols = self.cols * h.beta2 + g2.mean(0) * (1 - h.beta2)
            v = self.rows[:, None] * self.cols[None, :] / self.rows.mean().clamp(min=1e-30)
        else:
            v = self.v * h.beta2 + g2 * (1 - h.beta2)
            codec = self.v_codec if self.v_codec != FACTORED else v_linear(4, 128)
            self.v = codec(v, self.noise) if codec is not None else v
        self.m = self.m_codec(m, self.noise) if self.m_codec is not None else m
        return m, v

    def update(self, grad: Tensor, h: Hyper) -> Tensor:
        m, v = self.moments(grad, h)
        self.last_m, self.last_v = m, v
        bc1, bc2 = 1 - h.beta1**self.step, 1 - h.beta2**self.step
        return (m / bc1) / ((v / bc2).sqrt() + h.eps)


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _gain(a: Tensor, b: Tensor) -> float:
    """How much of the exact ``b`` the approximation ``a`` carries: the least-squares factor
    ``<a, b> / <b, b>`` (below 1: the quantized update is damped, like a lower learning rate)."""
    return float((a * b).sum() / (b * b).sum().clamp(min=1e-30))


# -- model and data --


def make_model(hidden: int, layers: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(
        "llama",
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875) // 16 * 16,
        num_hidden_layers=layers,
        num_attention_heads=max(4, hidden // 64),
        num_key_value_heads=max(4, hidden // 64),
    )
    return AutoModelForCausalLM.from_config(config)


def lm_loss(model: torch.nn.Module, tokens: Tensor) -> Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def lr_at(step: int, lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def tracked(model: torch.nn.Module) -> dict[str, Tensor]:
    """A few weight matrices of the decoder layers (attention and MLP, early and late)."""
    names = [n for n, _ in model.named_parameters()]
    want = ("layers.0.self_attn.q_proj", "layers.0.mlp.down_proj", "layers.1.self_attn.v_proj",
            "layers.1.mlp.up_proj", "layers.2.self_attn.o_proj", "layers.3.mlp.gate_proj")  # fmt: skip
    params = dict(model.named_parameters())
    return {n: params[n] for n in names if any(w in n for w in want) and n.endswith("weight")}


def state_errors(args) -> None:
    train, _ = stdlib_tokens()
    model = make_model(args.hidden, args.layers, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, args.beta2), weight_decay=0.0)
    watch = tracked(model)
    h = Hyper(beta2=args.beta2)
    m_sims = {(name, c): QAdamState(p.shape, codec, None, i) for i, (name, p) in enumerate(watch.items())
              for c, codec in M_CANDIDATES.items()}  # fmt: skip
    v_sims = {(name, c): QAdamState(p.shape, None, codec, i) for i, (name, p) in enumerate(watch.items())
              for c, codec in V_CANDIDATES.items()}  # fmt: skip
    err = {k: [] for k in [(x, c) for c in M_CANDIDATES for x in ("m", "mu", "mg")]
           + [(x, c) for c in V_CANDIDATES for x in "vu"]}  # fmt: skip
    data = batches(train, args.batch, args.seq, seed=0)
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup, args.steps)
        loss = lm_loss(model, next(data))
        opt.zero_grad()
        loss.backward()
        for name, p in watch.items():
            g = p.grad
            fp32_m = m_sims[(name, "fp32")]
            fp32_m.update(g, h)
            fp32 = v_sims[(name, "fp32")]
            exact_u, exact_v = fp32.update(g, h), fp32.last_v
            for c in M_CANDIDATES:
                if c != "fp32":
                    sim = m_sims[(name, c)]
                    u = sim.update(g, h)  # exact v
                    if step >= 10:
                        err[("m", c)].append(_rel(sim.last_m, fp32_m.last_m))
                        err[("mu", c)].append(_rel(u, exact_u))
                        err[("mg", c)].append(_gain(u, exact_u))
            for c in V_CANDIDATES:
                if c == "fp32":
                    continue
                sim = v_sims[(name, c)]
                u = sim.update(g, h)
                if step >= 10:
                    err[("u", c)].append(_rel(u, exact_u))
                    err[("v", c)].append(_rel(sim.last_v, exact_v))
        opt.step()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"\nRMS relative error, mean over steps {10}..{args.steps} and {len(watch)} tensors "
          f"(lr {args.lr}, beta2 {args.beta2}, hidden {args.hidden}, {args.layers} layers):")  # fmt: skip
    mean = {key: sum(values) / len(values) for key, values in err.items() if values}
    print("| m format | m error | update error (fp32 v) | gain |\n| --- | ---: | ---: | ---: |")
    for c in M_CANDIDATES:
        if c != "fp32":
            print(f"| {c} | {mean[('m', c)]:.4f} | {mean[('mu', c)]:.4f} | {mean[('mg', c)]:.4f} |")
    print("\n| v format | v error | update error (fp32 m) |\n| --- | ---: | ---: |")
    for c in V_CANDIDATES:
        if c != "fp32":
            print(f"| {c} | {mean[('v', c)]:.4f} | {mean[('u', c)]:.4f} |")


# -- the shipped formats (codecs.py), nearest against stochastic rounding, both moments quantized --


def shipped(bits: int, stochastic: tuple[str, ...]) -> Callable:
    """Both moments through ``codecs.quantize`` (stochastic rounding for the moments in ``stochastic``,
    keyed as the optimizer keys them: by tensor and step)."""
    from megatrain_lightning.optim import rounding

    def codec(kind: str, x: Tensor, tensor_id: int, step: int) -> Tensor:
        keys = dict(zip("mv", rounding.rounding_keys(tensor_id, step), strict=True))
        key = keys[kind] if kind in stochastic else None
        return codecs.dequantize(*codecs.quantize(x, kind, bits, key), kind, bits, x.numel()).view_as(x)

    return codec


SHIPPED_ROUNDINGS = [
    (f"{name} {label}", bits, sr)
    for name, bits in (("int8", 8), ("int4", 4), ("int3", 3), ("int2", 2))
    for label, sr in (("nearest", ()), ("SR v", ("v",)), ("SR m", ("m",)), ("SR m+v", ("m", "v")))
]
SHIPPED = {name: shipped(bits, sr) for name, bits, sr in SHIPPED_ROUNDINGS}
SHIPPED_COLUMNS = ("m", "v", "u", "gain", "gain m", "gain v")  # errors of m, v, the update; its gains


def shipped_errors(args) -> None:
    """RMS relative error of m, v and the update with both moments stored in each shipped format."""
    train, _ = stdlib_tokens()
    model = make_model(args.hidden, args.layers, seed=0)
    betas = (0.9, args.beta2)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=betas, weight_decay=0.0)
    watch = tracked(model)
    state = {(n, c): [torch.zeros_like(p), torch.zeros_like(p)] for n, p in watch.items() for c in SHIPPED}
    exact = {n: [torch.zeros_like(p), torch.zeros_like(p)] for n, p in watch.items()}
    err = {(x, c): [] for c in SHIPPED for x in SHIPPED_COLUMNS}
    data = batches(train, args.batch, args.seq, seed=0)
    start = time.perf_counter()

    def update(m: Tensor, v: Tensor, step: int) -> Tensor:
        return (m / (1 - betas[0] ** step)) / ((v / (1 - betas[1] ** step)).sqrt() + 1e-8)

    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, args.lr, args.warmup, args.steps)
        loss = lm_loss(model, next(data))
        opt.zero_grad()
        loss.backward()
        for tensor_id, (name, p) in enumerate(watch.items()):
            g = p.grad
            em, ev = exact[name]
            em.mul_(betas[0]).add_(g, alpha=1 - betas[0])
            ev.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            exact_u = update(em, ev, step)
            for c, codec in SHIPPED.items():
                sm, sv = state[(name, c)]
                m = sm * betas[0] + g * (1 - betas[0])
                v = sv * betas[1] + g * g * (1 - betas[1])
                if step > 10:
                    err[("m", c)].append(_rel(m, em))
                    err[("v", c)].append(_rel(v, ev))
                    err[("u", c)].append(_rel(update(m, v, step), exact_u))
                    err[("gain", c)].append(_gain(update(m, v, step), exact_u))
                    err[("gain m", c)].append(_gain(update(m, ev, step), exact_u))
                    err[("gain v", c)].append(_gain(update(em, v, step), exact_u))
                state[(name, c)] = [codec("m", m, tensor_id, step), codec("v", v, tensor_id, step)]
        opt.step()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"\nShipped formats, both moments quantized: RMS relative error, mean over steps 11..{args.steps} "
          f"and {len(watch)} tensors (lr {args.lr}, betas {betas}, hidden {args.hidden}, "
          f"{args.layers} layers):")  # fmt: skip
    print(
        "(gain: the update's least-squares factor on the exact one, <u_q, u> / <u, u>; with m or v alone"
        " quantized, the other exact)"
    )
    print("| format, rounding | m error | v error | update error | gain | gain, m alone | gain, v alone |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in SHIPPED:
        mean = [sum(err[(x, c)]) / len(err[(x, c)]) for x in SHIPPED_COLUMNS]
        print(f"| {c} | " + " | ".join(f"{x:.4f}" for x in mean) + " |")


# -- a gradient small beside its block's largest, through the fused step (the optimizer's own code) --


def _print_rows(keys: tuple[str, str], chosen: list, rows: list[tuple]) -> None:
    """A markdown table: two key columns, then one column of ratios per chosen rounding."""
    print(f"| {keys[0]} | {keys[1]} | " + " | ".join(name for name, _, _ in chosen) + " |")
    print("| ---: | ---: |" + " ---: |" * len(chosen))
    for a, b, cells in rows:
        print(f"| {a:g} | {b:g} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


def steady_travel(args) -> None:
    """How far the weights whose gradient is ``r`` times their block's largest travel in 100 fused steps,
    as a multiple of fp32 AdamW's distance (every 64th gradient 1, the rest ``r``, times
    ``1 + noise * N(0, 1)``): below 1 the format damps them, above 1 it oversteps."""
    from megatrain_lightning.optim import quantized

    n, steps, hp = 1024, 100, dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    chosen = [row for row in SHIPPED_ROUNDINGS if row[0] in SHIPPED]  # as --only leaves them
    rows = []
    for r, noise in itertools.product((0.5, 0.25, 0.1), (0.0, 1.0)):
        base = torch.full((n,), r)
        base[::64] = 1.0
        small = base != 1.0
        grads = [
            base * (1 + noise * torch.randn(n, generator=torch.Generator().manual_seed(s)))
            for s in range(steps)
        ]
        ref = torch.zeros(n, requires_grad=True)
        opt = torch.optim.AdamW(
            [ref],
            lr=hp["lr"],
            betas=(hp["beta1"], hp["beta2"]),
            eps=hp["eps"],
            weight_decay=hp["weight_decay"],
        )
        for g in grads:
            ref.grad = g
            opt.step()
        travelled = ref.detach()[small].mean()
        cells = []
        for _, bits, sr in chosen:
            p, state = torch.zeros(n), codecs.empty_state(n, bits)
            for step, g in enumerate(grads, start=1):
                quantized.quantized_adamw_(p, g, *state, bits=bits, step=step, stochastic=sr, **hp)
            cells.append(float(p[small].mean() / travelled))
        rows.append((r, noise, cells))
    print(
        f"Distance travelled in {steps} fused steps by the weights whose gradient is r x their block's "
        "largest, as a multiple of fp32 AdamW's:"
    )
    _print_rows(("r", "noise"), chosen, rows)


def stopped_decay(args) -> None:
    """The decoded v of weights whose gradient stops, as a multiple of fp32 AdamW's (geometric mean),
    10-40 fused steps after the stop: every 64th gradient 1 throughout, the rest 1/2 for 30 steps and
    then 0. Above 1 the format holds v on its code (and damps the update when the gradient returns)."""
    from megatrain_lightning.optim import quantized

    n, warm, after = 4096, 30, (10, 20, 30, 40)
    chosen = [row for row in SHIPPED_ROUNDINGS if row[0] in SHIPPED]  # as --only leaves them
    rows = []
    for beta2 in (0.95, 0.999):
        hp = dict(lr=1e-3, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.0)
        grads = []
        for step in range(warm + max(after)):
            g = torch.full((n,), 0.5 if step < warm else 0.0)
            g[::64] = 1.0
            grads.append(g)
        stopped = grads[-1] == 0
        exact, exact_log = torch.zeros(n), {}
        for step, g in enumerate(grads, start=1):
            exact.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if step - warm in after:
                exact_log[step - warm] = exact[stopped].log()
        cells = {k: [] for k in after}
        for _, bits, sr in chosen:
            p, state = torch.zeros(n), codecs.empty_state(n, bits)
            for step, g in enumerate(grads, start=1):
                quantized.quantized_adamw_(p, g, *state, bits=bits, step=step, stochastic=sr, **hp)
                if step - warm in after:
                    v = codecs.dequantize(*state[2:], "v", bits, n)[stopped].log()
                    cells[step - warm].append(float((v - exact_log[step - warm]).mean().exp()))
        rows += [(beta2, k, cells[k]) for k in after]
    print("Decoded v of the weights whose gradient stopped, as a multiple of fp32 AdamW's (geometric mean):")
    _print_rows(("beta2", "steps since"), chosen, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=129)
    parser.add_argument("--beta2", type=float, default=0.999)
    parser.add_argument(
        "--shipped", action="store_true", help="the shipped formats, nearest vs stochastic rounding"
    )
    parser.add_argument(
        "--steady", action="store_true", help="the fused step on gradients small beside their block's largest"
    )
    parser.add_argument(
        "--stopped", action="store_true", help="the fused step's v once a gradient stops, against fp32's"
    )
    parser.add_argument(
        "--only", nargs="+", metavar="TEXT", help="only the candidates whose names contain one of these"
    )
    args = parser.parse_args()
    if args.only:
        for candidates in (M_CANDIDATES, V_CANDIDATES, SHIPPED):
            for name in [c for c in candidates if c != "fp32" and not any(t in c for t in args.only)]:
                del candidates[name]
    torch.set_num_threads(1)
    if args.steady:
        steady_travel(args)
    elif args.stopped:
        stopped_decay(args)
    else:
        (shipped_errors if args.shipped else state_errors)(args)


if __name__ == "__main__":
    main()
