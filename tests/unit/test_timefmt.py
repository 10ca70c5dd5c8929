"""Durations as people read them (core/timefmt.human): in messages, and in `status` columns."""

from __future__ import annotations

import pytest

from slurmagent.core.timefmt import human


@pytest.mark.parametrize("seconds, text", [
    (45, "45s"), (44.6, "45s"), (119.4, "119s"), (725, "12m05s"), (11100, "3h05m"), (183600, "2d3h"),
    (-45, "-45s"), (-725, "-12m05s"),
])
def test_a_message_keeps_its_seconds_where_they_matter(seconds, text) -> None:
    assert human(seconds) == text


@pytest.mark.parametrize("seconds, text", [
    (45, "45s"), (44.6, "44s"), (725, "12m"), (11100, "3h05m"), (183600, "2d3h"), (-45, "in 45s"), (None, "-"),
])
def test_a_status_column_shows_whole_minutes_ahead_and_unknown(seconds, text) -> None:
    assert human(seconds, column=True) == text
