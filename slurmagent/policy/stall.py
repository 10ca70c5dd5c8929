"""When a wrapped job hangs, which node to blame, and which rank straggles (DESIGN: "Progress and hangs").

The wrapper samples its progress signals (the ranks' `trainer.progress`, the checkpoint
directory, the job's output file) and tells `StallWatch` each time one moved. No move for
the limit is a hang:

- before the first progress after start: `first_progress_s` (a restore and a slow first step
  are not hangs);
- then `timeout_s` when set (> 0); `0` turns the rule off; `-1` (default) is adaptive:
  `factor` x the longest gap seen so far between two progresses, within [floor, ceiling], so
  a job that writes a checkpoint for 10 minutes while its files change is never flagged, and
  one whose ranks call `trainer.progress` every few seconds is caught in minutes. Adaptive
  learns only from the ranks' own progress: a job that has sent none in this attempt (output
  and checkpoint files are all it shows) gets the ceiling, because a trainer that logs at start
  and then trains, compiles or evaluates in silence for minutes is healthy (a Lightning job
  without a progress bar was killed at the 120 s floor). An explicit `timeout_s` applies to
  every signal.

Pure: the caller passes the clock's readings.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

ADAPTIVE = -1.0
OFF = 0.0
RANK_SIGNALS = ("progress", "progress on other nodes")  # the ranks' own trainer.progress (hang/monitor.py)
STOPPED_STATES = {"T": "process stopped (T)", "t": "process stopped by a tracer (t)", "Z": "process is a zombie (Z)",
                  "gone": "process gone"}


@dataclass(frozen=True)
class StallRule:
    timeout_s: float = ADAPTIVE
    first_progress_s: float = 1800.0
    factor: float = 5.0
    floor_s: float = 120.0
    ceiling_s: float = 1800.0

    @property
    def off(self) -> bool:
        return self.timeout_s == OFF


class StallWatch:
    """The stall rule's state for one attempt."""

    def __init__(self, rule: StallRule, started: float):
        self.rule = rule
        self.started = started
        self.last: float | None = None  # the last progress (None: none since start)
        self.longest_gap = 0.0
        self.what = ""  # the signal that moved last
        self.ranks_reported = False  # a rank's own progress() seen: adaptive may learn from the gaps

    def progressed(self, now: float, what: str = "", *, ranks: bool | None = None) -> None:
        """A signal moved; `ranks` (default: `what` is one of RANK_SIGNALS) says a rank's own
        progress was among the signals that moved."""
        if self.last is not None:
            self.longest_gap = max(self.longest_gap, now - self.last)
        self.last = now
        self.what = what or self.what
        self.ranks_reported = self.ranks_reported or (what in RANK_SIGNALS if ranks is None else ranks)

    def limit(self) -> float | None:
        """Seconds without progress that make a hang now; None when the rule is off."""
        rule = self.rule
        if rule.off:
            return None
        if self.last is None:
            return rule.first_progress_s
        if rule.timeout_s > 0:
            return rule.timeout_s
        if not self.ranks_reported:  # output and checkpoint files only: too weak to learn a pace from
            return rule.ceiling_s
        return min(rule.ceiling_s, max(rule.floor_s, rule.factor * self.longest_gap))

    def stalled(self, now: float) -> str:
        """Why this is a hang ("" when it is not)."""
        limit = self.limit()
        if limit is None:
            return ""
        since = now - (self.started if self.last is None else self.last)
        if since < limit:
            return ""
        if self.last is None:
            return f"no progress {since:.0f} s after start (first-progress limit {limit:g} s)"
        how = ("" if self.rule.timeout_s > 0 else
               f", adaptive: {self.rule.factor:g} x the longest gap {self.longest_gap:.0f} s" if self.ranks_reported else
               ", adaptive: no trainer.progress from the ranks, so the ceiling")
        return f"no progress for {since:.0f} s (limit {limit:g} s{how}; last: {self.what or 'progress'})"


