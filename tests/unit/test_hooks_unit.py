"""Prolog/Epilog decisions without a cluster: a fake scontrol, a fake health function."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, healthy_snapshot_dict, write_json, xid_snapshot_dict
from support.fakes.slurm import FakeSlurm
from slurmagent.actions import executor
from slurmagent.core.checks import Report, run_checks
from slurmagent.state.config import Config, parse
from slurmagent.state.decisionlog import read_records
from slurmagent.errors import ConfigError
from slurmagent.commands.hooks import HookContext, run_hook
from slurmagent.slurm.commands import Slurm
from slurmagent.core.snapshot import NodeSnapshot

XID79_REASON = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"


class Harness:
    def __init__(self, tmp_path: Path, **hooks_cfg):
        self.tmp = tmp_path
        conf = tmp_path / "slurm.conf"
        conf.write_text("ClusterName=c\nSchedulerParameters=nohold_on_prolog_fail,bf_continue\n")
        self.cfg = parse({
            "state_dir": str(tmp_path / "state" / "%n"),
            "hooks": {"syslog": False, **hooks_cfg},
            "slurm": {"conf": str(conf), "timeout_s": 3},
        }, "test")
        self.scontrol = FakeSlurm(stamp="2026-11-30T05:00:00")
        self.scontrol.add_job("42", "COMPLETING")
        self.factory_calls = 0
        self.stderr = io.StringIO()

    def slurm_factory(self, cfg: Config) -> Slurm:
        self.factory_calls += 1
        return Slurm("scontrol", cfg.slurm.timeout_s, runner=self.scontrol)

    def run(self, hook: str, report_or_exc, env: dict[str, str] | None = None, loader=None) -> int:
        ctx = HookContext.from_env(hook, {"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42", **(env or {})})

        def health(cfg, node, commit):
            assert node == "n1" and commit is True
            if isinstance(report_or_exc, BaseException):
                raise report_or_exc
            return report_or_exc

        return run_hook(ctx, loader or (lambda: self.cfg), health, slurm_factory=self.slurm_factory,
                        stderr=self.stderr)

    def decisions(self) -> list[dict]:
        return read_records(self.tmp / "state" / "n1" / "hooks.log")


def report(data: dict) -> Report:
    return run_checks(NodeSnapshot.from_dict(data), expected_gpus=8)


HEALTHY = report(healthy_snapshot_dict())
XID79 = report(xid_snapshot_dict(79, gpu=3))


@pytest.fixture
def h(tmp_path) -> Harness:
    return Harness(tmp_path)


@pytest.fixture
def syslog_lines(monkeypatch) -> list[str]:
    """Capture syslog instead of writing to the machine's journal."""
    import syslog

    lines: list[str] = []
    monkeypatch.setattr(syslog, "openlog", lambda *a, **k: None)
    monkeypatch.setattr(syslog, "syslog", lambda level, line: lines.append(line))
    return lines


@pytest.fixture(autouse=True)
def no_release_watch(monkeypatch):
    spawned: list[str] = []
    monkeypatch.setattr(executor, "spawn_release_watch", lambda job_id, cfg: spawned.append(job_id))
    return spawned


# --- healthy ----------------------------------------------------------------------------


@pytest.mark.parametrize("hook", ["prolog", "epilog"])
def test_healthy_makes_no_scontrol_call(h, hook: str) -> None:
    assert h.run(hook, HEALTHY, {"SLURM_JOB_EXIT_CODE": "1"}) == 0
    assert h.factory_calls == 0 and h.scontrol.calls == []
    [d] = h.decisions()
    assert (d["event"], d["verdict"], d["action"], d["node"], d["job"]) == (hook, "healthy", "none", "n1", "42")
    assert h.stderr.getvalue() == ""


def test_healthy_with_warnings_logs_them(h) -> None:
    assert h.run("prolog", report(xid_snapshot_dict(13, gpu=2))) == 0
    assert h.scontrol.calls == []
    [d] = h.decisions()
    assert d["verdict"] == "healthy" and any("xid 13 on gpu 2" in w for w in d["warnings"])


# --- unhealthy prolog -------------------------------------------------------------------


def test_unhealthy_prolog_drains_then_fails(h, no_release_watch) -> None:
    assert h.run("prolog", XID79) == 1
    assert h.scontrol.verbs() == ["show", "update"]
    assert h.scontrol.updates() == [["scontrol", "update", "NodeName=n1", "State=DRAIN", f"Reason={XID79_REASON}"]]
    assert no_release_watch == []  # nohold_on_prolog_fail is set: Slurm requeues PENDING by itself
    [d] = h.decisions()
    assert (d["verdict"], d["rule"], d["gpu"], d["observed"], d["action"]) == ("unhealthy", "xid", 3, 79, "drained")
    assert d["reason"] == XID79_REASON
    assert XID79_REASON in h.stderr.getvalue()


