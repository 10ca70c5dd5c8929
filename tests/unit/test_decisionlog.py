"""The decision log: one JSON line per decision, never longer than MAX_LINE_BYTES."""

from __future__ import annotations

import json

from slurmagent.state.decisionlog import MAX_LINE_BYTES, DecisionLog, read_records


def test_a_short_record_is_written_as_is(tmp_path):
    log = DecisionLog(tmp_path / "hooks.log", use_syslog=False)
    log.write("prolog", node="n1", verdict="healthy", action="none", warnings=["clocks: gpu 0 clocks event gpu_idle"])
    (record,) = read_records(tmp_path / "hooks.log")
    assert record["warnings"] == ["clocks: gpu 0 clocks event gpu_idle"] and "truncated" not in record


def test_long_texts_lists_and_objects_are_cut_with_a_marker(tmp_path):
    log = DecisionLog(tmp_path / "hooks.log", use_syslog=False)
    log.write("healthcheck", node="n1", verdict="internal-error", action="none", error="e" * 1_000_000,
              findings=[f"finding {i}" for i in range(100_000)], observed={f"k{i}": i for i in range(100_000)})
    raw = (tmp_path / "hooks.log").read_bytes()
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1 and len(raw) <= MAX_LINE_BYTES + 1
    record = json.loads(raw)
    assert record["truncated"] is True and record["verdict"] == "internal-error"
    assert record["error"].startswith("eeee") and record["error"].endswith(" more characters (truncated)")
    assert record["findings"][0] == "finding 0" and record["findings"][-1].endswith(" more (truncated)")
    assert record["observed"]["k0"] == 0 and record["observed"]["..."].endswith(" more (truncated)")


def test_many_huge_fields_fall_back_to_the_essential_ones(tmp_path):
    log = DecisionLog(tmp_path / "hooks.log", use_syslog=False)
    log.write("prolog", node="n1", job="42", verdict="unhealthy", reason="slurmagent: xid 79 on gpu 3 (x)",
              action="drained", **{f"extra{i}": "x" * 10_000 for i in range(100)})
    (record,) = read_records(tmp_path / "hooks.log")
    assert set(record) == {"time", "severity", "event", "node", "job", "verdict", "reason", "action", "duration_ms",
                           "version", "truncated"}
