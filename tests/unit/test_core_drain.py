"""The drain-rate estimator behind Retry-After."""

from __future__ import annotations

import pytest

from batching import DrainRate


def test_unknown_until_a_sample_closes() -> None:
    d = DrainRate(min_interval=0.1)
    assert d.tokens_per_s is None and d.requests_per_s is None
    d.busy(0.0)
    d.finished(50, 1, 0.05, idle=False)
    assert d.tokens_per_s is None
    d.finished(50, 1, 0.1, idle=False)
    assert d.tokens_per_s == pytest.approx(1000.0)
    assert d.requests_per_s == pytest.approx(20.0)


def test_idle_time_is_not_counted() -> None:
    d = DrainRate()
    d.busy(0.0)
    d.finished(100, 1, 1.0, idle=True)  # 100 tok/s
    d.busy(1000.0)  # a long idle gap, then work again
    d.finished(100, 1, 1001.0, idle=True)
    assert d.tokens_per_s == pytest.approx(100.0)


def test_ewma_moves_towards_new_rate_by_elapsed_time() -> None:
    d = DrainRate(tau=2.0, min_interval=0.1)
    d.busy(0.0)
    d.finished(1000, 1, 1.0, idle=False)  # 1000 tok/s
    d.finished(0, 0, 1.1, idle=False)  # 0.1 s at 0 tok/s: a small step down
    assert 900 < (d.tokens_per_s or 0) < 1000
    for i in range(100):
        d.finished(100, 1, 1.1 + 0.1 * (i + 1), idle=False)  # 10 s at 1000 tok/s
    assert d.tokens_per_s == pytest.approx(1000.0, rel=0.01)


def test_report_without_dispatch_and_zero_length_interval() -> None:
    d = DrainRate()
    d.finished(10, 1, 5.0, idle=True)  # dt == 0: kept for the next sample
    assert d.tokens_per_s is None
    d.busy(5.0)
    d.finished(10, 1, 6.0, idle=True)
    assert d.tokens_per_s == pytest.approx(20.0)
