"""Block-wise absmax codecs of the compressed Adam moments: error bounds, adversarial inputs, layout."""

from __future__ import annotations

import pytest
import torch

from megatrain_lightning.optim import codecs as C
from megatrain_lightning.optim import packing, rounding

KINDS = [(kind, bits) for bits in C.FORMATS for kind in "mv"]
FLT_MAX = torch.finfo(torch.float32).max
SUBNORMAL_MIN = 2.0**-149


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _for_kind(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Second moments are squares (v >= 0); keep the sign structure for m."""
    return x * x if kind == "v" else x


def _random(n: int = 25_000) -> dict[str, torch.Tensor]:
    g = _gen(1)
    normal = torch.randn(n, generator=g)
    student = normal / torch.sqrt(torch.distributions.Chi2(torch.tensor(2.0)).sample((n,)) / 2)  # t, 2 dof
    cauchy = torch.empty(n).cauchy_(generator=g).clamp_(-1e4, 1e4)
    # blocks whose magnitudes differ by up to 20 orders
    scales = 10.0 ** torch.randint(-10, 10, (n // 128 + 1,), generator=g).float().repeat_interleave(128)[:n]
    return {
        "normal": normal,
        "student_t2": student,
        "cauchy_clipped": cauchy,
        "per_block_scales": torch.randn(n, generator=g) * scales,
        "small": torch.randn(n, generator=g) * 1e-30,
    }


def _adversarial() -> dict[str, torch.Tensor]:
    g = _gen(2)
    n = 256 * 12
    zeros = torch.zeros(n)
    outlier = torch.randn(n, generator=g) * 1e-3
    outlier[::256] = 1e30  # one huge element per block (both block sizes)
    outlier[130::256] = -3e37
    sub = (torch.randint(1, 1 << 23, (n,), generator=g) * SUBNORMAL_MIN).float()
    sub = torch.where(torch.rand(n, generator=g) < 0.5, -sub, sub)
    min_sub = torch.full((n,), SUBNORMAL_MIN)
    neg_zero = torch.full((n,), -0.0)
    mixed = torch.randn(n, generator=g)
    mixed[:128] = 0.0
    mixed[128:256] = -0.0
    mixed[256:384] = sub[:128]
    extremes = torch.tensor(
        [FLT_MAX, -FLT_MAX, float("inf"), -float("inf"), float("nan"), 1.0, -1.0, 0.0] * 64
    )
    return {
        "all_zero": zeros,
        "outlier_per_block": outlier,
        "subnormals": sub,
        "min_subnormal": min_sub,
        "negative_zero": neg_zero,
        "mixed": mixed,
        "extremes": extremes,
        "odd_length": torch.randn(1001, generator=g),
        "single": torch.tensor([-2.5]),
    }


def _roundtrip(x: torch.Tensor, kind: str, bits: int, key: int | None = None) -> torch.Tensor:
    codes, scales = C.quantize(x, kind, bits, key)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32
    assert codes.numel() == C.code_bytes(x.numel(), kind, bits)
    assert scales.numel() == C.num_scales(x.numel(), kind, bits)
    assert torch.isfinite(scales).all()
    return C.dequantize(codes, scales, kind, bits, x.numel())


def _check_bound(x: torch.Tensor, kind: str, bits: int, key: int | None = None) -> torch.Tensor:
    out = _roundtrip(x, kind, bits, key)
    assert out.dtype == torch.float32 and out.shape == (x.numel(),)
    assert torch.isfinite(out).all(), "NaN/Inf decoded"
    clean = C.clean_m(x) if kind == "m" else C.clean_v(x)
    err = (out.double() - clean.double()).abs()
    bound = C.error_bound(x, kind, bits, stochastic=key is not None)
    worst = int(torch.argmax(err - bound))
    assert (err <= bound).all(), (
        f"element {worst}: {x[worst]} -> {out[worst]}, error {err[worst]} > {bound[worst]}"
    )
    if kind == "v":
        assert (out > 0).all(), "v decoded to zero"
    return out


@pytest.mark.parametrize("kind,bits", KINDS)
@pytest.mark.parametrize("data", list(_random()))
def test_error_bound_random(kind: str, bits: int, data: str) -> None:
    _check_bound(_for_kind(_random()[data], kind), kind, bits)


@pytest.mark.parametrize("kind,bits", KINDS)
@pytest.mark.parametrize("data", list(_adversarial()))
def test_error_bound_adversarial(kind: str, bits: int, data: str) -> None:
    x = _adversarial()[data]
    _check_bound(x.abs() if kind == "v" else x, kind, bits)  # v: magnitudes (negatives are cleaned to 0)
    _check_bound(x, kind, bits)  # and as given: NaN, Inf and negative v are cleaned, never propagated


@pytest.mark.parametrize("kind,bits", KINDS)
@pytest.mark.parametrize("key", [None, 7], ids=["nearest", "stochastic"])
def test_worst_case_relative_to_block_absmax(kind: str, bits: int, key: int | None) -> None:
    """The headline constants: max error / block absmax (nearest, m: 1/30, 0.1125, 0.5; v: 0.022, 0.19, 1;
    stochastic rounding: a whole gap)."""
    x = _for_kind(_random()["student_t2"], kind)
    out = _roundtrip(x, kind, bits, key)
    size = C.block_size(kind, bits)
    pad = -x.numel() % size
    err = torch.nn.functional.pad((out - x).abs(), (0, pad)).view(-1, size).amax(1)
    absmax = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, size).amax(1)
    limit = C.max_relative_error(kind, bits, stochastic=key is not None)
    assert (err <= absmax * limit * (1 + 2**-12)).all()


@pytest.mark.parametrize("kind,bits", KINDS)
def test_typical_error_is_small(kind: str, bits: int) -> None:
    """Not a bound, a regression figure: RMS error / RMS value on Gaussian m and chi-square v (measured:
    m 0.026, 0.137, 0.137, 0.36; v 0.0113, 0.090, 0.40, 0.40 for int8, int4, int3, int2)."""
    x = _for_kind(torch.randn(1 << 16, generator=_gen(3)), kind)
    out = _roundtrip(x, kind, bits)
    rel = float((out - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt())
    limit = {"m": {8: 0.03, 4: 0.15, 3: 0.15, 2: 0.4}, "v": {8: 0.015, 4: 0.1, 3: 0.45, 2: 0.45}}[kind][bits]
    assert rel < limit, rel


# -- stochastic rounding (every map) --


@pytest.mark.parametrize("kind,bits", KINDS)
def test_stochastic_error_bound(kind: str, bits: int) -> None:
    """Rounded stochastically, every element lands on one of its two neighbouring codes (the bound of a
    whole gap), on random and adversarial data, NaN and Inf cleaned as with nearest rounding."""
    for key in (0, 0xDEADBEEF):
        for x in _random().values():
            _check_bound(_for_kind(x, kind), kind, bits, key)
        for x in _adversarial().values():
            _check_bound(x.abs() if kind == "v" else x, kind, bits, key)
            _check_bound(x, kind, bits, key)


def _map_values(kind: str, bits: int) -> torch.Tensor:
    """The values a block decodes to when its largest element is the map's largest value (the scale then
    decodes each code to its value), ascending."""
    if kind == "v":
        return C.FORMATS[bits].v_table.flip(0)
    return torch.unique(C.M8_TABLE) if bits == 8 else C.FORMATS[bits].m_sorted


def _in_range(kind: str, bits: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values inside the map's range, in blocks whose first element is the map's largest value, so that
    the normalized values are the values; and each one's gap between its neighbouring codes."""
    fmt = C.FORMATS[bits]
    table = _map_values(kind, bits)
    g = _gen(5)
    if kind == "m":
        x = table[0] + (table[-1] - table[0]) * torch.rand(n, generator=g)
    else:
        x = torch.exp2(-torch.rand(n, generator=g) * fmt.v_octaves * (table.numel() - 1))
    x[:: C.block_size(kind, bits)] = table[-1]
    upper = torch.bucketize(x, table).clamp(1, table.numel() - 1)
    return x, table[upper] - table[upper - 1]


