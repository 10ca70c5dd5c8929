"""Stragglers in lockstep: ranks that meet in a collective every step all go at the slowest
rank's pace, so only when each rank reaches a step tells the straggler (policy/stall.py
StragglerWatch). A simulated data-parallel job on a fake clock: each rank computes, calls
`progress` (before or after the collective, at most one write a second like
`trainer.progress`), and the wrapper samples each rank's latest write every 2 s.
The same on the real cluster: tests/cluster/test_straggler_slurm.py."""

from __future__ import annotations

import bisect
import random

from slurmagent.hang import remote
from slurmagent.hang.monitor import HangMonitor
from slurmagent.policy.stall import StallRule, StragglerRule, StragglerWatch
from slurmagent.run.agent_reports import NodeReport
from slurmagent.state import progress

RULE = StragglerRule(window_s=10, factor=2.0, windows=3)
POLL_S = 2.0


def job(compute: dict[int, float], seconds: float, *, before: bool = True, comm: float = 0.005,
        jitter: float = 0.0, start: dict[int, float] | None = None, lockstep: bool = True,
        pause_every: float = 0.0, seed: int = 1) -> dict[int, list[tuple[float, int]]]:
    """Each rank's progress writes [(at, step)]: `compute` s per step (+- `jitter` of it), then,
    in lockstep, a collective that ends `comm` after the last rank reaches it, and every
    `pause_every` s a 3-s pause of every rank after it (a checkpoint)."""
    rng = random.Random(seed)
    writes: dict[int, list[tuple[float, int]]] = {r: [] for r in compute}
    due = dict.fromkeys(compute, 0.0)
    done = {r: (start or {}).get(r, 0.0) for r in compute}  # when each rank ends its previous step
    step = 0
    while min(done.values()) < seconds:
        arrive = {r: done[r] + c * (1 + rng.uniform(-jitter, jitter)) for r, c in compute.items()}
        if lockstep:
            end = max(arrive.values()) + comm
            if pause_every and int(end / pause_every) > int(min(done.values()) / pause_every):
                end += 3.0
            done = {r: end + rng.uniform(0, 0.0005) for r in compute}  # each rank leaves the collective
        else:
            done = arrive
        for r in compute:
            at = arrive[r] if before else done[r]
            if at >= due[r]:
                writes[r].append((round(at, 3), step))
                due[r] = at + 1.0
        step += 1
    return writes


def latest(writes: list[tuple[float, int]], t: float) -> tuple[float, int] | None:
    i = bisect.bisect_right(writes, (t, float("inf")))
    return writes[i - 1] if i else None


def watch(writes: dict[int, list[tuple[float, int]]], seconds: float, rule: StragglerRule = RULE) -> list:
    sw, found, t = StragglerWatch(rule), [], 0.0
    while t <= seconds:
        seen = {r: s for r, w in writes.items() if (s := latest(w, t)) is not None}
        found += [(t, f) for f in sw.observe(t, seen)]
        t += POLL_S
    return found


def test_in_lockstep_every_rank_goes_at_the_stragglers_pace():
    writes = job({0: 0.05, 1: 0.15, 2: 0.05, 3: 0.05}, 60)
    pace = {r: (w[-1][0] - w[0][0]) / (w[-1][1] - w[0][1]) for r, w in writes.items()}
    assert max(pace.values()) < 1.02 * min(pace.values())  # the rates alone can never tell it


def test_a_rank_computing_three_times_longer_in_lockstep_is_reported_within_the_windows():
    found = watch(job({0: 0.05, 1: 0.15, 2: 0.05, 3: 0.05}, 60), 60)
    assert [f.rank for _, f in found] == [1]
    t, f = found[0]
    assert t <= RULE.windows * RULE.window_s + POLL_S
    assert f.step_s is not None and 2.5 < f.value / f.median < 3.5  # busy ~0.155 s against ~0.055 s
    assert 0.08 < f.lag_s < 0.12  # it reaches each step 0.1 s after the others


def test_two_ranks_in_lockstep_one_three_times_slower():
    found = watch(job({0: 0.2, 1: 0.6}, 60, jitter=0.1), 60)
    assert [f.rank for _, f in found] == [1]


def test_progress_after_the_collective_reports_nothing():
    assert watch(job({0: 0.05, 1: 0.15, 2: 0.05, 3: 0.05}, 60, before=False), 60) == []