def test_unhealthy_prolog_without_nohold_starts_release_watch(h, no_release_watch) -> None:
    (h.tmp / "slurm.conf").write_text("ClusterName=c\nSchedulerParameters=bf_continue\n")
    assert h.run("prolog", XID79) == 1
    assert no_release_watch == ["42"]
    assert h.decisions()[0]["action"] == "drained,release-watch"


def test_node_drained_by_admin_is_kept(h) -> None:
    h.scontrol.state, h.scontrol.reason = "IDLE+DRAIN", "bad DIMM slot 4 [admin@2026-11-29T10:00:00]"
    assert h.run("prolog", XID79) == 1
    assert h.scontrol.updates() == []
    assert h.scontrol.reason.startswith("bad DIMM slot 4")
    [d] = h.decisions()
    assert d["verdict"] == "unhealthy" and d["action"] == "kept-admin-drain"


def test_down_node_reason_is_kept(h) -> None:
    h.scontrol.state, h.scontrol.reason = "DOWN*", "Not responding"
    assert h.run("prolog", XID79) == 1
    assert h.scontrol.updates() == []


def test_node_already_drained_by_us_with_same_reason(h) -> None:
    h.scontrol.state, h.scontrol.reason = "MIXED+DRAIN", XID79_REASON + " [root@2026-11-30T05:00:00]"
    assert h.run("prolog", XID79) == 1
    assert h.scontrol.updates() == []
    assert h.decisions()[0]["action"] == "already-drained"


def test_node_drained_by_us_for_another_reason_gets_new_reason(h) -> None:
    h.scontrol.state, h.scontrol.reason = "IDLE+DRAIN", "slurmagent: pcie-width: gpu 1 PCIe link x8 below x16"
    assert h.run("prolog", XID79) == 1
    assert len(h.scontrol.updates()) == 1
    assert h.scontrol.reason.startswith(XID79_REASON)


def test_unhealthy_prolog_still_fails_when_scontrol_times_out(h) -> None:
    """The GPU verdict stands even when the drain cannot be sent: a failing prolog makes Slurm
    drain the node and requeue the job itself, a passing one would run the job on a bad GPU."""
    h.scontrol.hang = {"show"}
    assert h.run("prolog", XID79) == 1
    [d] = h.decisions()
    assert d["verdict"] == "unhealthy" and d["rule"] == "xid"
    assert d["action"].startswith("drain-failed") and "timed out" in d["action"]


# --- epilog -------------------------------------------------------------------------------


def test_epilog_failed_job_on_unhealthy_node_is_drained_and_requeued(h) -> None:
    assert h.run("epilog", XID79, {"SLURM_JOB_EXIT_CODE": "256"}) == 0
    assert h.scontrol.verbs() == ["show", "update", "requeue"]
    assert h.scontrol.calls[-1] == ["scontrol", "requeue", "42"]
    assert f"Reason={XID79_REASON}" in h.scontrol.updates()[0]
    assert h.decisions()[0]["action"] == "drained,requeued"


def test_epilog_successful_job_is_not_requeued(h) -> None:
    assert h.run("epilog", XID79, {"SLURM_JOB_EXIT_CODE": "0"}) == 0
    assert h.scontrol.verbs() == ["show", "update"]


def test_epilog_requeue_can_be_disabled(tmp_path) -> None:
    h = Harness(tmp_path, epilog_requeue_failed=False)
    assert h.run("epilog", XID79, {"SLURM_JOB_EXIT_CODE": "1"}) == 0
    assert "requeue" not in h.scontrol.verbs()


def test_epilog_requeue_failure_is_logged_not_fatal(h) -> None:
    h.scontrol.hang = {"requeue"}
    assert h.run("epilog", XID79, {"SLURM_JOB_EXIT_CODE": "1"}) == 0
    assert h.decisions()[0]["action"].startswith("drained,requeue-failed")


def test_epilog_on_healthy_node_does_nothing(h) -> None:
    assert h.run("epilog", HEALTHY, {"SLURM_JOB_EXIT_CODE": "9"}) == 0
    assert h.scontrol.calls == []


# --- failures of slurmagent itself ----------------------------------------------------------