def test_stochastic_rounding_draws_independent_uniform_numbers() -> None:
    """One hash per number (``mix32(index ^ key)``): uniform on [0, 1), and uncorrelated between
    neighbouring elements, between m's and v's numbers of an element and between an element's numbers
    on consecutive steps. Without the hash (``index ^ key`` scaled) every one of these fails."""
    steps, n = 64, 4096
    keys = [rounding.rounding_keys(3, step) for step in range(1, steps + 1)]
    u = torch.stack([torch.stack([rounding.uniforms(1000, n, k) for k in pair]) for pair in keys]).double()
    assert u.min() >= 0 and u.max() < 1
    deciles = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (deciles - 0.1).abs().max() < 0.005

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.corrcoef(torch.stack([a.reshape(-1), b.reshape(-1)]))[0, 1])

    bound = 5 / (steps * n) ** 0.5  # five standard errors of a correlation of independent numbers
    assert abs(corr(u[:, :, 1:], u[:, :, :-1])) < bound  # neighbouring elements
    assert abs(corr(u[:, 0], u[:, 1])) < bound  # m and v of an element
    assert abs(corr(u[1:], u[:-1])) < bound  # consecutive steps


@pytest.mark.parametrize("kind,bits", KINDS)
def test_stochastic_rounding_is_unbiased(kind: str, bits: int) -> None:
    """Over many keys the decoded values average to the input (v of the formats with ``v_root_rounding``:
    their fourth roots to its fourth root): each element's mean error is within 5 standard errors
    (gap / 2 / sqrt(draws)) of zero. Nearest rounding fails the same check."""
    x, gap = _in_range(kind, bits, 2048)
    fmt = C.FORMATS[bits]
    root = kind == "v" and fmt.v_root_rounding
    if root:
        measure = lambda t: t.sqrt().sqrt()  # noqa: E731
        lower = gap / (2**fmt.v_octaves - 1)  # the lower neighbour (the upper one is 2^octaves times it)
        gap = measure(lower) * rounding.quarter_root_step(fmt.v_octaves)
    else:
        measure = torch.clone
    draws = 1500
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for key in range(draws):
        total += measure(_roundtrip(x, kind, bits, rounding.rounding_keys(key, 1)[kind == "v"]).double())
    err = (total / draws - measure(x.double())).abs()
    limit = 5 * gap.double() / 2 / draws**0.5 + 1e-6 * measure(x.double())
    assert (err <= limit).all(), float((err / limit).max())
    assert float((total / draws - measure(x.double())).mean()) == pytest.approx(
        0.0, abs=float(gap.mean()) / draws**0.5
    )
    nearest = (measure(_roundtrip(x, kind, bits).double()) - measure(x.double())).abs()
    assert (nearest > limit).float().mean() > 0.5


