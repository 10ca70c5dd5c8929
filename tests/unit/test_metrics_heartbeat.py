"""The metrics a node_exporter can be trusted with: a heartbeat per component that every run
rewrites (before, an unchanged update skipped the write, so the file's age said nothing), and a
textfile that cannot be written is counted and said once (before: a stderr line per run that
slurmd's log swallowed, and no count)."""

from __future__ import annotations

import io
import os
import time

import pytest

from support import healthy_snapshot_dict, wait_for, write_json
from support.fakes.slurm import FakeSlurm
from slurmagent.commands.healthcheck import run_healthcheck
from slurmagent.slurm.commands import Slurm
from slurmagent.state.config import parse
from slurmagent.state.metrics import HEARTBEAT, WRITE_FAILURES, Metrics, read_values

from test_watch import Harness


def _beat(values: dict, component: str) -> float:
    return values[f'{HEARTBEAT}{{component="{component}"}}']


def test_every_run_rewrites_its_heartbeat_even_when_nothing_else_changed(tmp_path):
    m = Metrics(tmp_path)
    m.update(set_={("slurmagent_breaker_open", ()): 0}, component="expiry")
    first = (tmp_path / "slurmagent.prom").read_text()
    assert f'{HEARTBEAT}{{component="expiry"}} ' in first
    time.sleep(0.01)
    m.update(set_={("slurmagent_breaker_open", ()): 0}, component="expiry")  # the same values again
    m.heartbeat("repair")
    second = (tmp_path / "slurmagent.prom").read_text()
    assert second != first
    values = read_values(tmp_path)
    assert _beat(values, "expiry") > float(first.split(f'{HEARTBEAT}{{component="expiry"}} ')[1].split()[0])
    assert abs(_beat(values, "repair") - time.time()) < 60
    assert "# TYPE slurmagent_last_run_timestamp_seconds gauge" in second


def test_a_failed_textfile_write_is_counted_and_said_once_until_it_works_again(tmp_path):
    said: list[str] = []
    textdir = tmp_path / "node-exporter"
    textdir.write_text("a file where the directory should be")  # every write fails
    m = Metrics(tmp_path / "state", textdir / "slurmagent.prom", say=said.append)
    for _ in range(3):
        m.update(add={("slurmagent_requeues_total", ()): 1}, component="healthcheck")
    values = read_values(tmp_path / "state")
    failures = {k: v for k, v in values.items() if k.startswith(WRITE_FAILURES)}
    assert list(failures.values()) == [3] and values["slurmagent_requeues_total"] == 3
    reason = list(failures)[0].split('"')[1]
    assert reason.startswith("E")
    assert len(said) == 1 and str(textdir / "slurmagent.prom") in said[0] and f"({reason})" in said[0]

    textdir.unlink()
    textdir.mkdir()
    m.heartbeat("healthcheck")
    text = (textdir / "slurmagent.prom").read_text()
    assert f'{WRITE_FAILURES}{{reason="{reason}"}} 3\n' in text and "slurmagent_requeues_total 3\n" in text
    assert len(said) == 1

    (textdir / "slurmagent.prom").unlink()
    textdir.rmdir()
    textdir.write_text("broken again")
    m.heartbeat("healthcheck")  # broken again after a write that worked: said again
    assert len(said) == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="root's own rule: CI and the lanes run as root")
@pytest.mark.parametrize("owner, mode", [(0, 0o777), (0, 0o1777), (0, 0o775), (65534, 0o755)])
def test_root_writes_no_textfile_into_a_directory_another_user_can_change(tmp_path, owner, mode):
    """node_exporter's directory sits in one its service user owns (/var/lib/prometheus): root
    writes only into a textfile directory that root owns and only root can write; any other is
    a counted, said failure, and nothing lands there (a planted link cannot take root's write)."""
    said: list[str] = []
    textdir = tmp_path / "node-exporter"
    textdir.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    planted = textdir / f".slurmagent.prom.{os.getpid()}.tmp"
    os.link(victim, planted)  # what a user who can write the directory would leave there
    os.chown(textdir, owner, 0)
    textdir.chmod(mode)
    m = Metrics(tmp_path / "state", textdir / "slurmagent.prom", say=said.append)
    m.update(add={("slurmagent_requeues_total", ()): 1}, component="prolog")
    assert victim.read_text() == "root's file\n" and not (textdir / "slurmagent.prom").exists()
    assert read_values(tmp_path / "state")[f'{WRITE_FAILURES}{{reason="EPERM"}}'] == 1
    assert len(said) == 1 and ("writable by non-root users" in said[0] or "owned by uid 65534, not root" in said[0])

    os.chown(textdir, 0, 0)
    textdir.chmod(0o755)  # root's own again: written, and the planted link is not followed
    m.heartbeat("prolog")
    assert "slurmagent_requeues_total 1\n" in (textdir / "slurmagent.prom").read_text()
    assert victim.read_text() == "root's file\n" and (textdir / "slurmagent.prom").stat().st_mode & 0o777 == 0o644