def test_config_error_is_internal_error_and_fails_open(h, syslog_lines) -> None:
    def loader():
        raise ConfigError("config /etc/slurmagent/config.toml: unknown key 'helth'")

    assert h.run("prolog", XID79, loader=loader) == 0
    assert h.factory_calls == 0 and h.scontrol.calls == []
    [line] = syslog_lines
    record = json.loads(line)
    assert record["verdict"] == "internal-error" and record["verdict"] != "unhealthy"
    assert "helth" in record["error"] and "fail open" in record["action"]
    assert record["node"] == "n1" and record["job"] == "42"
    err = h.stderr.getvalue()
    assert "internal error" in err and "not a GPU fault" in err and "helth" in err


def test_health_bug_fails_open_by_default(h) -> None:
    assert h.run("prolog", RuntimeError("boom")) == 0
    assert h.scontrol.calls == []
    [d] = h.decisions()
    assert d["verdict"] == "internal-error" and d["error"] == "RuntimeError: boom"


def test_fail_closed_drains_with_internal_error_reason(tmp_path) -> None:
    h = Harness(tmp_path, on_internal_error="closed")
    assert h.run("prolog", RuntimeError("boom")) == 1
    [update] = h.scontrol.updates()
    assert update[-1] == "Reason=slurmagent: internal error: RuntimeError: boom"
    [d] = h.decisions()
    assert d["verdict"] == "internal-error" and d["action"] == "drain (fail closed)"


def test_fail_closed_keeps_admin_drain(tmp_path) -> None:
    h = Harness(tmp_path, on_internal_error="closed")
    h.scontrol.state, h.scontrol.reason = "IDLE+DRAIN", "maintenance"
    assert h.run("prolog", RuntimeError("boom")) == 1
    assert h.scontrol.updates() == []


# --- decision log ---------------------------------------------------------------------------


def test_decision_log_one_json_line_per_decision(h) -> None:
    h.run("prolog", HEALTHY)
    h.run("prolog", XID79, {"SLURM_JOB_ID": "43"})
    h.run("epilog", RuntimeError("boom"), {"SLURM_JOB_ID": "44"})
    lines = (h.tmp / "state" / "n1" / "hooks.log").read_text().splitlines()
    assert len(lines) == 3
    records = [json.loads(line) for line in lines]
    for r, job, verdict in zip(records, ["42", "43", "44"], ["healthy", "unhealthy", "internal-error"]):
        assert r["node"] == "n1" and r["job"] == job and r["verdict"] == verdict
        assert isinstance(r["duration_ms"], (int, float)) and r["duration_ms"] >= 0
        assert r["action"]
        assert r["time"].endswith("Z")
    assert records[1]["rule"] == "xid"


def test_decision_log_file_setting_with_node_name(tmp_path) -> None:
    h = Harness(tmp_path, log_file=str(tmp_path / "logs" / "%n.jsonl"))
    h.run("prolog", HEALTHY)
    assert read_records(tmp_path / "logs" / "n1.jsonl")[0]["verdict"] == "healthy"


def test_hook_context_from_env() -> None:
    ctx = HookContext.from_env("epilog", {"SLURMD_NODENAME": "a3-7", "SLURM_JOBID": "9_3", "SLURM_JOB_EXIT_CODE": "x"})
    assert (ctx.node, ctx.job_id, ctx.job_exit_code) == ("a3-7", "9_3", None)
    assert HookContext.from_env("epilog", {"SLURMD_NODENAME": "n", "SLURM_JOB_EXIT_CODE": "-1"}).job_exit_code == -1


# --- the real fast path: no google, no click --------------------------------------------------

PROBE = """
import sys
from slurmagent.entry import main
code = main(["prolog"])
print(sorted(m for m in sys.modules if m.startswith(("google", "click"))
             or m in ("subprocess", "slurmagent.slurm.model")))  # nor a command runner, nor scontrol's parsers
print(code)
"""


