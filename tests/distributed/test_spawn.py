"""on_spawned_ranks: results by rank, and a failing rank's traceback in the error."""

from __future__ import annotations

import operator

import pytest

from tpserve.distributed.spawn import on_spawned_ranks


def test_results_come_back_by_rank():
    assert on_spawned_ranks(operator.add, 2, 10, timeout_s=60) == [10, 11]


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"rank \d failed:\n(.|\n)*ZeroDivisionError"):
        on_spawned_ranks(operator.truediv, 2, 0, timeout_s=60)
