"""When a wrapped job hangs, which node to blame, and which rank straggles (DESIGN: "Progress and hangs").

The wrapper samples its progress signals (the ranks' `trainer.progress`, the checkpoint
directory, the job's output file) and tells `StallWatch` each time one moved. No move for
the limit is a hang:

- before the first progress after start: `first_progress_s` (a restore and a slow first step
  are not hangs);
- then `timeout_s` when set (> 0): silence alone is a hang (`0` turns the rule off);
- `-1` (default): a hang is shown by evidence, and activity only extends the limit. The short
  limit is `factor` x the longest gap seen between two progresses, within [floor, ceiling]
  (learned only from the ranks' own `trainer.progress`: a job that sent none gets the ceiling).
  Past it, the job is hung when the evidence says no rank can go on (`Evidence`): a rank
  stopped (`T`, never a tracer's `t`), gone or a zombie; or every rank's stack unchanged
  across the samples of the silence (`stacks_verdict`: waiting in a collective, a barrier,
  a sleep). A rank whose stack moves is running (rank 0 evaluating while the others wait at
  a barrier): the limit becomes the ceiling, never more. Without stacks (no py-spy, no ptrace
  rights) the limit is never below `blind_floor_s` (15 minutes: past PyTorch's own NCCL collective
  timeout of 10, so that fires first on a collective hang, and a 10-minute silent phase stays). A rank inside an announced phase (`trainer.phase`, until its expected time) keeps
  the job from being silent. CPU time is no evidence either way.

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
# A rank that cannot go on. Never `t` (stopped by a tracer): a stack sample (py-spy), a debugger
# or strace stops a rank for moments, and sampling must never make the evidence it reads.
STOPPED_STATES = {"T": "process stopped (T)", "Z": "process is a zombie (Z)", "gone": "process gone"}


@dataclass(frozen=True)
class StallRule:
    timeout_s: float = ADAPTIVE
    first_progress_s: float = 1800.0
    factor: float = 5.0
    floor_s: float = 120.0
    ceiling_s: float = 1800.0
    blind_floor_s: float = 900.0  # adaptive, without stacks: never a hang sooner
    samples: int = 3  # stack samples of a silence before "every rank still" is evidence

    @property
    def off(self) -> bool:
        return self.timeout_s == OFF

    @property
    def adaptive(self) -> bool:
        return self.timeout_s < 0


@dataclass(frozen=True)
class Evidence:
    """What the hang watch saw of the ranks during the current silence (hang/monitor.py)."""
    stopped: str = ""  # a rank that cannot go on (STOPPED_STATES), in words; "" none
    stacks: str = ""  # stacks_verdict: "still" | "moving" | "blind" | "" (not sampled enough yet)
    detail: str = ""  # what the stacks showed, in words
    phase: str = ""  # a rank inside an announced phase within its expected time, in words; "" none


def stacks_verdict(samples: list[dict[int, str | None]], ranks: set[int], needed: int) -> tuple[str, str]:
    """(verdict, words) from stack samples of one silence, each {rank: its main thread's frames,
    None when that rank's stack could not be read}. "moving": a rank's stack changed between two
    samples; "still": every rank of `ranks` read in at least `needed` samples, none changed;
    "blind": no rank's stack could be read at all; "" otherwise (not enough samples yet, or
    some ranks unread: never "still" on part of the job)."""
    seen: dict[int, list[str]] = {}
    for sample in samples:
        for rank, frames in sample.items():
            if frames is not None:
                seen.setdefault(rank, []).append(frames)
    for rank, frames in sorted(seen.items()):
        if len(set(frames)) > 1:
            top = frames[-1].splitlines()[0] if frames[-1] else "?"
            return "moving", f"rank {rank}'s stack moved across {len(frames)} samples (now in {top})"
    if len(samples) >= needed and not seen:
        return "blind", f"no rank's stack could be read in {len(samples)} samples"
    if ranks and all(len(seen.get(r, ())) >= needed for r in ranks):
        tops = sorted({f[0].splitlines()[0] if f[0] else "?" for f in seen.values()})
        return "still", (f"every rank's stack unchanged across {min(len(f) for f in seen.values())} samples "
                         f"(in {'; '.join(tops)[:200]})")
    unread = sorted(r for r in ranks if len(seen.get(r, ())) < needed)
    if len(samples) >= 2 * needed and unread:
        return "blind", f"the stacks of rank(s) {', '.join(map(str, unread[:8]))} could not be read"
    return "", ""


class StallWatch:
    """The stall rule's state for one attempt."""

    def __init__(self, rule: StallRule, started: float):
        self.rule = rule
        self.started = started
        self.last: float | None = None  # the last progress (None: none since start)
        self.longest_gap = 0.0
        self.what = ""  # the signal that moved last
        self.ranks_reported = False  # a rank's own progress() seen: adaptive may learn from the gaps

    def progressed(self, now: float, what: str = "", *, ranks: bool | None = None, learn: bool = True) -> None:
        """A signal moved; `ranks` (default: `what` is one of RANK_SIGNALS) says a rank's own
        progress was among the signals that moved; `learn=False`: the gap it ends is no pace
        (a phase's start or end: its length is the phase's, not a step's)."""
        if self.last is not None and learn:
            self.longest_gap = max(self.longest_gap, now - self.last)
        self.last = now
        self.what = what or self.what
        self.ranks_reported = self.ranks_reported or (what in RANK_SIGNALS if ranks is None else ranks)

    def limit(self) -> float | None:
        """The short limit: seconds without progress past which evidence (or, with an explicit
        `timeout_s`, silence alone) makes a hang; None when the rule is off."""
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

    def silence(self, now: float) -> float:
        return now - (self.started if self.last is None else self.last)

    def stalled(self, now: float, evidence: Evidence | None = None) -> str:
        """Why this is a hang ("" when it is not). `evidence`: what the ranks show now (adaptive
        rule only; None: nothing known, as "not sampled enough yet")."""
        limit = self.limit()
        if limit is None:
            return ""
        ev = evidence or Evidence()
        since = self.silence(now)
        if ev.phase or since < limit:
            return ""
        if self.last is None:
            return f"no progress {since:.0f} s after start (first-progress limit {limit:g} s)"
        rule = self.rule
        if rule.timeout_s > 0:
            return f"no progress for {since:.0f} s (limit {limit:g} s; last: {self.what or 'progress'})"
        if not self.ranks_reported:
            how = "adaptive: no trainer.progress from the ranks, so the ceiling"
        elif ev.stopped or ev.stacks == "still":
            how = f"adaptive: {rule.factor:g} x the longest gap {self.longest_gap:.0f} s; evidence: {ev.stopped or ev.detail}"
        else:
            blind = ev.stacks == "blind"
            limit = max(limit, rule.blind_floor_s) if blind else rule.ceiling_s
            if since < limit:
                return ""
            how = (f"adaptive, no stacks to show the ranks stuck ({ev.detail or 'none read'}): the "
                   f"{rule.blind_floor_s:g} s floor" if blind and limit < rule.ceiling_s else
                   f"adaptive: the ceiling{'; ' + ev.detail if ev.detail else ''}")
        return f"no progress for {since:.0f} s (limit {limit:g} s, {how}; last: {self.what or 'progress'})"


