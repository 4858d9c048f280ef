"""The load-time model's fit: least squares over the last 256 moves, however many moves came
before; the defaults until eight moves of at least two sizes were seen."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixd.loadtime import LoadTimeModel

WINDOW = 256


def least_squares(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(overhead_s, bandwidth) of a line fitted with numpy to the last WINDOW samples."""
    sizes, times = np.array(samples[-WINDOW:], dtype=float).T
    slope, intercept = np.polyfit(sizes, times, 1)
    return max(0.0, float(intercept)), 1.0 / slope


def moves(rng: np.random.Generator, n: int) -> list[tuple[int, float]]:
    """Loads from 4 KiB to 64 MiB at ~3 GB/s after ~0.4 ms, with noise."""
    sizes = rng.integers(4 << 10, 64 << 20, n)
    return [(int(s), 4e-4 + s / 3e9 + float(rng.normal(0, 2e-5))) for s in sizes]


def test_the_line_is_the_last_windows_least_squares_fit() -> None:
    """Every eighth move while the window fills, then after every move, the estimate is the
    least-squares line of the last 256 moves; between fits it stays as it was."""
    model = LoadTimeModel()
    seen: list[tuple[int, float]] = []
    for n_bytes, seconds in moves(np.random.default_rng(7), 3 * WINDOW + 5):
        before = (model.overhead_s, model.bandwidth)
        model.observe(n_bytes, seconds)
        seen.append((n_bytes, seconds))
        if len(seen) < WINDOW and len(seen) % 8:
            assert (model.overhead_s, model.bandwidth) == before, len(seen)
            continue
        overhead_s, bandwidth = least_squares(seen)
        assert model.bandwidth == pytest.approx(bandwidth, rel=1e-9), len(seen)
        assert model.overhead_s == pytest.approx(overhead_s, rel=1e-7, abs=1e-12), len(seen)
        assert model.estimate(1 << 20) == pytest.approx(overhead_s + (1 << 20) / bandwidth)


def test_two_early_moves_never_make_the_line_alone() -> None:
    """A warm first load and a cold second one of another size draw a line of 8 KB/s, which
    would price every hit far above its prefill: the defaults stand until eight moves were seen."""
    model = LoadTimeModel(overhead_s=300e-6, bandwidth=2e9)
    seen = [(4 << 10, 1e-4), (8 << 10, 0.5)]  # the second a cold read: 0.5 s for 8 KiB
    for n_bytes, seconds in seen:
        model.observe(n_bytes, seconds)
    assert (model.overhead_s, model.bandwidth) == (300e-6, 2e9)
    for mib in range(16, 22):
        seen.append((mib << 20, 0.1 * mib))
        model.observe(*seen[-1])
    assert model.bandwidth == pytest.approx(least_squares(seen)[1])  # eight moves: fitted


def exact_line(samples: list[tuple[int, float]]) -> tuple[Fraction, Fraction] | None:
    """(slope, intercept) of the least-squares line through the last WINDOW samples, in exact
    arithmetic; None when they have one size."""
    window = [(Fraction(x), Fraction(y)) for x, y in samples[-WINDOW:]]
    n = len(window)
    sx, sy = sum(x for x, _ in window), sum(y for _, y in window)
    spread = n * sum(x * x for x, _ in window) - sx * sx
    if not spread:
        return None
    slope = (n * sum(x * y for x, y in window) - sx * sy) / spread
    return slope, (sy - slope * sx) / n


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 1 << 34), st.floats(1e-6, 10.0)), min_size=2, max_size=700)
)
def test_the_running_fit_matches_an_exact_one(samples: list[tuple[int, float]]) -> None:
    """Any moves, sizes from a byte to 16 GiB: over the window's sizes the running sums' line is
    the exact least-squares line of the last window (where it rises), however many moves left the
    window before."""
    if len(samples) < WINDOW:  # the moves up to the last fit while the window fills
        samples = samples[: len(samples) // 8 * 8]
    model = LoadTimeModel()
    for n_bytes, seconds in samples:
        model.observe(n_bytes, seconds)
    line = exact_line(samples) if samples else None
    if line is None:
        return
    slope, intercept = line
    sizes = [n for n, _ in samples[-WINDOW:]]
    scale = max(y for _, y in samples[-WINDOW:])
    if slope * max(sizes) <= Fraction(1, 10**6) * Fraction(scale):
        return  # flat or falling: the model keeps an earlier line
    for n in sizes:
        expected = float(max(Fraction(0), intercept) + slope * n)
        assert model.estimate(n) == pytest.approx(expected, rel=1e-6, abs=1e-6 * scale)


def test_one_size_keeps_the_defaults_and_then_the_last_fit() -> None:
    model = LoadTimeModel(overhead_s=1e-3, bandwidth=1e9)
    for _ in range(2 * WINDOW):
        model.observe(1 << 20, 5e-3)
    assert (model.overhead_s, model.bandwidth) == (1e-3, 1e9)  # one size: no line to fit
    model.observe(2 << 20, 6e-3)  # a second size: 1 MiB more costs 1 ms
    assert model.bandwidth == pytest.approx((1 << 20) / 1e-3)
    assert model.overhead_s == pytest.approx(4e-3)
    for _ in range(WINDOW):  # the 2 MiB move is the window's last of another size
        model.observe(4 << 20, 1.0)
    assert model.bandwidth == pytest.approx((2 << 20) / 0.994)
    assert model.overhead_s == 0.0  # the line meets zero bytes below zero seconds
    for _ in range(WINDOW):  # the window holds one size: the last fit stands
        model.observe(4 << 20, 2.0)
    assert model.bandwidth == pytest.approx((2 << 20) / 0.994)
    model.forget()
    assert (model.overhead_s, model.bandwidth) == (1e-3, 1e9)
    model.observe(1 << 20, 5e-3)
    assert (model.overhead_s, model.bandwidth) == (1e-3, 1e9)  # forgotten: one size seen
