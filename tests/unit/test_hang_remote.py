"""A multi-node job's hang watch without Slurm: ranks' progress files that name their node, the
other nodes' ranks as their agents report them (sync rounds, the evidence round), and the
batch step's monitor naming a suspect on another node, or counting a hang that names none.
Process states come from a fake /proc (a stopped rank on "node 2" is a `T` in its stat file).
The same on the real cluster: tests/cluster/test_hang_multinode.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

from slurmagent.hang import remote
from slurmagent.hang.monitor import HangMonitor
from slurmagent.policy.stall import StallRule
from slurmagent.run.agent_reports import NodeReport
from slurmagent.state import progress


def fake_proc(root: Path, states: dict[int, str]) -> str:
    """A /proc holding `pid -> state letter` (session 1)."""
    for pid, state in states.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(f"{pid} (python a) {state} 1 1 1 0 -1\n")
        (root / str(pid) / "cmdline").write_bytes(b"python\0train.py\0")
    return str(root)


def rank_file(directory: Path, rank: int, step: int, at: float, pid: int, node: str = "") -> None:
    directory.mkdir(exist_ok=True)
    (directory / f"rank-{rank}").write_text(f"{step} {at:.3f} {pid}{' ' + node if node else ''}\n")


def test_a_rank_file_names_its_node_and_each_node_reads_only_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(progress.os, "getpid", lambda: 4242)
    progress.write(tmp_path, 0, 5, 10.0, "n1")
    progress.write(tmp_path, 1, 7, 11.0, "n2")
    rank_file(tmp_path, 2, 3, 12.0, 77)  # written before files named their node: the reader's own
    ranks = progress.read_all(tmp_path)
    assert ranks[1] == progress.RankProgress(1, 7, 11.0, 4242, "n2")
    assert [r for r, p in ranks.items() if p.on("n2")] == [1, 2]
    proc = fake_proc(tmp_path / "proc", {4242: "T"})
    assert remote.node_ranks(tmp_path, "n2", proc) == [
        {"rank": 1, "node": "n2", "pid": 4242, "state": "T", "step": 7, "last_at": 11.0},
        {"rank": 2, "node": "n2", "pid": 77, "state": "gone", "step": 3, "last_at": 12.0}]


def report(node: str, index: int, ranks: list, ok: bool = True) -> NodeReport:
    return NodeReport.from_payload(NodeReport(index=index, node=node, ok=ok, ranks=ranks).payload())


def test_sync_reports_of_other_nodes_are_their_ranks_progress(tmp_path):
    now = [100.0]
    rr = remote.RemoteRanks("n1", tmp_path / "p", tmp_path / "ck", clock=lambda: now[0])
    one = {"rank": 1, "node": "n2", "pid": 9, "state": "S", "step": 7, "last_at": 50.0}
    rr.take([report("n1", 0, [dict(one, rank=0)]),  # the batch node's own ranks are read locally
             report("n2", 1, [one, {"rank": "x"}, "junk", dict(one, rank=-3)]),
             report("n3", 2, [dict(one, rank=2)], ok=False)])  # a failed round says nothing
    assert rr.progress() == {1: (7, 50.0)}
    rr.take([report("n2", 1, [dict(one, step=8, last_at=51.0)])])
    assert rr.progress() == {1: (8, 51.0)}


def test_the_evidence_round_takes_each_nodes_ranks_stacks_and_gpu_and_names_a_silent_node(tmp_path):
    proc = fake_proc(tmp_path / "proc", {501: "T"})
    rank_file(tmp_path / "p", 1, 40, 90.0, 501, "n2")
    payload = remote.node_evidence(tmp_path / "p", "n2", 1, proc=proc, py_spy=lambda pids: {p: f"stack of {p}" for p in pids},
                                   gpu_state=lambda: ('{"node": "n2"}', ""))
    asked = []
    rr = remote.RemoteRanks("n1", tmp_path / "p", tmp_path / "ck", clock=lambda: 200.0,
                            ask=lambda args, deadline: asked.append(args) or {1: payload, 2: b"not json"})
    rr.seen_at["n3"] = 140.0  # n3 reported rank 2 in its last sync round, then nothing
    rr.ranks[2] = remote.RankState(2, "n3", 8, "S", 39, 89.0)
    ev = rr.evidence()
    assert asked and asked[0][0] == "evidence"
    assert [(r.rank, r.node, r.state, r.step) for r in ev.ranks] == [(1, "n2", "T", 40), (2, "n3", "S", 39)]
    assert ev.dumps == {1: "stack of 501"} and ev.gpu == {"n2": ('{"node": "n2"}', "")}
    assert ev.notes == ["n3: no evidence from its agent; its ranks as its last sync report said 60 s ago"]


class Child:
    pid = 999_999  # no such session: no local process listed


def monitor(tmp_path, now, rr, **kw) -> HangMonitor:
    return HangMonitor(StallRule(timeout_s=10, first_progress_s=30), progress_dir=tmp_path / "p", ckpt_dir=tmp_path / "ck",
                       node="n1", job="7", attempt=0, poll_s=1, clock=lambda: now[0], out_fds=(), remote=rr,
                       proc=str(tmp_path / "proc"), gpu_state=lambda: ("{}", ""),
                       py_spy=lambda pids: {p: "local stack" for p in pids}, **kw)


def test_a_rank_stopped_on_another_node_is_that_nodes_drain_asked_from_the_batch_node(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    now, said, drains, counts = [0.0], [], [], []
    fake_proc(tmp_path / "proc", {300: "S", 501: "T"})
    rank_file(tmp_path / "p", 0, 40, 90.0, 300, "n1")
    rank_file(tmp_path / "p", 1, 99, 90.0, 501, "n2")  # a shared path: n2's rank is its agent's, not ours
    far = remote.node_evidence(tmp_path / "p", "n2", 1, proc=str(tmp_path / "proc"),
                               py_spy=lambda pids: {p: f"n2's stack of pid {p}" for p in pids}, gpu_state=lambda: ("{}", ""))
    rr = remote.RemoteRanks("n1", tmp_path / "p", tmp_path / "ck", clock=lambda: now[0], ask=lambda a, d: {1: far})
    mon = monitor(tmp_path, now, rr, say=said.append, ask_drain=lambda node, d, pid: drains.append((node, d, pid)) or "granted",
                  ask_count=lambda d: counts.append(d) or "counted")
    assert mon.poll(Child) == ""
    for t in range(1, 30):  # only node 2's rank moves (its sync reports, until 20 s): progress, on our clock
        now[0] = float(t)
        if t % 5 == 0 and t <= 20:
            rr.take([report("n2", 1, [{"rank": 1, "node": "n2", "pid": 501, "state": "S", "step": t, "last_at": 1.0}])])
        assert mon.poll(Child) == "", t
    now[0] = 30.0
    cause = mon.poll(Child)
    assert cause.startswith("hang: no progress for 10 s (limit 10 s; last: progress on other nodes)"), cause
    mon.stop(Child)
    assert drains == [("n2", "rank 1 stopped at step 99 (process stopped (T), pid 501)", 501)] and counts == []
    assert mon.suspect_node == "n2"
    folder = tmp_path / "slurmagent-7.hang-0"
    ranks = json.loads((folder / "ranks.json").read_text())
    assert [(r["rank"], r["node"], r["state"]) for r in ranks] == [(0, "n1", "S"), (1, "n2", "T")]
    assert {"gpu-n1.json", "gpu-n2.json", "py-spy-rank-0.txt", "py-spy-rank-1.txt"} <= {p.name for p in folder.iterdir()}
    # each rank's stack as its own node dumped it: rank 0 here (pid 300), rank 1 by n2's agent (pid 501)
    assert (folder / "py-spy-rank-0.txt").read_text() == "local stack"
    assert (folder / "py-spy-rank-1.txt").read_text() == "n2's stack of pid 501"
    assert "drain of n2 asked: granted" in said[0] and "rank 1 on n2 T step 99" in said[0]


def test_a_hang_that_points_at_no_node_drains_none_and_counts_against_none(tmp_path, monkeypatch):
    """Before: a blameless hang was counted against every node of the job (lemon counts of healthy nodes)."""
    monkeypatch.chdir(tmp_path)
    now, said, drains, counts = [0.0], [], [], []
    fake_proc(tmp_path / "proc", {300: "S", 501: "S"})
    rank_file(tmp_path / "p", 0, 40, 90.0, 300, "n1")
    rank_file(tmp_path / "p", 1, 40, 91.0, 501, "n2")
    far = remote.node_evidence(tmp_path / "p", "n2", 1, proc=str(tmp_path / "proc"), py_spy=lambda pids: {},
                               gpu_state=lambda: ("{}", ""))
    rr = remote.RemoteRanks("n1", tmp_path / "p", tmp_path / "ck", clock=lambda: now[0], ask=lambda a, d: {1: far})
    mon = monitor(tmp_path, now, rr, say=said.append, ask_drain=lambda node, d, pid: drains.append(node) or "granted",
                  ask_count=lambda node, d, pid: counts.append(d) or "granted: counted against n1")
    mon.poll(Child)
    now[0] = 31.0
    assert mon.poll(Child).startswith("hang: no progress 31 s after start")
    mon.stop(Child)
    assert drains == [] and counts == []
    assert "no node to blame: none drained, no hang counted" in said[0]


def test_a_straggler_on_another_node_is_reported_with_that_node(tmp_path):
    from slurmagent.policy.stall import StragglerRule

    now, said, reported = [0.0], [], []
    (tmp_path / "p").mkdir()
    rr = remote.RemoteRanks("n1", tmp_path / "p", tmp_path / "ck", clock=lambda: now[0])
    mon = monitor(tmp_path, now, rr, say=said.append, straggler=StragglerRule(window_s=10, factor=2.0, windows=3),
                  straggler_report=lambda rank, detail, node: reported.append((rank, node)))
    for t in range(0, 60):
        now[0] = float(t)
        progress.write(tmp_path / "p", 0, t, float(t), "n1")
        rr.take([report("n2", 1, [{"rank": 1, "node": "n2", "pid": 9, "state": "S", "step": t // 3, "last_at": float(t)}])])
        assert mon.poll(Child) == ""
    assert reported == [(1, "n2")]
    assert [s for s in said if s.startswith("straggler on node n2: rank 1 straggles")], said


def test_another_nodes_flight_recorder_is_asked_by_its_agent_and_said_in_the_evidence(tmp_path, monkeypatch):
    stem = str(tmp_path / "fr_")
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", stem)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "100")
    os.mkfifo(f"{stem}1.pipe")
    reader = os.open(f"{stem}1.pipe", os.O_RDONLY | os.O_NONBLOCK)
    try:
        proc = fake_proc(tmp_path / "proc", {501: "T"})
        rank_file(tmp_path / "p", 1, 40, 90.0, 501, "n2")
        payload = remote.node_evidence(tmp_path / "p", "n2", 1, proc=proc, py_spy=lambda pids: {},
                                       gpu_state=lambda: ("{}", ""))
        assert os.read(reader, 16) == b"1\n"
    finally:
        os.close(reader)
    rr = remote.RemoteRanks("n1", tmp_path / "p", tmp_path / "ck", clock=lambda: 200.0,
                            ask=lambda args, deadline: {1: payload})
    assert f"rank 1: dump asked through {stem}1.pipe" in rr.evidence().flight["n2"]


def test_a_drain_root_refuses_for_want_of_its_own_evidence_becomes_a_count_of_the_hang(tmp_path, monkeypatch):
    """Root drains only on what it sees itself (actions/root_evidence.py): a rank the wrapper saw
    stopped that root finds running again, say. Then the hang still counts against every node."""
    monkeypatch.chdir(tmp_path)
    now, said, drains, counts = [0.0], [], [], []
    fake_proc(tmp_path / "proc", {300: "S", 501: "T"})
    rank_file(tmp_path / "p", 0, 40, 90.0, 300, "n1")
    rank_file(tmp_path / "p", 1, 99, 90.0, 501, "n2")
    far = remote.node_evidence(tmp_path / "p", "n2", 1, proc=str(tmp_path / "proc"), py_spy=lambda pids: {},
                               gpu_state=lambda: ("{}", ""))
    rr = remote.RemoteRanks("n1", tmp_path / "p", tmp_path / "ck", clock=lambda: now[0], ask=lambda a, d: {1: far})
    refused = "refused: root sees no fault on n2 (pid 501 is running (S), no GPU fault): a job's word alone drains nothing"
    mon = monitor(tmp_path, now, rr, say=said.append, ask_drain=lambda node, d, pid: drains.append(pid) or refused,
                  ask_count=lambda node, d, pid: counts.append((node, pid)) or "granted: counted against n2")
    mon.poll(Child)
    now[0] = 31.0
    assert mon.poll(Child)
    mon.stop(Child)
    assert drains == [501] and counts == [("n2", 501)]  # against the node the evidence named, with its rank
    assert f"drain of n2 asked: {refused}; the hang counted against n2 instead: granted: counted against n2" in said[0]