@dataclass(frozen=True)
class RankState:
    """One rank as the evidence saw it: its process state ("R", "S", "D", "T", "Z", "gone", "?")."""
    rank: int
    node: str
    pid: int
    state: str
    step: int | None = None
    last_at: float | None = None  # its last progress (wall clock), None when it never reported


def suspect(ranks: list[RankState], gpu_faults: dict[str, str] | None = None,
            first_gap_s: float = 10.0) -> tuple[str, str]:
    """(node, detail) of the node the evidence points at, ("", why none) when it names none.

    A rank stopped, a zombie or gone names its node; then a GPU fault on one node; then, when
    the ranks span several nodes, the rank whose progress stopped first by more than
    `first_gap_s` (on one node every rank is on it: that says nothing about the node)."""
    for r in sorted(ranks, key=lambda r: r.rank):
        if r.state in STOPPED_STATES:
            return r.node, f"rank {r.rank} stopped at step {_step(r)} ({STOPPED_STATES[r.state]}, pid {r.pid})"
    faults = {n: f for n, f in (gpu_faults or {}).items() if f}
    if len(faults) == 1:
        node, fault = next(iter(faults.items()))
        return node, f"GPU fault under the hung job ({fault})"
    timed = sorted((r for r in ranks if r.last_at is not None), key=lambda r: r.last_at)
    if len({r.node for r in ranks}) > 1 and len(timed) > 1 and timed[1].last_at - timed[0].last_at > first_gap_s:
        r = timed[0]
        return r.node, (f"rank {r.rank} stopped at step {_step(r)} (its progress stopped "
                        f"{timed[1].last_at - r.last_at:.0f} s before any other rank's)")
    return "", "no rank stopped or gone, no GPU fault, no rank stopped first: no node to blame"


def _step(r: RankState) -> str:
    return "?" if r.step is None else str(r.step)


# --- stragglers ---------------------------------------------------------------------------------


@dataclass
class StragglerRule:
    window_s: float = 60.0
    factor: float = 2.0
    windows: int = 3


LOCKSTEP_TOLERANCE = 0.15  # ranks whose s/step agree within this go at one pace: a collective every step
BUSY_FLOOR = 0.05  # of the step: a rank's busy time is never taken below it (no ratio to ~0)


class Straggler(NamedTuple):
    """A rank reported: `value` its s/step (rate rule) or its busy s per step (lockstep rule),
    `median` the other ranks' same measure; `step_s` the common s/step and `lag_s` how much later
    than the earliest rank it reaches each step, both None under the rate rule."""
    rank: int
    value: float
    median: float
    step_s: float | None = None
    lag_s: float | None = None