def test_jitter_in_lockstep_reports_nothing():
    for seed in range(5):
        assert watch(job({0: 0.1, 1: 0.1, 2: 0.1}, 90, jitter=0.5, seed=seed), 90) == [], seed
        assert watch(job({0: 0.3, 1: 0.3}, 90, jitter=0.5, seed=seed), 90) == [], seed


def test_a_pause_every_rank_shares_is_no_ones_compute():
    # a 3-s checkpoint every 12 s: in most windows; it would count as everyone's busy time
    found = watch(job({0: 0.1, 1: 0.3, 2: 0.1}, 90, jitter=0.2, pause_every=12), 90)
    assert [f.rank for _, f in found] == [1]
    assert watch(job({0: 0.1, 1: 0.1, 2: 0.1}, 90, jitter=0.5, pause_every=12), 90) == []


def test_a_rank_three_times_slower_without_a_collective_is_reported_by_its_rate():
    found = watch(job({0: 0.05, 1: 0.15, 2: 0.05}, 60, lockstep=False), 60)
    assert [f.rank for _, f in found] == [1]
    assert found[0][1].step_s is None and 2.5 < found[0][1].value / found[0][1].median < 3.5


def test_independent_ranks_at_one_pace_but_steps_apart_are_not_judged_in_lockstep():
    # same s/step, rank 1 started 5 s (50 steps) later: not one collective per step, nothing to say
    writes = job({0: 0.1, 1: 0.1, 2: 0.1}, 60, lockstep=False, start={1: 5.0})
    assert watch(writes, 60) == []


# --- through the wrapper's monitor: the node and rank said ------------------------------------------

class Child:
    pid = 1


def monitor(tmp_path, now, **kw) -> HangMonitor:
    (tmp_path / "p").mkdir()
    return HangMonitor(StallRule(timeout_s=30, first_progress_s=60), progress_dir=tmp_path / "p",
                       ckpt_dir=tmp_path / "ck", node="n1", job="5", attempt=0, poll_s=POLL_S,
                       clock=lambda: now[0], out_fds=(), straggler=RULE, **kw)


def test_a_straggler_in_lockstep_is_said_with_its_node_and_rank(tmp_path):
    writes = job({0: 0.05, 1: 0.05, 2: 0.15, 3: 0.05}, 60)
    now, said, reported = [0.0], [], []
    mon = monitor(tmp_path, now, say=said.append, straggler_report=lambda rank, detail, node: reported.append((rank, node)))
    t = 0.0
    while t <= 40:
        now[0] = t
        for r, w in writes.items():
            if (s := latest(w, t)) is not None:
                progress.write(tmp_path / "p", r, s[1], s[0], "n1")
        assert mon.poll(Child) == ""
        t += POLL_S
    assert reported == [(2, "n1")]
    line = [s for s in said if s.startswith("straggler on node n1: rank 2 straggles: busy ")]
    assert line and "in lockstep" in line[0], said


def test_a_straggler_in_lockstep_on_another_node_is_said_with_that_node(tmp_path):
    """Rank 1 on n2, seen only through its agent's sync reports (every 5 s)."""
    writes = job({0: 0.05, 1: 0.15}, 60)
    now, said, reported = [0.0], [], []
    rr = remote.RemoteRanks("n1", tmp_path / "p", tmp_path / "ck", clock=lambda: now[0])
    mon = monitor(tmp_path, now, remote=rr, say=said.append,
                  straggler_report=lambda rank, detail, node: reported.append((rank, node)))
    t = 0.0
    while t <= 50:
        now[0] = t
        if (s := latest(writes[0], t)) is not None:
            progress.write(tmp_path / "p", 0, s[1], s[0], "n1")
        if t % 5 == 0 and (s := latest(writes[1], t)) is not None:
            rank = {"rank": 1, "node": "n2", "pid": 9, "state": "S", "step": s[1], "last_at": s[0]}
            rr.take([NodeReport(index=1, node="n2", ok=True, ranks=[rank])])
        assert mon.poll(Child) == ""
        t += POLL_S
    assert reported == [(1, "n2")], said
    assert [s for s in said if s.startswith("straggler on node n2: rank 1 straggles: busy ")], said