@pytest.mark.parametrize("between", [1.5, 2.0, 3.0])
def test_two_bit_v_settles_where_the_update_is_unbiased(between: float) -> None:
    """v is an average re-encoded every step, so its rounding decides where it settles. A steady gradient
    whose v lies ``between`` times its lower code (codes 4x apart): fed back through the 2-bit codec, the
    fresh v's ``1 / sqrt(v)`` (what scales the update) averages within 1% of fp32's. Rounded unbiased in
    log v it is 4.8-5.7% low here, unbiased in v 11-16% high."""
    bits, beta2, steps, n = 3, 0.95, 400, 64 * 64
    g2 = torch.full((n,), between / 16)  # between the codes 1/16 and 1/4 of the block max
    g2[::64] = 1.0
    small = g2 != 1.0
    stored, exact, gains = torch.zeros(n), torch.zeros(n), []
    for step in range(1, steps + 1):
        fresh = stored * beta2 + g2 * (1 - beta2)
        exact = exact * beta2 + g2 * (1 - beta2)
        if step > steps // 4:
            gains.append(float((exact[small].sqrt() / fresh[small].sqrt()).mean()))
        state = C.quantize(fresh, "v", bits, rounding.rounding_keys(7, step)[1])
        stored = C.dequantize(*state, "v", bits, n)
    assert sum(gains) / len(gains) == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("octaves", sorted({f.v_octaves for f in C.FORMATS.values() if f.v_root_rounding}))
def test_quarter_power_threshold_on_every_uniform_number(octaves: float) -> None:
    """``quarter_power_threshold`` on all 2^23 numbers ``uniforms`` draws, for the maps rounded so: within
    1e-6 of ``(1 + u * (2^(octaves / 4) - 1))^4``, exactly 1 at u = 0 and below ``2^octaves`` (so a map's
    value always encodes as itself)."""
    u = torch.arange(1 << 23, dtype=torch.float32) * 2.0**-23
    t = rounding.quarter_power_threshold(u, octaves)
    exact = (1 + u.double() * (2 ** (octaves / 4) - 1)) ** 4
    assert float((t.double() / exact - 1).abs().max()) < 1e-6
    assert float(t[0]) == 1.0 and float(t.min()) >= 1.0 and float(t.max()) < 2**octaves