def test_healthy_prolog_imports_no_google_and_no_click(tmp_path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    snap = write_json(root / "snap" / "%n.json".replace("%n", "n1"), healthy_snapshot_dict(hostname="n1"))
    kern = root / "kern.log"
    kern.write_text("")
    config = root / "config.toml"
    config.write_text(
        f'state_dir = "{root}/state/%n"\n'
        f'[health]\nsnapshot = "{root}/snap/%n.json"\nkernel_log = "{kern}"\nexpected_gpus = 8\n'
        f'[hooks]\nsyslog = false\n[slurm]\nconf = "{root}/no-slurm.conf"\n'
    )
    config.chmod(0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "GOOGLE", "CLOUDSDK"))}
    env.update(SLURMAGENT_CONFIG=str(config), SLURMD_NODENAME="n1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    modules, code = proc.stdout.splitlines()[-2:]
    assert modules == "[]", modules
    assert code == "0", proc.stdout + proc.stderr
    assert snap.exists()
    [d] = read_records(root / "state" / "n1" / "hooks.log")
    assert d["verdict"] == "healthy" and d["node"] == "n1"


def _racing_prolog(tmp_path, monkeypatch, fault: Report):
    """n1's prolog drains for `fault` on a 4-node cluster whose breaker allows 1 drain while n0
    drains in the same second (ordered first: it wins the slot), with the detached runner
    captured instead of forked and no wait for the second to pass."""
    from dataclasses import replace

    from slurmagent.actions import handlers

    h = Harness(tmp_path)
    h.cfg = replace(h.cfg, repair=replace(h.cfg.repair, max_drained_fraction=0.25))
    fake = FakeSlurm(("n0", "n1", "n2", "n3"), stamp="2026-11-30T05:00:00")
    fake.jobs = h.scontrol.jobs
    h.scontrol = fake

    def racer(argv, timeout):
        out = fake(argv, timeout)
        if "update" in argv and "NodeName=n1" in argv and fake.nodes["n0"]["State"] == "IDLE":
            fake.nodes["n0"].update(State="IDLE+DRAIN", Reason=XID79_REASON)  # right after n1's drain
        return out

    monkeypatch.setattr(Harness, "slurm_factory", lambda self, cfg: Slurm("scontrol", 3, runner=racer))
    detached = []
    monkeypatch.setattr(executor, "run_detached", lambda fn: detached.append(fn) or True)
    monkeypatch.setattr(handlers.time, "sleep", lambda s: None)
    ctx = HookContext.from_env("prolog", {"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"})
    code = run_hook(ctx, lambda: h.cfg, lambda cfg, node, commit: fault, slurm_factory=h.slurm_factory,
                    stderr=h.stderr, verify_in_background=True)
    return h, code, detached


def test_prolog_exits_before_the_breaker_checks_racers_and_still_undoes_a_drain_beyond_the_limit(
        tmp_path, monkeypatch) -> None:
    """XID 79 keeps the job off the node whatever the breaker says: the prolog exits 1 right
    after its drain (Slurm requeues the job at once) and the breaker's second read runs
    detached. The racer n0 still wins the one slot: n1's drain is undone there, marked as held
    back by the breaker, and logged."""
    h, code, detached = _racing_prolog(tmp_path, monkeypatch, XID79)
    assert code == 1 and len(detached) == 1
    assert h.scontrol.nodes["n1"]["State"] == "IDLE+DRAIN"  # drained when the prolog exits
    [d] = h.decisions()
    assert d["verdict"] == "unhealthy" and d["action"].startswith("drained (the breaker checks racers")

    detached[0]()
    assert h.scontrol.nodes["n0"]["State"] == "IDLE+DRAIN"
    assert h.scontrol.nodes["n1"]["State"] == "IDLE"
    assert h.scontrol.nodes["n1"]["Comment"].startswith("slurmagent suppressed@")
    last = h.decisions()[-1]
    assert (last["event"], last["node"], last["action"]) == ("breaker", "n1", "suppressed-by-breaker (lost the race)")


def test_prolog_whose_job_may_run_waits_for_the_breaker_check(tmp_path, monkeypatch) -> None:
    """XID 48 leaves the GPUs usable: when the breaker holds the drain back the job may run, so
    the prolog's exit waits for the second read (nothing detached) and, losing the race, lets
    the job run."""
    h, code, detached = _racing_prolog(tmp_path, monkeypatch, report(xid_snapshot_dict(48, gpu=1)))
    assert detached == [] and code == 0
    assert h.scontrol.nodes["n1"]["State"] == "IDLE"
    [d] = h.decisions()
    assert "suppressed-by-breaker (lost the race)" in d["action"]


def test_run_detached_runs_outside_the_hooks_session_with_no_inherited_file(tmp_path) -> None:
    """What Slurm waits for when the prolog exits (its process, group and output pipe) does not
    include the breaker's detached check; nor does it hold the journal's lock file open."""
    import time

    from slurmagent.actions.executor import run_detached

    out = tmp_path / "out.json"
    held = open(tmp_path / "lock", "w")  # stands for the journal's lock: fd >= 3

    def check() -> None:
        fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
        (tmp_path / "tmp.json").write_text(json.dumps({"sid": os.getsid(0), "fds": fds}))
        os.replace(tmp_path / "tmp.json", out)

    assert run_detached(check) is True
    for _ in range(200):
        if out.exists():
            break
        time.sleep(0.05)
    got = json.loads(out.read_text())
    assert got["sid"] != os.getsid(0)
    assert held.fileno() not in got["fds"] and max(got["fds"]) <= 3  # 0-2 on /dev/null, 3: listdir's own
    held.close()


FAILING_PROBE = """
import sys, time
from support.fakes.slurm import FakeSlurm
from slurmagent.slurm import commands
fake = FakeSlurm(("n0", "n1", "n2", "n3"))
fake.nodes["n0"].update(State="IDLE+DRAIN", Reason="slurmagent: xid 79 on gpu 0 (fallen off the bus)",
                        ReasonTime="2026-11-30T04:00:00")  # an earlier fault drain: the breaker reads its times
commands.Slurm.__init__.__defaults__ = tuple(fake if d is commands.run_argv else d
                                             for d in commands.Slurm.__init__.__defaults__)
time.sleep = lambda s: None  # the breaker's wait for the next second
from slurmagent.entry import main
code = main(["prolog"])
print(sorted(m for m in ("uuid", "platform", "_strptime", "slurmagent.policy.repair") if m in sys.modules))
print(code, fake.nodes["n1"]["State"], len(fake.of("scontrol", "-o", "show", "node")))
"""


def test_failing_prolog_drains_without_the_repair_path_modules(tmp_path) -> None:
    """A prolog that drains its node and reads every node twice for the breaker (XID 48: the
    job could run if the breaker held the drain back, so both reads are the prolog's) imports
    neither uuid (nor its platform) nor the repair policy, and reads Slurm's times without
    strptime: a failing prolog's start-up stays short."""
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    write_json(root / "snap" / "n1.json", xid_snapshot_dict(48, gpu=1))
    kern = root / "kern.log"
    kern.write_text("")
    conf = root / "slurm.conf"
    conf.write_text("ClusterName=c\nSchedulerParameters=nohold_on_prolog_fail\n")
    config = root / "config.toml"
    config.write_text(
        f'state_dir = "{root}/state/%n"\n'
        f'[health]\nsnapshot = "{root}/snap/%n.json"\nkernel_log = "{kern}"\nexpected_gpus = 8\n'
        f'[hooks]\nsyslog = false\n[slurm]\nconf = "{conf}"\n[repair]\nmax_drained_fraction = 0.5\n'
    )
    config.chmod(0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "GOOGLE", "CLOUDSDK"))}
    env.update(SLURMAGENT_CONFIG=str(config), SLURMD_NODENAME="n1", SLURM_JOB_ID="42",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.run([sys.executable, "-c", FAILING_PROBE], capture_output=True, text=True, env=env,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    modules, outcome = proc.stdout.splitlines()[-2:]
    assert outcome == "1 IDLE+DRAIN 2", proc.stdout + proc.stderr  # drained, every node read twice
    assert modules == "[]", modules
    [d] = read_records(root / "state" / "n1" / "hooks.log")
    assert d["verdict"] == "unhealthy" and d["action"] == "drained"


def test_the_epilog_drops_the_jobs_own_series_and_keeps_the_others(h) -> None:
    """Before: a cancelled job's `slurmagent_checkpoint_lag_seconds{job=...}` stayed in the node's
    textfile for good (its wrapper was killed before it could clear it)."""
    from slurmagent.state import metrics

    m = metrics.for_node(h.cfg, "n1")
    m.update(set_={("slurmagent_checkpoint_lag_seconds", (("job_id", "42"),)): 5.0,
                   ("slurmagent_checkpoint_age_seconds", (("job_id", "42"),)): 9.0,
                   ("slurmagent_checkpoint_age_seconds", (("job", "42"),)): 8.0,  # the label's old name
                   ("slurmagent_checkpoint_lag_seconds", (("job_id", "43"),)): 7.0})
    assert h.run("epilog", HEALTHY) == 0
    text = (h.tmp / "state" / "n1" / "slurmagent.prom").read_text()
    assert '"42"' not in text and 'slurmagent_checkpoint_lag_seconds{job_id="43"} 7' in text
    m.update(set_={("slurmagent_checkpoint_lag_seconds", (("job_id", "42"),)): 5.0})
    assert h.run("prolog", HEALTHY) == 0  # the prolog leaves them
    assert 'job_id="42"' in (h.tmp / "state" / "n1" / "slurmagent.prom").read_text()
