"""Whose files a multi-node job starts from, on the local cluster with node-local disks: a
`--ckpt-dir` another user planted on a node that is not the batch host is refused by that
node's agent, the requeue hold on every rank's PATH runs nothing another user planted on the
other nodes, and a first run on nodes holding an earlier job's files starts empty everywhere.

Another user is `nobody`; it acts on a node's local disk (made world-writable and sticky, as a
shared `/mnt/localssd` or `/tmp` is) through a directory handle opened for it, since the
cluster's root lies under pytest's private temp directory."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from support import uncommitted_tree, wait_for
from test_multinode import (RANKS, committed, committed_file, ledger, nodes_of,
                            starts, submit, wait_end)
from test_wrapper_hardening import NOBODY, as_user

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

OLD = {"rank0.json": '{"rank": 0, "step": 7}', "rank1.json": '{"rank": 1, "step": 7}',
       ".metadata": '{"world": 2, "step": 7}', "step_300/shard0": "old shard"}


@pytest.fixture
def shared_disks(cl):
    """Every node's local disk writable by every user (sticky), as a shared `/mnt/localssd` is."""
    for n in cl.nodes:
        cl.node_dir(n).chmod(0o1777)
    yield cl
    for n in cl.nodes:
        cl.node_dir(n).chmod(0o755)


def as_nobody_on(c, node: str, fn) -> str:
    """`fn(fd)` as nobody, `fd` a handle on `node`'s local disk; what it raised, '' when nothing."""
    fd = os.open(c.node_dir(node), os.O_RDONLY | os.O_DIRECTORY)
    try:
        return as_user(NOBODY, fn, fd)
    finally:
        os.close(fd)


def make_dirs(fd: int, parts: tuple[str, ...]) -> int:
    for part in parts:
        try:
            os.mkdir(part, 0o777, dir_fd=fd)
        except FileExistsError:
            pass
        fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        try:
            os.fchmod(fd, 0o777)
        except PermissionError:
            pass
    return fd


def write_at(fd: int, name: str, text: str, mode: int = 0o644) -> None:
    f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode, dir_fd=fd)
    os.write(f, text.encode())
    os.fchmod(f, mode)
    os.close(f)


def tree(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_ckpt_dir_planted_on_a_node_that_is_not_the_batch_host_is_refused_by_its_agent(shared_disks, emu,
                                                                                          tmp_path):
    c = shared_disks
    assert as_nobody_on(c, "n2", lambda fd: write_at(make_dirs(fd, ("ckpt",)), "model.pt", "planted")) == ""
    (tmp_path / "ledger").mkdir()
    held = [n for n in c.nodes if n not in ("n1", "n2")]  # the job lands on n1 (batch host) and n2
    c.run(["scontrol", "update", f"nodename={','.join(held)}", "state=drain", "reason=test: hold"])
    try:
        job = submit(c, tmp_path, emu.url, [], [sys.executable, RANKS, "20", str(tmp_path / "ledger"), "0.05"])
        out = tmp_path / "out"
        wait_for(lambda: out.exists() and "refusing" in out.read_text() or c.job(job)["JobState"] in (
            "COMPLETED", "FAILED"), 120, "the refusal or the end")
        c.run(["scancel", job], check=False)
    finally:
        c.resume(*held)
    text = out.read_text()
    assert c.job(job)["BatchHost"] == "n1", c.job(job)
    assert f"refusing checkpoint dir {c.local_path}/ckpt: owned by uid {NOBODY}" in text, text
    assert "n2 (node index 1)" in text, text
    assert ledger(tmp_path, 0) == [] and ledger(tmp_path, 1) == []  # no rank ever started
    assert tree(c.node_dir("n2") / "ckpt") == {"model.pt": "planted"}  # nothing read from or written there
    assert committed(job) is None


SCONTROL_RANK = """
import os, shutil, subprocess, sys, time
go, out = sys.argv[1], sys.argv[2]
open(os.path.join(out, "started" + os.environ["SLURM_PROCID"]), "w").close()
deadline = time.time() + 90
while not os.path.exists(go) and time.time() < deadline:
    time.sleep(0.1)
p = subprocess.run(["scontrol", "--version"], capture_output=True, text=True, timeout=30)
with open(os.path.join(out, "rank" + os.environ["SLURM_PROCID"] + ".txt"), "w") as fh:
    fh.write(f"{shutil.which('scontrol')}\\n{p.returncode}\\n{p.stdout}")
"""


def test_the_requeue_hold_on_every_ranks_path_runs_nothing_planted_on_another_node(shared_disks, emu, tmp_path):
    c = shared_disks
    go, mark = tmp_path / "go", tmp_path / "MARK"
    # TMPDIR on each node's own disk, as on real VMs: the hold exists on the batch host only
    job = submit(c, tmp_path, emu.url, [], [sys.executable, "-c", SCONTROL_RANK, str(go), str(tmp_path)],
                 TMPDIR=str(c.local_path))
    wait_for(lambda: all((tmp_path / f"started{r}").exists() for r in (0, 1)), 90, "both ranks")
    batch = c.job(job)["BatchHost"]
    (other,) = set(nodes_of(c, job)) - {batch}
    root = c.node_dir(batch)
    hold = wait_for(lambda: next(iter([*root.glob("slurmagent-hold-*"), *root.glob("slurmagent-*/slurmagent-hold-*")]),
                                 None), 60, "the requeue hold on the batch host")
    parts = hold.relative_to(root).parts
    # the worst case: nobody knows the hold's name and plants a `scontrol` at that path on the other node
    planted = as_nobody_on(c, other, lambda fd: write_at(make_dirs(fd, parts), "scontrol",
                                                         f"#!/bin/sh\ntouch {mark}\necho planted\n", 0o755))
    go.touch()
    end = wait_end(c, job, 120)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED", out
    assert not mark.exists(), "another user's scontrol ran as the job's user"
    assert "PermissionError" in planted, planted  # the path is the job user's own, private, on that node too
    for rank in (0, 1):
        where, rc, version = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 2)
        assert rc == "0" and version.startswith("slurm") and "planted" not in version, (rank, where, version)


def test_a_first_run_on_nodes_holding_an_earlier_jobs_files_starts_empty_on_every_node(cl, emu, tmp_path):
    for n in cl.nodes:  # an earlier job of the same user left its checkpoint on every node's disk
        for rel, text in OLD.items():
            (cl.node_dir(n) / "ckpt" / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            (cl.node_dir(n) / "ckpt" / rel).write_text(text)
    (tmp_path / "ledger").mkdir()
    job = submit(cl, tmp_path, emu.url, [], [sys.executable, RANKS, "30", str(tmp_path / "ledger"), "0.02"])
    end = wait_end(cl, job, 120)
    out = (tmp_path / "out").read_text()
    assert end["JobState"] == "COMPLETED", out
    for rank in (0, 1):
        (first,) = starts(ledger(tmp_path, rank))
        assert first["resumed"] == "0" and first["files"] == "", (rank, first)  # an empty directory
    for n in nodes_of(cl, job):
        assert uncommitted_tree(cl.node_dir(n) / "ckpt") == OLD, n
    manifest = committed(job)
    assert set(manifest["files"]) == {".metadata", "rank0.json", "rank1.json"}, manifest["files"]
    assert json.loads(committed_file(job, manifest, "rank1.json")) == {"rank": 1, "step": 30}
