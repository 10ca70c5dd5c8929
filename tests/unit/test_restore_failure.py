"""A restore that fails on a node's own disk requeues the job without that node; a restore
fits on a disk that held the previous version (staged in place, not beside it).

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_restore_failure_gcs.py.
"""

from __future__ import annotations


import pytest

from slurmagent.checkpoint.manifest import Manifest
from slurmagent.checkpoint.errors import NodeDiskError
from slurmagent.run.restore_failure import no_progress_streak
from slurmagent.run.job import JobIdentity


# --------------------------------------------------------------- the wrapper: requeued without the node


def test_the_no_progress_streak_of_an_attempt_that_could_not_restore():
    m = Manifest(attempt=2, no_progress=1)
    assert [no_progress_streak(m, r) for r in (3, 4, 5)] == [2, 3, 4]
    assert no_progress_streak(None, 0) == 1


def test_a_node_disk_error_of_the_agents_names_their_nodes():
    exc = NodeDiskError("restore failed on n3 (node index 1): ...", nodes=["n3"])
    from slurmagent.run.restore_failure import failed_nodes

    assert failed_nodes(exc, {"SLURMD_NODENAME": "n1"}) == ["n3"]
    assert failed_nodes(OSError(28, "No space left on device"), {"SLURMD_NODENAME": "n1"}) == ["n1"]
    assert failed_nodes(ConnectionResetError(104, "reset"), {"SLURMD_NODENAME": "n1"}) == []


def test_exclude_nodes_keeps_the_nodes_a_job_already_excludes():
    import subprocess as sp

    from slurmagent.errors import SlurmError
    from slurmagent.slurm.commands import Slurm

    calls = []

    def runner(argv, timeout):
        calls.append(argv)
        return sp.CompletedProcess(argv, 0, "n4\n" if argv[0] == "squeue" else "", "")

    slurm = Slurm(runner=runner)
    assert slurm.excluded_nodes("77") == ["n4"] and calls[-1][-2:] == ["-o", "%x"]
    assert slurm.exclude_nodes("77", ["n1"], keep=["n4"]) == ["n1", "n4"]
    assert calls[-1] == ["scontrol", "update", "JobId=77", "ExcNodeList=n[1,4]"]
    with pytest.raises(SlurmError):
        slurm.exclude_nodes("77", ["n1,n2"])  # never a hostlist smuggled in a name


def test_the_exclusion_is_tried_again_while_slurm_refuses_it_for_a_moment():
    from slurmagent.errors import SlurmError
    from slurmagent.run.restore_failure import exclude_with_retries

    answers = [SlurmError("scontrol update JobId=77: failed"), SlurmError("failed"), ["n1"]]

    def exclude(job, nodes):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    now = [0.0]
    assert exclude_with_retries(exclude, "77", ["n1"], sleep=lambda s: now.__setitem__(0, now[0] + s),
                                clock=lambda: now[0]) == ["n1"]
    with pytest.raises(SlurmError):  # never past its deadline
        exclude_with_retries(lambda j, n: (_ for _ in ()).throw(SlurmError("no")), "77", ["n1"], deadline_s=3,
                             sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])


def test_an_explicit_ckpt_dir_this_node_cannot_hold_is_left_to_the_restore_under_slurm(tmp_path):
    """A file where `--ckpt-dir` should be is this node's problem: a Slurm job gets as far as the
    restore (which requeues it without the node); a plain run is refused in one line. A refusal of
    another user's directory stays a refusal either way (tests/unit/test_ckpt_dirs.py)."""
    from slurmagent.state.config import Config
    from slurmagent.run.job import WrapperError
    from slurmagent.run.main import build_options

    bad = tmp_path / "ckpt"
    bad.write_text("not a directory")
    slurm_env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1", "TMPDIR": str(tmp_path)}
    opts = build_options(Config(), ["true"], slurm_env, JobIdentity.from_env(slurm_env), ckpt_dir=str(bad))
    assert opts.ckpt_dir == bad and bad.is_file()
    with pytest.raises(WrapperError, match="Not a directory"):
        build_options(Config(), ["true"], {"TMPDIR": str(tmp_path)}, JobIdentity.from_env({}), ckpt_dir=str(bad))
