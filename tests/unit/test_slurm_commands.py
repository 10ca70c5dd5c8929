"""Slurm seam without a cluster: hostlists, scontrol output parsing, reasons, argv, gres counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.fakes.slurm import FakeSlurm
from slurmagent.core import hostlist
from slurmagent.errors import SlurmError
from slurmagent.slurm.model import job_from_kv, node_from_kv, parse_kv
from slurmagent.core.reasons import MAX_REASON, clean_reason, make_reason
from slurmagent.slurm.commands import Slurm, expected_gpus_for, gpu_count_from_gres

# --- hostlist -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[01-03]", ["n01", "n02", "n03"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[1-3,7,9-10]", ["n1", "n2", "n3", "n7", "n9", "n10"]),
        ("a[1-2],b[3-4],login", ["a1", "a2", "b3", "b4", "login"]),
        ("gpu-a3-[0-1]", ["gpu-a3-0", "gpu-a3-1"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("", []),
    ],
)
def test_expand(expr: str, names: list[str]) -> None:
    assert hostlist.expand(expr) == names


@pytest.mark.parametrize(
    ("names", "expr"),
    [
        (["n1"], "n1"),
        (["n3", "n1", "n2"], "n[1-3]"),
        (["n1", "n2", "n2", "n3"], "n[1-3]"),
        (["n01", "n02", "n03"], "n[01-03]"),
        (["n1", "n2", "n3", "n7", "n9", "n10"], "n[1-3,7,9-10]"),
        (["b3", "a1", "login", "a2", "b4"], "a[1-2],b[3-4],login"),
        (["n1", "n3"], "n[1,3]"),
        ([], ""),
    ],
)
def test_compress(names: list[str], expr: str) -> None:
    assert hostlist.compress(names) == expr
    assert sorted(hostlist.expand(expr)) == sorted(set(names))


def test_zero_padding_round_trip() -> None:
    names = ["gpu007", "gpu008", "gpu009", "gpu010", "gpu011"]
    expr = hostlist.compress(names)
    assert hostlist.expand(expr) == names
    assert "gpu[007-011]" == expr


@pytest.mark.parametrize("expr", ["n[1-3", "n1-3]", "n[a-b]", "n[1-x]", "n[1,,3]", "n[-3]", "n[3-1]", "n[]",
                                  "n]1[", "n[[1]]", "n[1-2]]"])
def test_bad_hostlist_raises_value_error(expr: str) -> None:
    with pytest.raises(ValueError):
        hostlist.expand(expr)


names_st = st.lists(
    st.from_regex(r"[a-z]{1,3}(-[a-z]{1,2})?[0-9]{0,3}", fullmatch=True),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(names_st)
def test_compress_expand_property(names: list[str]) -> None:
    expr = hostlist.compress(names)
    expanded = hostlist.expand(expr)
    # every name exactly once (hostlist order is numeric, so compare as sorted lists)
    assert sorted(expanded) == sorted(set(names))
    assert len(expanded) == len(set(names))
    assert hostlist.compress(expanded) == expr
    assert hostlist.compress(hostlist.expand(hostlist.compress(expanded))) == expr


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 300), min_size=1, max_size=40), st.sampled_from(["n", "gpu-", "a3-"]),
       st.integers(0, 4))
def test_numeric_ranges_property(numbers: set[int], prefix: str, width: int) -> None:
    names = [prefix + str(n).zfill(width) for n in numbers]
    expr = hostlist.compress(names)
    assert sorted(hostlist.expand(expr)) == sorted(set(names))
    assert expr.count("[") <= 3  # at most one group per padding width


# --- scontrol output ------------------------------------------------------------------------

NODE_LINE = (
    "NodeName=gpu-3 Arch=x86_64 CoresPerSocket=26 CPUAlloc=0 CPUTot=208 Gres=gpu:h100:8 "
    "NodeAddr=gpu-3 NodeHostName=gpu-3 Version=23.11.4 OS=Linux 6.1.0 #1 SMP "
    "RealMemory=1800000 State=IDLE+DRAIN ThreadsPerCore=2 Partitions=a3 "
    "Reason=slurmagent: xid 79 on gpu 3 (fallen off the bus) [root@2026-11-30T05:00:01]"
)


def test_parse_kv_reason_with_spaces() -> None:
    kv = parse_kv(NODE_LINE)
    assert kv["NodeName"] == "gpu-3"
    assert kv["State"] == "IDLE+DRAIN"
    assert kv["Gres"] == "gpu:h100:8"
    assert kv["OS"] == "Linux 6.1.0 #1 SMP"
    assert kv["Reason"] == "slurmagent: xid 79 on gpu 3 (fallen off the bus) [root@2026-11-30T05:00:01]"


def test_node_from_kv_drops_user_time_suffix() -> None:
    node = node_from_kv(parse_kv(NODE_LINE))
    assert node.name == "gpu-3" and node.gres == "gpu:h100:8" and node.partitions == "a3"
    assert node.reason == "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
    assert node.drained and node.drained_by_slurmagent and not node.drained_by_other


# Verbatim from Slurm 24.11.5 (Debian 13): new fields (ResumeAfterTime, CPUEfctv), an empty
# AllocTRES, a double space before Reason.
NODE_LINE_24_11 = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=3.66 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 NodeHostName=vm "
    "Port=48557 Version=24.11.5 OS=Linux 6.18.44-fc-v782 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1000 "
    "AllocMem=0 FreeMem=6390 Sockets=2 Boards=1 State={state} ThreadsPerCore=1 TmpDisk=0 Weight=1 "
    "Owner=N/A MCS_label=N/A Partitions=gpu  BootTime=2026-11-30T18:32:36 SlurmdStartTime=2026-11-30T18:44:29 "
    "LastBusyTime=2026-11-30T18:44:31 ResumeAfterTime=None CfgTRES=cpu=2,mem=1000M,billing=2 AllocTRES= "
    "CurrentWatts=0 AveWatts=0  Reason=slurmagent: xid 79 on gpu 3 (fallen off the bus) [root@2026-11-30T18:44:30]"
)


@pytest.mark.parametrize(("state", "drained"), [("IDLE+DRAIN", True), ("MIXED+DRAIN", True),
                                                ("IDLE", False)])  # IDLE: 24.11 keeps a resumed node's Reason
def test_slurm_24_11_node_line(state, drained) -> None:
    kv = parse_kv(NODE_LINE_24_11.format(state=state))
    assert kv["State"] == state and kv["ResumeAfterTime"] == "None" and kv["SlurmdStartTime"] == "2026-11-30T18:44:29"
    n = node_from_kv(kv)
    assert n.name == "n1" and n.partitions == "gpu"
    assert n.reason == "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
    assert (n.drained, n.drained_by_slurmagent, n.drained_by_other) == (drained, drained, False)
    v = node_from_kv(kv)
    assert (v.ours, v.held_by_other, v.registered) == (drained, False, True)
    assert v.slurmd_start is not None and v.reason == n.reason


def test_slurm_24_11_job_line_padded_comment() -> None:
    kv = parse_kv(
        "JobId=1 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0 JobState=PENDING "
        "Reason=BeginTime Dependency=(null) Requeue=1 Restarts=1 BatchFlag=2 Reboot=0 ExitCode=0:54 "
        "Partition=gpu NodeList= NumNodes=1-1 ReqTRES=cpu=1,mem=1000M,node=1,billing=1 AllocTRES=(null) "
        "Comment=a  b  StdErr=/src/slurm-1.out StdIn=/dev/null StdOut=/src/slurm-1.out ")
    job = job_from_kv(kv)
    assert (job.state, job.reason, job.restarts, job.requeue, job.node_list) == ("PENDING", "BeginTime", 1, True, "")
    assert kv["Comment"] == "a  b" and kv["StdOut"] == "/src/slurm-1.out"


def node(state: str, reason: str = "(null)"):
    return node_from_kv(parse_kv(f"NodeName=n1 State={state} Reason={reason}"))


@pytest.mark.parametrize(
    ("state", "reason", "drained", "down", "ours", "other"),
    [
        ("IDLE", "(null)", False, False, False, False),
        ("IDLE+DRAIN", "slurmagent: gpu-lost: gpu 2", True, False, True, False),
        ("MIXED+DRAIN", "slurmagent: pcie-width: gpu 1 x8", True, False, True, False),
        ("IDLE+DRAIN", "disk replacement [admin@2026-11-30T01:00:00]", True, False, False, True),
        ("MIXED+DRAIN", "maintenance", True, False, False, True),
        ("DOWN*+DRAIN", "Not responding", True, True, False, True),
        ("DOWN*", "Not responding", False, True, False, True),
        ("DOWN+DRAIN", "slurmagent: xid 79 on gpu 0", True, True, True, False),
        ("ALLOCATED", "(null)", False, False, False, False),
        ("IDLE+DRAIN", "SLURMAGENT: spoofed case", True, False, False, True),
    ],
)
def test_node_flags_and_predicates(state, reason, drained, down, ours, other) -> None:
    n = node(state, reason)
    assert (n.drained, n.down, n.drained_by_slurmagent, n.drained_by_other) == (drained, down, ours, other)


def test_node_flags_split() -> None:
    assert node("DOWN*+DRAIN").flags == frozenset({"DOWN", "DRAIN"})
    assert node("IDLE+CLOUD+POWERED_DOWN").flags == frozenset({"IDLE", "CLOUD", "POWERED_DOWN"})
    assert node("IDLE").reason == ""


def test_job_from_kv() -> None:
    job = job_from_kv(parse_kv(
        "JobId=42 JobName=train UserId=u(1000) JobState=PENDING Reason=JobHeldAdmin Requeue=1 Restarts=2 "
        "BatchFlag=1 NodeList=(null) TimeLimit=1-00:00:00"))
    assert (job.job_id, job.state, job.restarts, job.requeue, job.held) == ("42", "PENDING", 2, True, True)


# --- drain reasons --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "evil",
    [
        "gpu 1 \"quoted\" and 'single'",
        "x $(reboot) y",
        "x `reboot` y",
        "line1\nline2\r\nState=RESUME",
        "a; scontrol update NodeName=ALL State=RESUME",
        "tab\there\x00nul\x1bescape",
        "unicode \u2026 \u00e9 \u202e",
    ],
)
def test_clean_reason_cannot_smuggle(evil: str) -> None:
    reason = make_reason("xid", evil)
    assert reason.startswith("slurmagent: xid: ")
    for bad in ('"', "'", "`", "$", "\n", "\r", "\t", "\x00", "\x1b", "=", "\u202e"):
        assert bad not in reason
    assert reason == " ".join(reason.split())  # single spaces, one line


def test_clean_reason_keeps_readable_text_and_bounds_length() -> None:
    assert clean_reason("slurmagent: xid 79 on gpu 3 (fallen off the bus)") == \
        "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
    assert len(make_reason("rule", "x" * 1000)) == MAX_REASON


# --- Slurm with a fake runner -----------------------------------------------------------------


def canned(*replies) -> FakeSlurm:
    """Slurm answering from canned (code, stdout, stderr) replies, or raising; then empty successes."""
    fake = FakeSlurm(["n1", "gpu-1", "gpu-2", "gpu-3"])
    fake.replies = list(replies) + [(0, "", "")] * 8
    return fake


def test_drain_many_nodes_is_one_call_with_hostlist() -> None:
    runner = canned()
    slurm = Slurm("/opt/slurm/bin/scontrol", timeout_s=7, runner=runner)
    slurm.drain(["gpu-3", "gpu-1", "gpu-2"], "slurmagent: xid 79 on gpu 3 (fallen off the bus)")
    assert len(runner.calls) == 1
    argv, timeout = runner.calls[0], runner.timeouts[0]
    assert timeout == 7
    assert argv == ["/opt/slurm/bin/scontrol", "update", "NodeName=gpu-[1-3]", "State=DRAIN",
                    "Reason=slurmagent: xid 79 on gpu 3 (fallen off the bus)"]


def test_drain_reason_is_one_argv_element_even_when_hostile() -> None:
    runner = canned()
    Slurm(runner=runner).drain(["n1"], "slurmagent: x\nState=RESUME $(id) 'q'")
    argv = runner.calls[0]
    assert len(argv) == 5
    reasons = [a for a in argv if a.startswith("Reason=")]
    assert len(reasons) == 1 and reasons[0].count("=") == 1
    assert "State=RESUME" not in reasons[0] and "\n" not in reasons[0]


def test_empty_node_lists_make_no_call() -> None:
    runner = canned()
    slurm = Slurm(runner=runner)
    slurm.drain([], "r")
    slurm.resume([])
    slurm.requeue([])
    assert runner.calls == []


def test_resume_and_requeue_argv() -> None:
    runner = canned()
    slurm = Slurm(runner=runner)
    slurm.resume(["n2", "n1"])
    slurm.requeue(["12", "13"])
    assert runner.calls == [
        ["scontrol", "update", "NodeName=n[1-2]", "State=RESUME"],
        ["scontrol", "requeue", "12,13"],
    ]


def test_timeout_propagates() -> None:
    runner = canned(SlurmError("scontrol update timed out after 10 s"))
    with pytest.raises(SlurmError, match="timed out"):
        Slurm(runner=runner).drain(["n1"], "slurmagent: x")


def test_failed_call_raises_with_scontrol_message() -> None:
    runner = canned((1, "", "slurm_update error: Invalid node name specified\n"))
    with pytest.raises(SlurmError, match="Invalid node name specified"):
        Slurm(runner=runner).drain(["nx"], "slurmagent: x")


def test_show_nodes_parses_every_line() -> None:
    out = NODE_LINE + "\n" + "NodeName=gpu-4 State=IDLE Reason=(null) Gres=gpu:8\n"
    runner = canned((0, out, ""))
    nodes = Slurm(runner=runner).nodes(["gpu-4", "gpu-3"])
    assert runner.calls[0] == ["scontrol", "-o", "show", "node", "gpu-[3-4]"]
    assert [(n.name, n.drained_by_slurmagent) for n in nodes] == [("gpu-3", True), ("gpu-4", False)]


def test_node_not_found() -> None:
    with pytest.raises(SlurmError, match="no such node"):
        Slurm(runner=canned((0, "", ""))).node("ghost")


def test_job_invalid_id_is_none() -> None:
    runner = canned((1, "", "slurm_load_jobs error: Invalid job id specified\n"))
    assert Slurm(runner=runner).job("99") is None


def test_run_argv_real_timeout() -> None:
    from slurmagent.slurm.commands import run_argv

    with pytest.raises(SlurmError, match="timed out"):
        run_argv(["sleep", "5"], timeout=0.2)
    with pytest.raises(SlurmError, match="cannot run"):
        run_argv(["/nonexistent/scontrol", "show"], timeout=1)


# --- expected GPUs from slurm.conf / gres.conf ----------------------------------------------


def write_conf(d: Path, slurm_conf: str, gres_conf: str | None = None, **extra: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "slurm.conf").write_text(slurm_conf)
    if gres_conf is not None:
        (d / "gres.conf").write_text(gres_conf)
    for name, text in extra.items():
        (d / name.replace("_", ".")).write_text(text)
    return d / "slurm.conf"


SLURM_CONF = """\
ClusterName=c  # comment
GresTypes=gpu
NodeName=gpu-[1-4] CPUs=208 RealMemory=1800000 Gres=gpu:h100:8 State=CLOUD
NodeName=cpu-[1-2] CPUs=8 State=CLOUD
PartitionName=a3 Nodes=gpu-[1-4] Default=YES
"""


def test_gres_from_slurm_conf_nodename_hostlist(tmp_path) -> None:
    conf = write_conf(tmp_path, SLURM_CONF)
    assert expected_gpus_for("gpu-3", conf) == 8
    assert expected_gpus_for("gpu-5", conf) is None
    assert expected_gpus_for("cpu-1", conf) is None


def test_gres_from_gres_conf_count(tmp_path) -> None:
    conf = write_conf(tmp_path, SLURM_CONF, "NodeName=gpu-[1-4] Name=gpu Type=h100 Count=4\n")
    assert expected_gpus_for("gpu-2", conf) == 4


def test_gres_from_gres_conf_file_range(tmp_path) -> None:
    conf = write_conf(tmp_path, SLURM_CONF, "Name=gpu Type=h100 File=/dev/nvidia[0-7]\n")
    assert expected_gpus_for("gpu-1", conf) == 8


def test_gres_conf_lines_for_other_nodes_are_ignored(tmp_path) -> None:
    conf = write_conf(tmp_path, SLURM_CONF,
                      "NodeName=gpu-[1-2] Name=gpu File=/dev/nvidia[0-3]\n"
                      "NodeName=gpu-[3-4] Name=gpu File=/dev/nvidia[0-1]\n"
                      "NodeName=gpu-[3-4] Name=gpu File=/dev/nvidia[2-3]\n")
    assert expected_gpus_for("gpu-1", conf) == 4
    assert expected_gpus_for("gpu-4", conf) == 4


def test_gres_with_include(tmp_path) -> None:
    conf = write_conf(tmp_path, "ClusterName=c\nInclude nodes.conf\n",
                      nodes_conf="NodeName=a3-[0-15] Gres=gpu:8(S:0-1),shard:16 State=CLOUD\n")
    assert expected_gpus_for("a3-12", conf) == 8


def test_gres_from_nodename_default(tmp_path) -> None:
    """`NodeName=DEFAULT Gres=...` sets the Gres of the node lines below it (slurm.conf(5))."""
    conf = write_conf(tmp_path, "NodeName=DEFAULT CPUs=208 Gres=gpu:8 State=UNKNOWN\n"
                                "NodeName=a3-[0-9] State=CLOUD\n"
                                "NodeName=DEFAULT Gres=\n"
                                "NodeName=c2-[0-1] State=CLOUD\n")
    assert expected_gpus_for("a3-4", conf) == 8
    assert expected_gpus_for("c2-1", conf) is None


def test_no_gpu_gres_is_none(tmp_path) -> None:
    conf = write_conf(tmp_path, "NodeName=n[1-3] CPUs=8 Gres=shard:4 State=CLOUD\n", "Name=shard Count=4\n")
    assert expected_gpus_for("n2", conf) is None
    assert expected_gpus_for("n2", tmp_path / "missing.conf") is None


@pytest.mark.parametrize(("gres", "count"), [("gpu:8", 8), ("gpu:h100:8", 8), ("gpu:h100:8(S:0-1),shard:4", 8),
                                             ("gpu", 1), ("gpu:a:2,gpu:b:2", 4), ("shard:4", None), ("", None)])
def test_gpu_count_from_gres(gres: str, count: int | None) -> None:
    assert gpu_count_from_gres(gres) == count


@pytest.mark.parametrize("text", ["2026-11-30T18:32:36", "2024-02-29T00:00:00", "2026-02-30T10:00:00",
                                  "2026-13-01T00:00:00", "2026-12-31T23:59:60", "2026-12-31T24:00:00",
                                  "2026-1-3T1:2:3", "2026-11-30T18:32:36 ", "0000-01-01T00:00:00", "Unknown", ""])
def test_slurm_times_read_without_strptime_as_strptime_reads_them(text) -> None:
    """The fast path for `YYYY-MM-DDTHH:MM:SS` (every node's times, twice per breaker drain)
    gives what strptime gives, an impossible date included (None)."""
    import time
    from datetime import datetime

    from slurmagent.core.timefmt import parse_slurm_time

    try:
        want = time.mktime(datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timetuple())
    except ValueError:
        want = None
    assert parse_slurm_time(text) == want