@pytest.mark.skipif(os.geteuid() != 0, reason="root's own rule: CI and the lanes run as root")
def test_a_textfile_directory_named_through_a_link_is_refused_with_what_to_name(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    said: list[str] = []
    Metrics(tmp_path / "state", tmp_path / "link" / "slurmagent.prom", say=said.append).heartbeat("prolog")
    assert not (real / "slurmagent.prom").exists()
    assert len(said) == 1 and "a symbolic link: name the directory itself" in said[0], said


def test_a_nodes_metrics_say_it_on_stderr(tmp_path, capsys):
    from slurmagent.state.metrics import for_node

    (tmp_path / "file").write_text("not a directory")
    cfg = parse({"state_dir": str(tmp_path / "state"), "hooks": {"syslog": False},
                 "metrics": {"textfile": str(tmp_path / "file" / "%n.prom")}})
    for_node(cfg, "n1").heartbeat("prolog")
    for_node(cfg, "n1").heartbeat("prolog")
    err = capsys.readouterr().err
    assert err.count(f"slurmagent: cannot write metrics to {tmp_path / 'file' / 'n1.prom'}") == 1


def test_watch_stamps_its_heartbeat_while_it_loops(tmp_path):
    h = Harness(tmp_path, use_nvml=False)
    h.watcher.heartbeat_s = 0.05
    with h:
        first = wait_for(lambda: _beat_or_none(tmp_path, "watch"), 5, "a first watch heartbeat")
        wait_for(lambda: (_beat_or_none(tmp_path, "watch") or 0) > first, 5, "a later watch heartbeat")


def _beat_or_none(tmp_path, component: str) -> float | None:
    return read_values(tmp_path / "state").get(f'{HEARTBEAT}{{component="{component}"}}')


def test_the_hooks_and_a_skipped_healthcheck_stamp_their_heartbeats(tmp_path):
    """A HealthCheckProgram run skipped because a prolog checked moments ago still ran: on a node
    busy with jobs its heartbeat would otherwise go stale and alert."""
    from test_hooks_unit import HEALTHY, Harness as HookHarness

    h = HookHarness(tmp_path)
    assert h.run("prolog", HEALTHY) == 0
    state = tmp_path / "state" / "n1"
    prolog = read_values(state)[f'{HEARTBEAT}{{component="prolog"}}']
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                 "health": {"kernel_log_enabled": False, "expected_gpus": 8,
                            "snapshot": str(write_json(tmp_path / "snap.json", healthy_snapshot_dict()))}})
    checked = []
    assert run_healthcheck("n1", lambda: cfg, lambda *a: checked.append(a), slurm_factory=lambda c: Slurm(runner=FakeSlurm()),
                           skip_recent=120, stderr=io.StringIO()) == 0
    assert checked == []  # skipped: the prolog's check stands
    values = read_values(state)
    assert values[f'{HEARTBEAT}{{component="healthcheck"}}'] >= prolog
    assert f'{HEARTBEAT}{{component="healthcheck"}}' in (state / "slurmagent.prom").read_text()


def test_each_expiry_check_rewrites_the_textfile_though_nothing_else_changed(tmp_path):
    from slurmagent.commands.expiry import ExpiryWatch
    from slurmagent.core.timefmt import from_epoch
    from slurmagent.gcp.compute import SchedulingInfo
    from slurmagent.gcp.events import Events

    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                 "gcp": {"project": "test-proj", "zone": "us-central1-a"}, "expiry": {"publish_run_file": False}})
    ends = time.time() + 3 * 3600

    def scheduling(cfg, node):
        return SchedulingInfo(from_epoch(ends), "FLEX_START", "DELETE", 3600.0,
                              "resourceStatus.scheduling.terminationTimestamp")

    watch = ExpiryWatch(cfg, "n1", Slurm(runner=FakeSlurm(["n1"])), clock=time.time, boot_id="boot-a",
                        scheduling_reader=scheduling)
    prom = tmp_path / "state" / "n1" / "slurmagent.prom"
    watch.check(Events())
    first, first_beat = prom.read_text(), _beat(read_values(tmp_path / "state" / "n1"), "expiry")
    time.sleep(0.01)
    watch.check(Events())
    assert _beat(read_values(tmp_path / "state" / "n1"), "expiry") > first_beat
    second = prom.read_text()
    assert second != first
    strip = [line for line in second.splitlines() if not line.startswith(HEARTBEAT)]
    assert strip == [line for line in first.splitlines() if not line.startswith(HEARTBEAT)]  # only the stamp moved
