"""Codecs: round trips, error bounds, error feedback, and sums over many nodes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.comm.codecs import INT8_CHUNK, Int8, LowBit, TopK, make_codec, reduce_payloads
from unbroken.specs import CODECS


def grad(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("n", [1, 7, INT8_CHUNK, INT8_CHUNK + 1, 5000])
def test_payload_has_the_announced_fixed_size(spec: str, n: int) -> None:
    codec = make_codec(spec)
    payload = codec.encode(grad(n))
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(n)
    assert codec.decode(payload, n).shape == (n,)


def test_identity_is_exact() -> None:
    x = grad(1000)
    codec = make_codec("none")
    assert torch.equal(codec.decode(codec.encode(x), 1000), x)


@pytest.mark.parametrize(("spec", "rel"), [("fp16", 1e-3), ("bf16", 8e-3)])
def test_half_precision_error_is_within_its_mantissa(spec: str, rel: float) -> None:
    x = grad(5000)
    codec = make_codec(spec)
    y = codec.decode(codec.encode(x), 5000)
    assert ((y - x).abs() <= rel * x.abs() + 1e-7).all()
    assert codec.payload_bytes(5000) == 10_000


def test_fp16_saturates_instead_of_overflowing_to_inf() -> None:
    codec = make_codec("fp16")
    y = codec.decode(codec.encode(torch.tensor([1e6, -1e6, 1.0])), 3)
    assert torch.isfinite(y).all() and y[0] == 65504 and y[1] == -65504


def test_int8_error_is_at_most_half_a_step_per_chunk() -> None:
    x = grad(10 * INT8_CHUNK + 3, scale=5.0)
    codec = Int8(error_feedback=False)
    y = codec.decode(codec.encode(x), x.numel())
    padded = torch.zeros(11 * INT8_CHUNK)
    padded[: x.numel()] = x
    step = padded.view(11, INT8_CHUNK).abs().amax(1) / 127
    err = torch.zeros(11 * INT8_CHUNK)
    err[: x.numel()] = (y - x).abs()
    assert (err.view(11, INT8_CHUNK) <= step[:, None] / 2 + 1e-6).all()


def test_int8_cuts_bytes_about_four_times() -> None:
    n = 1_000_000
    assert 4 * n / make_codec("int8").payload_bytes(n) >= 3.9


def test_int8_of_zeros_and_of_a_chunk_with_one_value() -> None:
    codec = Int8(error_feedback=False)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(10)), 10), torch.zeros(10))
    x = torch.zeros(300)
    x[5] = -3.25
    assert torch.equal(codec.decode(codec.encode(x), 300), x)


def test_sum_of_many_int8_nodes_neither_overflows_nor_drifts() -> None:
    # 64 nodes whose values would overflow an int8 (or int16) accumulator many times over.
    n, nodes = 4096, 64
    xs = [grad(n, seed=i, scale=100.0) for i in range(nodes)]
    codecs = [Int8(error_feedback=False) for _ in range(nodes)]
    total = reduce_payloads(codecs[0], [c.encode(x) for c, x in zip(codecs, xs, strict=True)], n)
    exact = torch.stack(xs).sum(0)
    bound = sum(x.abs().max().item() / 127 / 2 for x in xs)  # half a step per node at most
    assert torch.isfinite(total).all()
    assert (total - exact).abs().max().item() <= bound + 1e-3


def test_reduce_is_the_same_on_every_rank() -> None:
    xs = [grad(3000, seed=i) for i in range(5)]
    payloads = [Int8().encode(x) for x in xs]
    first = reduce_payloads(Int8(), payloads, 3000)
    assert all(torch.equal(first, reduce_payloads(Int8(), list(payloads), 3000)) for _ in range(3))


@pytest.mark.parametrize("spec", ["int8", "int4", "int2", "int1", "topk:0.05"])
def test_error_feedback_loses_nothing_over_time(spec: str) -> None:
    # The sum of what was sent plus the residual equals the sum of what was given.
    codec = make_codec(spec)
    given_sum = torch.zeros(2000)
    sent_sum = torch.zeros(2000)
    for i in range(30):
        x = grad(2000, seed=i)
        given_sum += x
        sent_sum += codec.decode(codec.encode(x), 2000)
    residual = codec.state_dict()["residual"]
    assert torch.allclose(sent_sum + residual, given_sum, atol=1e-4)


def test_topk_sends_the_largest_and_its_residual_carries_the_rest() -> None:
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.05, 0.0, 0.0, 0.0, 0.0, 0.0])
    codec = TopK(ratio=0.2)
    y = codec.decode(codec.encode(x), 10)
    assert torch.equal(y, torch.tensor([0.0, -5.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(codec.residual, x - y)
    # The small elements build up in the residual until they are sent.
    for _ in range(40):
        y = codec.decode(codec.encode(torch.zeros(10)), 10)
        if y[2] != 0:
            break
    assert y[2] != 0


def test_topk_payload_with_an_out_of_range_index_is_refused() -> None:
    codec = TopK(ratio=0.5)
    payload = codec.encode(grad(10))
    payload[:4] = torch.tensor([100], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(ValueError, match="names element 100 of a 10-element tensor"):
        codec.decode(payload, 10)


def test_residual_is_state_that_saves_loads_and_resets() -> None:
    a = Int8()
    a.encode(grad(500))
    b = Int8()
    b.load_state_dict(a.state_dict())
    x = grad(500, seed=9)
    assert torch.equal(a.encode(x), b.encode(x))
    b.reset()
    assert b.state_dict()["residual"] is None


@pytest.mark.parametrize("bad", ["gzip", "int8:3", "topk:0", "topk:2", "topk:x", "fp16:1"])
def test_unknown_codecs_are_refused_with_the_choices(bad: str) -> None:
    with pytest.raises(ValueError, match="codec"):
        make_codec(bad)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=3000),
    scale=st.floats(min_value=1e-6, max_value=1e4),
    spec=st.sampled_from(["fp16", "bf16", "int8", "int4", "int2", "int1", "topk:0.1"]),
)
def test_round_trip_error_is_bounded_by_the_input_scale(n: int, scale: float, spec: str) -> None:
    x = grad(n, seed=n, scale=scale)
    codec = make_codec(spec)
    y = codec.decode(codec.encode(x), n)
    assert torch.isfinite(y).all()
    assert (y - x).abs().max().item() <= x.abs().max().item() * 1.0001 + 1e-9


@pytest.mark.parametrize(("spec", "cut"), [("int4", 7.5), ("int2", 15.0), ("int1", 28.0)])
def test_low_bit_codecs_cut_bytes_8_16_and_28_times(spec: str, cut: float) -> None:
    n = 1_000_000
    assert 4 * n / make_codec(spec).payload_bytes(n) >= cut


def test_int4_error_is_at_most_half_a_level_per_chunk() -> None:
    x = grad(4 * INT8_CHUNK + 3, scale=3.0)
    codec = LowBit(4)
    y = codec.decode(codec.encode(x), x.numel())
    for a in range(0, x.numel(), INT8_CHUNK):
        step = x[a : a + INT8_CHUNK].abs().max() / 7
        assert (y[a : a + INT8_CHUNK] - x[a : a + INT8_CHUNK]).abs().max() <= step / 2 + 1e-6


def test_int2_sends_three_levels_and_keeps_the_direction() -> None:
    x = grad(8 * INT8_CHUNK)
    codec = LowBit(2)
    y = codec.decode(codec.encode(x), x.numel())
    for a in range(0, x.numel(), INT8_CHUNK):
        levels = set(y[a : a + INT8_CHUNK].unique().tolist())
        assert len(levels) <= 3 and 0.0 in levels
    assert float(torch.nn.functional.cosine_similarity(x, y, dim=0)) > 0.8


def test_a_low_bit_level_out_of_range_is_refused() -> None:
    codec = LowBit(4)
    payload = codec.encode(grad(INT8_CHUNK))
    payload[4] = 0xFF  # levels 15 and 15: above 2 * 7
    with pytest.raises(ValueError, match="level above 7"):
        codec.decode(payload, INT8_CHUNK)


@pytest.mark.parametrize("spec", ["int4", "int2", "int1"])
def test_low_bit_payloads_are_equal_for_equal_inputs_and_residuals(spec: str) -> None:
    a, b = make_codec(spec), make_codec(spec)
    for i in range(3):
        x = grad(3000, seed=i)
        assert torch.equal(a.encode(x), b.encode(x.clone()))


@pytest.mark.parametrize("spec", ["int8", "int4", "int2", "int1"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_a_payload_with_a_bad_scale_is_refused(spec: str, scale: float) -> None:
    codec = make_codec(spec)
    payload = codec.encode(grad(3 * INT8_CHUNK))
    payload[4:8] = torch.tensor([scale], dtype=torch.float32).view(torch.uint8)
    with pytest.raises(ValueError, match="scales that are negative or not finite"):
        codec.decode(payload, 3 * INT8_CHUNK)


def test_a_topk_payload_with_a_value_not_finite_is_refused() -> None:
    codec = TopK(ratio=0.5)
    payload = codec.encode(grad(10))
    payload[20:24] = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)
    with pytest.raises(ValueError, match="not finite"):
        codec.decode(payload, 10)


@pytest.mark.parametrize("spec", ["int8", "int4", "int2", "int1", "topk:0.05"])
def test_a_gradient_not_finite_leaves_no_residual_behind(spec: str) -> None:
    # Its step is refused; a NaN carried in the residual would spoil every step after it.
    codec = make_codec(spec)
    codec.encode(grad(1000))
    bad = grad(1000, seed=1)
    bad[7] = float("nan")
    codec.encode(bad)
    assert codec.state_dict()["residual"] is None
    y = codec.decode(codec.encode(grad(1000, seed=2)), 1000)
    assert torch.isfinite(y).all()


def test_int2_carries_the_last_partial_chunk_as_well_as_the_others() -> None:
    # The last chunk holds 1 real element and 255 of padding: its scale is its own mean.
    n = 3 * INT8_CHUNK + 1
    x = grad(n)
    codec = LowBit(2)
    y = codec.decode(codec.encode(x), n)
    assert y[-1] == pytest.approx(1.5 * abs(float(x[-1])) * (1 if x[-1] > 0 else -1))


def test_int1_sends_each_sign_times_its_chunks_mean_magnitude() -> None:
    # Two levels a chunk, +-mean|x| (zero counts as positive); the last chunk holds 3 real
    # elements and padding: its scale is the mean of those 3 alone.
    n = 4 * INT8_CHUNK + 3
    x = grad(n)
    x[5] = 0.0
    codec = LowBit(1)
    payload = codec.encode(x)
    assert payload.numel() == 4 * 5 + 5 * INT8_CHUNK // 8
    y = codec.decode(payload, n)
    for a in range(0, n, INT8_CHUNK):
        chunk = x[a : a + INT8_CHUNK]
        want = torch.where(chunk >= 0, 1.0, -1.0) * chunk.abs().mean()
        assert torch.allclose(y[a : a + INT8_CHUNK], want, rtol=1e-6)
    assert y[5] > 0
    assert torch.allclose(codec.residual, x - y)


@pytest.mark.parametrize("spec", ["int2", "int1"])
def test_values_so_large_that_a_chunks_scale_overflows_leave_no_residual_behind(spec: str) -> None:
    # The mean magnitude of 3e38s overflows float32: that payload is refused on arrival, and
    # an infinite residual would spoil every later one.
    codec = make_codec(spec)
    codec.encode(torch.full((600,), 3e38))
    assert codec.state_dict()["residual"] is None
    y = codec.decode(codec.encode(grad(600, seed=3)), 600)
    assert torch.isfinite(y).all()