@dataclass(frozen=True)
class RankState:
    """One rank as the evidence saw it: its process state ("R", "S", "D", "T", "Z", "gone", "?")."""
    rank: int
    node: str
    pid: int
    state: str
    step: int | None = None
    last_at: float | None = None  # its last progress (wall clock), None when it never reported


def in_collective(frames: str | None) -> bool:
    """A rank's main-thread frames (hang/samples.main_frames) inside torch.distributed: waiting in
    a collective or a barrier."""
    return bool(frames) and ("torch/distributed/" in frames or "distributed_c10d" in frames)


def suspect(ranks: list[RankState], gpu_faults: dict[str, str] | None = None,
            first_gap_s: float = 10.0, frames: dict[int, str | None] | None = None) -> tuple[str, str]:
    """(node, detail) of the node the evidence points at, ("", why none) when it names none.

    A rank stopped, a zombie or gone names its node; then a GPU fault on one node; then, when
    the ranks span several nodes, the ranks stuck outside the collective every other rank waits
    in (`frames`: their last stack sample), all on one node; then the rank whose progress
    stopped first by more than `first_gap_s` (on one node every rank is on it: that says
    nothing about the node)."""
    for r in sorted(ranks, key=lambda r: r.rank):
        if r.state in STOPPED_STATES:
            return r.node, f"rank {r.rank} stopped at step {_step(r)} ({STOPPED_STATES[r.state]}, pid {r.pid})"
    faults = {n: f for n, f in (gpu_faults or {}).items() if f}
    if len(faults) == 1:
        node, fault = next(iter(faults.items()))
        return node, f"GPU fault under the hung job ({fault})"
    if frames and len({r.node for r in ranks}) > 1:
        waiting = [r for r in ranks if in_collective(frames.get(r.rank))]
        outside = [r for r in ranks if frames.get(r.rank) and not in_collective(frames.get(r.rank))]
        if waiting and outside and len(waiting) + len(outside) == len(ranks) and len({r.node for r in outside}) == 1:
            r = min(outside, key=lambda r: r.rank)
            top = (frames.get(r.rank) or "?").splitlines()[0]
            return r.node, (f"rank {r.rank} stuck outside the collective the other ranks wait in "
                            f"(at {top}, step {_step(r)})")[:150]
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
