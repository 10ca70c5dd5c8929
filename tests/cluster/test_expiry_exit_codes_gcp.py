"""`expiry-watch --once` says when expiry protection is off: against the fake Compute API
(tests/support/fake_gcp_expiry.py), a 403 or a malformed answer several times in a row exits 1
with a WARN decision-log line and `slurmagent_expiry_read_failures_total{reason}`; a 500 passes
by itself (exit 0, the cached answer kept); `[expiry] compute_api = false` asks the metadata
server alone and stays green without any Compute permission.

The pure classification: tests/unit/test_expiry_policy.py.
"""

from __future__ import annotations

import io
import json

import pytest

from support.fake_gcp_expiry import FakeGcpExpiry
from slurmagent.commands import expiry
from slurmagent.slurm.commands import Slurm
from slurmagent.state import metrics
from slurmagent.state.config import parse
from slurmagent.state.decisionlog import read_records
from slurmagent.policy.expiry import MALFORMED_LASTING_AFTER
from test_expiry import NODE, ZONE, iso, slurm_with

COUNTER = "slurmagent_expiry_read_failures_total"


@pytest.fixture
def gcp(serve_metadata):
    fake = serve_metadata(FakeGcpExpiry())
    fake.add_instance(NODE, ZONE)
    fake.set_identity(NODE, ZONE)
    fake.set_scheduling(NODE, termination=None, model="STANDARD")
    return fake


def config(tmp_path, gcp, **expiry_keys):
    return parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                  "gcp": {"project": "test-proj", "zone": ZONE, "compute_endpoint": gcp.url},
                  "expiry": {"publish_run_file": False, "api_timeout_s": 5, "refresh_s": 1, **expiry_keys}})


def once(cfg) -> tuple[int, str]:
    err = io.StringIO()
    code = expiry.run_expiry_watch(cfg, NODE, once=True, out=io.StringIO(), err=err, slurm=Slurm(runner=slurm_with()))
    return code, err.getvalue()


def counters(tmp_path) -> dict[str, float]:
    return {k: v for k, v in metrics.read_values(tmp_path / "state" / NODE).items() if k.startswith(COUNTER)}


def watch_lines(tmp_path) -> list[dict]:
    return [r for r in read_records(tmp_path / "state" / NODE / "hooks.log") if r["event"] == "expiry-watch"]


def test_a_403_exits_1_with_a_warn_line_and_the_counter(gcp, tmp_path):
    cfg = config(tmp_path, gcp)
    gcp.fail("instances.get", *[403] * 4)
    code, err = once(cfg)
    assert code == 1, err
    assert "cannot read the termination time from the Compute API" in err and "403" in err, err
    assert "[expiry] compute_api = false" in err  # the fix for a cluster without the permission by design
    line = watch_lines(tmp_path)[-1]
    assert (line["severity"], line["protection_off"]) == ("WARNING", "permission"), line
    assert counters(tmp_path) == {f'{COUNTER}{{reason="permission"}}': 1.0}
    code, err = once(cfg)  # every run while it lasts: the timer's unit fails each time, the counter counts
    assert code == 1 and err == ""  # said once (and again after an hour), not every 30 s
    assert len(watch_lines(tmp_path)) == 1
    assert counters(tmp_path) == {f'{COUNTER}{{reason="permission"}}': 2.0}
    prom = (tmp_path / "state" / NODE / "slurmagent.prom").read_text()
    assert f'{COUNTER}{{reason="permission"}} 2' in prom and f"# TYPE {COUNTER} counter" in prom


def test_a_transient_500_keeps_the_cached_answer_and_exits_0(gcp, tmp_path):
    gcp.set_scheduling(NODE, termination=iso(4_000_000_000))
    cfg = config(tmp_path, gcp)
    assert once(cfg)[0] == 0
    gcp.fail("instances.get", *[500] * 10)  # past refresh_s: asked again, the API is down
    state = tmp_path / "state" / NODE / "expiry.json"
    data = json.loads(state.read_text())
    data["api"]["checked_at_epoch"] -= 3600  # the cached answer is old: the next run asks again
    state.write_text(json.dumps(data))
    code, err = once(cfg)
    assert code == 0, err
    assert "using the cached answer" in err and "500" in err, err
    assert json.loads(state.read_text())["termination_time"] == iso(4_000_000_000)
    assert counters(tmp_path) == {}
    assert not any("protection_off" in r for r in watch_lines(tmp_path))


def test_a_malformed_answer_counts_only_several_times_in_a_row(gcp, tmp_path):
    cfg = config(tmp_path, gcp)
    gcp.scheduling[NODE]["scheduling"]["terminationTime"] = "not a time"
    codes = [once(cfg)[0] for _ in range(MALFORMED_LASTING_AFTER)]
    assert codes == [0] * (MALFORMED_LASTING_AFTER - 1) + [1]
    assert counters(tmp_path) == {f'{COUNTER}{{reason="malformed"}}': 1.0}
    del gcp.scheduling[NODE]["scheduling"]["terminationTime"]
    assert once(cfg)[0] == 0  # a good answer ends the row


def test_metadata_only_stays_green_without_any_compute_permission(gcp, tmp_path):
    cfg = config(tmp_path, gcp, compute_api=False)
    gcp.fail("instances.get", *[403] * 4)
    code, err = once(cfg)
    assert code == 0 and "termination time" not in err, err
    assert not gcp.calls_of("instances.get")
    assert counters(tmp_path) == {}
    gcp.set_event("instance/preempted", "TRUE")  # the metadata server's notices still count
    code, err = once(cfg)
    state = json.loads((tmp_path / "state" / NODE / "expiry.json").read_text())
    assert code == 0 and state.get("source") == "preempted", (err, state)


def test_a_malformed_row_outlasts_a_run_that_could_not_ask_the_api(gcp, tmp_path, monkeypatch):
    """The project comes from the metadata server; a run while it is down asks no API, and the
    row of malformed answers goes on after it (before, that run forgot the row: never lasting)."""
    from slurmagent.gcp import metadata

    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                 "gcp": {"compute_endpoint": gcp.url},
                 "expiry": {"publish_run_file": False, "api_timeout_s": 5, "refresh_s": 1, "metadata_timeout_s": 1}})
    gcp.scheduling[NODE]["scheduling"]["terminationTime"] = "not a time"
    assert once(cfg)[0] == 0
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # nothing listens: the metadata server is down
    metadata.reset_cache()
    calls = len(gcp.calls_of("instances.get"))
    once(cfg)
    assert len(gcp.calls_of("instances.get")) == calls  # the API was not asked
    monkeypatch.setenv("GCE_METADATA_HOST", gcp.host)
    metadata.reset_cache()
    codes = [once(cfg)[0] for _ in range(MALFORMED_LASTING_AFTER - 1)]
    assert codes == [0] * (MALFORMED_LASTING_AFTER - 2) + [1]
    assert counters(tmp_path) == {f'{COUNTER}{{reason="malformed"}}': 1.0}