@dataclass
class StragglerWatch:
    """Per rank, over windows of `window_s`: a rank slower than `factor` x the other ranks'
    median for `windows` windows in a row is a straggler (reported once).

    Slower how: ranks that meet in a collective every step (lockstep: their s/step agree within
    LOCKSTEP_TOLERANCE and they are less than a step apart) all go at the slowest rank's pace, so
    their rates say nothing. What differs, when `progress` is called after the step's compute and
    before its collective, is when each rank reaches a step: the straggler comes last, by its
    extra compute. Each rank's arrival relative to a reference rank (its samples against the
    reference's, interpolated at the same step; the median over the window) gives how long
    before the last rank it arrives, i.e. waits in the collective, and its busy time per step =
    the step's time - that wait. Busy times are compared like rates. Called after the collective
    instead, every rank arrives together: equal busy times, nothing reported (and nothing seen).
    Ranks not in lockstep are judged by their s/step. Arrival times are the ranks' wall clocks: on
    several nodes they assume synchronised clocks (NTP: offsets well under a step's compute)."""
    rule: StragglerRule
    samples: dict[int, list[tuple[float, int]]] = field(default_factory=dict)  # rank -> [(at, step)] this window
    window_start: float | None = None
    slow_streak: dict[int, int] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)

    def observe(self, now: float, steps: dict[int, tuple[float, int]]) -> list[Straggler]:
        """Feed each rank's latest (at, step); at a window's end return the new stragglers."""
        for rank, (at, step) in steps.items():
            seen = self.samples.setdefault(rank, [])
            if not seen or seen[-1] != (at, step):
                seen.append((at, step))
        if self.window_start is None:
            self.window_start = now
        if now - self.window_start < self.rule.window_s:
            return []
        samples = self.samples
        self.samples = {rank: seen[-1:] for rank, seen in samples.items()}
        self.window_start = now
        rates = {}
        for rank, seen in samples.items():
            if len(seen) >= 2 and seen[-1][1] > seen[0][1]:
                rates[rank] = (seen[-1][0] - seen[0][0]) / (seen[-1][1] - seen[0][1])
        if len(rates) < 2:
            return []
        lockstep = _lockstep(samples, rates)
        if lockstep is not None:
            step_s, lags = lockstep
            last = max(lags.values())  # the others wait that long, less their own lag, in the collective
            busy = {rank: max(step_s - (last - lag), BUSY_FLOOR * step_s) for rank, lag in lags.items()}
            return self._judge(busy, lambda rank, value, median: Straggler(rank, value, median, step_s, lags[rank]))
        return self._judge(rates, Straggler)

    def _judge(self, values: dict[int, float], make) -> list[Straggler]:
        """Each rank against the median of the OTHER ranks (two ranks suffice)."""
        new = []
        for rank, value in values.items():
            median = statistics.median(v for k, v in values.items() if k != rank)
            slow = median > 0 and value > self.rule.factor * median
            self.slow_streak[rank] = self.slow_streak.get(rank, 0) + 1 if slow else 0
            if self.slow_streak[rank] >= self.rule.windows and rank not in self.reported:
                self.reported.add(rank)
                new.append(make(rank, value, median))
        return new


def _lockstep(samples: dict[int, list[tuple[float, int]]],
              rates: dict[int, float]) -> tuple[float, dict[int, float]] | None:
    """(a step's time, rank -> how much later than the earliest rank it reaches each step) when
    the ranks go in lockstep (one pace, less than a step apart); None when they do not. The
    step's time is the median over the reference rank's samples: a pause every rank shares (a
    checkpoint, an evaluation) is no one's compute."""
    pace = statistics.median(rates.values())
    if pace <= 0 or any(abs(rate - pace) > LOCKSTEP_TOLERANCE * pace for rate in rates.values()):
        return None
    ref = max(rates, key=lambda rank: (len(samples[rank]), -rank))  # the densest samples interpolate best
    curve = sorted({step: at for at, step in reversed(samples[ref])}.items())  # step -> its first time
    step_s = statistics.median((t2 - t1) / (s2 - s1) for (s1, t1), (s2, t2) in zip(curve, curve[1:]))
    if step_s <= 0:
        return None
    offsets = {}
    for rank in rates:
        offsets[rank] = statistics.median(at - _arrival(curve, step, step_s) for at, step in samples[rank])
    first = min(offsets.values())
    lags = {rank: offset - first for rank, offset in offsets.items()}
    if max(lags.values()) > (1 + LOCKSTEP_TOLERANCE) * step_s:
        return None  # more than a step apart: not one collective per step (or clocks far apart)
    return step_s, lags


def _arrival(curve: list[tuple[int, float]], step: int, pace: float) -> float:
    """When the reference rank reached `step`: between its samples linearly, beyond them at `pace`."""
    i = bisect.bisect_left(curve, (step, -math.inf))
    if i < len(curve) and curve[i][0] == step:
        return curve[i][1]
    if 0 < i < len(curve):
        (s1, t1), (s2, t2) = curve[i - 1], curve[i]
        return t1 + (step - s1) * (t2 - t1) / (s2 - s1)
    s0, t0 = curve[0] if i == 0 else curve[-1]
    return t0 + (step - s0) * pace