def test_stochastic_rounding_is_keyed() -> None:
    """The same key gives the same codes; another key other codes; values of the map stay exact."""
    x = torch.randn(4096, generator=_gen(6))
    for kind, bits in KINDS:
        y = _for_kind(x, kind)
        a, b, c = (C.quantize(y, kind, bits, key)[0] for key in (1, 1, 2))
        assert torch.equal(a, b)
        assert not torch.equal(a, c)
        assert not torch.equal(a, C.quantize(y, kind, bits)[0])
    for kind, bits in KINDS:
        table = _map_values(kind, bits)  # from the largest, which each block then holds
        pad = (0, -table.numel() % C.block_size(kind, bits))
        values = torch.nn.functional.pad(table.flip(0), pad, value=float(table[-1]))
        assert torch.equal(_roundtrip(values.repeat(8), kind, bits, key=3), values.repeat(8))


def test_v_never_decodes_to_zero() -> None:
    for bits in C.FORMATS:
        x = torch.zeros(1000)
        x[3] = 1e20  # everything else in that block is far below one level
        x[500:] = torch.rand(500, generator=_gen(4)) * 1e-38
        out = _roundtrip(x, "v", bits)
        assert (out > 0).all() and torch.isfinite(out).all()
        codes, scales = C.quantize(torch.zeros(300), "v", bits)
        assert (scales >= C.V_FLOOR / 256).all()
        assert (C.dequantize(codes, scales, "v", bits, 300) > 0).all()


def test_zero_state_decodes_to_zero() -> None:
    """A freshly allocated (zero-filled) state is m = v = 0, whatever the codes' meaning."""
    for bits in C.FORMATS:
        mc, ms, vc, vs = C.empty_state(1000, bits)
        assert C.dequantize(mc, ms, "m", bits, 1000).eq(0).all()
        assert C.dequantize(vc, vs, "v", bits, 1000).eq(0).all()
        assert (mc.numel(), vc.numel()) == (C.code_bytes(1000, "m", bits), C.code_bytes(1000, "v", bits))


def test_block_max_is_exact() -> None:
    """The largest magnitude of a block decodes to itself (up to the scale's rounding)."""
    x = torch.randn(4096, generator=_gen(5))
    for kind, bits in KINDS:
        xk = _for_kind(x, kind)
        out = _roundtrip(xk, kind, bits)
        size = C.block_size(kind, bits)
        idx = xk.abs().view(-1, size).argmax(1) + torch.arange(0, 4096, size)
        torch.testing.assert_close(out[idx], xk[idx], rtol=2**-22, atol=0)


@pytest.mark.parametrize("bits", [4, 2])
def test_m_table_negative_block_max_is_exact(bits: int) -> None:
    """The table maps are asymmetric (+1 but only -0.8875 / -0.5): the signed scale keeps a negative max
    exact."""
    x = -torch.rand(128, generator=_gen(6))
    x[7] = -2.0
    out = _roundtrip(x, "m", bits)
    assert out[7] == -2.0
    codes, scales = C.quantize(x, "m", bits)
    assert scales[0] == -2.0


