"""apirctl.durations: one way of saying a length of time, for `ps` and `machine status`."""

from __future__ import annotations

import pytest

from apirctl import durations


@pytest.mark.parametrize(("seconds", "said"), [
    (0, "0s"), (12.9, "12s"), (59, "59s"), (60, "1m0s"), (5 * 60 + 3, "5m3s"), (3599, "59m59s"),
    (3600, "1h0m"), (2 * 3600 + 13 * 60 + 59, "2h13m"), (86399, "23h59m"), (86400, "1d0h"),
    (3 * 86400 + 3600 + 59, "3d1h"), (400 * 86400, "400d0h"),
])
def test_two_largest_units_the_way_podman_ps_says_them(seconds: float, said: str) -> None:
    assert durations.short(seconds) == said


def test_a_clock_that_went_back_reads_as_no_time() -> None:
    assert durations.short(-30) == "0s"