def test_table_values_roundtrip_exactly() -> None:
    # E4M3: every code's value, with 1.875 present so the scale is 1
    values = C.M8_TABLE[torch.arange(128)]
    x = torch.cat([values, -values[1:], torch.tensor([1.875])])[:256]
    x = torch.nn.functional.pad(x, (0, 256 - x.numel()), value=1.875)
    assert torch.equal(_roundtrip(x, "m", 8), x)
    # table maps with +1 present (every block holds it)
    for bits in (4, 3, 2):
        fmt = C.FORMATS[bits]
        y = fmt.m_table.repeat(256 // fmt.m_table.numel())
        assert torch.equal(_roundtrip(y, "m", bits), y)
    # the log v maps, 2^(-c step) of the max, int8's included
    for bits in C.FORMATS:
        z = C.FORMATS[bits].v_table.repeat(256 // C.FORMATS[bits].v_table.numel())
        assert torch.equal(_roundtrip(z, "v", bits), z)


def test_int8_v_of_the_linear_map_upgrades_to_the_log_map() -> None:
    """Format versions 1 and 2 stored int8's v as (c + 1) / 256 of the block max: upgraded, each element
    decodes within the log map's rounding of what its old code meant, a block never written (scale 0)
    stays the fresh state (zero), and a partial last block is kept to its elements."""
    n = 128 * 5 + 37
    codes = torch.randint(0, 256, (n,), generator=_gen(8), dtype=torch.uint8)
    scales = torch.rand(6, generator=_gen(9)) * 1e-3 + 1e-6
    scales[2] = 0.0
    codes[256:384] = 0
    old = (codes.float() + 1) * scales.repeat_interleave(128)[:n]
    new_codes, new_scales = C.upgrade_v8(codes, scales)
    assert new_codes.shape == codes.shape and new_scales.shape == scales.shape
    decoded = C.dequantize(new_codes, new_scales, "v", 8, n)
    assert ((decoded - old).abs() <= C.error_bound(old, "v", 8)).all()
    assert decoded[256:384].eq(0).all() and new_scales[2] == 0


def test_negative_zero_and_nan_encode_canonically() -> None:
    x = torch.tensor([-0.0, 0.0, float("nan"), -float("nan"), 1.0, -1e-30])
    codes, _ = C.quantize(x, "m", 8)
    assert codes[:4].tolist() == [0, 0, 0, 0]  # never the -0 code (128)
    assert codes[5] == 0  # below half the smallest subnormal step: zero, not -0
    out = _roundtrip(x, "m", 8)
    assert torch.isfinite(out).all() and out[:4].eq(0).all()
    for bits in (4, 2):
        codes, _ = C.quantize(x, "m", bits)
        assert packing.unpack(codes, 6, C.width("m", bits))[:4].tolist() == [0, 0, 0, 0]


def test_infinities_saturate() -> None:
    x = torch.tensor([float("inf"), -float("inf"), 1.0, 0.0])
    out = _roundtrip(x, "m", 8)
    assert out[0] > 3e38 and out[1] < -3e38 and torch.isfinite(out).all()
    v = _roundtrip(torch.tensor([float("inf"), 1.0]), "v", 8)
    assert torch.isfinite(v).all() and v[0] > 3e38


def test_blocks_are_independent() -> None:
    x = torch.randn(1024, generator=_gen(7))
    for kind, bits in KINDS:
        xk = _for_kind(x, kind)
        a = _roundtrip(xk, kind, bits)
        y = xk.clone()
        y[:256] *= 1e6  # touches the first 256 elements only (whole blocks of every size)
        b = _roundtrip(y, kind, bits)
        assert torch.equal(a[256:], b[256:])


@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 127, 128, 129, 255, 1001])
def test_pack_odd_lengths(n: int, width: int) -> None:
    codes = torch.randint(0, 1 << width, (n,), generator=_gen(n), dtype=torch.uint8)
    packed = packing.pack(codes, width)
    per = 8 // width
    assert packed.numel() == -(-n // per)
    assert torch.equal(packing.unpack(packed, n, width), codes)
    for i in range(min(n, 8)):  # element k of byte j in bits [k * width, (k + 1) * width)
        assert (packed[i // per] >> (i % per * width)) & ((1 << width) - 1) == codes[i]
    if n % per:
        assert packed[-1] >> (n % per * width) == 0
    x = torch.randn(n, generator=_gen(n))
    for bits in (4, 3, 2):
        for kind in "mv":
            if n:
                _check_bound(_for_kind(x, kind), kind, bits)


def test_state_bytes_per_parameter() -> None:
    n = 100 * 4096
    assert C.state_bytes(n, 8) / n == 2 + 4 / 256 + 4 / 128  # 2.047
    assert C.state_bytes(n, 4) / n == 1 + 4 / 64 + 4 / 128  # 1.094
    assert C.state_bytes(n, 3) / n == 0.75 + 4 / 64 + 4 / 64  # 0.875
    assert C.state_bytes(n, 2) / n == 0.5 + 4 / 32 + 4 / 64  # 0.6875
    for bits in C.FORMATS:
        mc, ms, vc, vs = C.empty_state(n, bits)
        assert sum(t.numel() * t.element_size() for t in (mc, ms, vc, vs)) == C.state_bytes(n, bits)


def test_state_slices() -> None:
    assert C.state_slices(512, 1001, 8) == (slice(512, 1001), slice(2, 4), slice(512, 1001), slice(4, 8))
    assert C.state_slices(512, 1001, 4) == (slice(256, 501), slice(8, 16), slice(256, 501), slice(4, 8))
    assert C.state_slices(512, 1001, 3) == (slice(256, 501), slice(8, 16), slice(128, 251), slice(8, 16))
    assert C.state_slices(512, 1001, 2) == (slice(128, 251), slice(16, 32), slice(128, 251), slice(8, 16))
    with pytest.raises(ValueError):
        C.state_slices(100, 200, 8)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        C.quantize(torch.ones(3), "w", 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        C.quantize(torch.ones(3), "m", 5)
    codes, scales = C.quantize(torch.ones(300), "m", 8)
    with pytest.raises(ValueError):
        C.dequantize(codes, scales, "m", 8, 299)
