"""Every reader of input another user, another node or another service controls, fuzzed
(issue 36): a parsed value or the module's own error type, never another exception, in bounded
time. Snapshots, the kernel log and `trainer.saved` declarations are fuzzed beside their own
tests (test_snapshot.py, test_kernlog.py, test_saved.py).

The profile is CI's (a few hundred examples per reader, about a minute for the file);
`HYPOTHESIS_PROFILE=deep` runs ten times as many by hand.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from slurmagent.checkpoint.errors import ManifestError
from slurmagent.checkpoint.gcs.peers import PeerFailed, read_json_line, read_line
from slurmagent.checkpoint.manifest import Manifest
from slurmagent.core.goodput import build_report, clean_record, format_text
from slurmagent.errors import ConfigError
from slurmagent.gcp.metadata import parse_created_by
from slurmagent.policy.job_requests import JobRequest, RequestError, parse_request
from slurmagent.slurm import model
from slurmagent.slurm.features import parse_show_config, parse_version
from slurmagent.state.config import Config, parse

DEEP = os.environ.get("HYPOTHESIS_PROFILE") == "deep"
settings.register_profile("readers", max_examples=2000 if DEEP else 150, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("readers")

SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                                       max_size=6), max_leaves=30)
NESTED = st.integers(1, 30000).map(lambda n: b"[" * n + b"]" * (n % 3))  # a RecursionError in json.loads
BYTES = st.binary(max_size=2048) | NESTED | JSON.map(lambda v: json.dumps(v).encode())


def timed(fn):
    """The call, within a second: a reader is bounded in time on any input."""
    t = time.monotonic()
    out = fn()
    assert time.monotonic() - t < 1.0
    return out


@given(BYTES)
def test_channel_requests(raw):
    try:
        assert isinstance(timed(lambda: parse_request(raw)), JobRequest)
    except RequestError:
        pass


@given(st.fixed_dictionaries({"op": st.sampled_from(["metrics", "drain", "report", "count"]),
                              "job": st.sampled_from(["7", "7_1"]) | st.text(max_size=5),
                              "node": st.text(max_size=5)},
                             optional={"set": JSON, "add": JSON, "rule": JSON, "detail": JSON, "clear": JSON}))
def test_channel_requests_near_valid(doc):
    try:
        req = parse_request(json.dumps(doc).encode())
    except RequestError:
        return
    assert req.op == doc["op"] and all(isinstance(v, float) for v in {**req.set_, **req.add}.values())


@given(st.lists(JSON | st.fixed_dictionaries({"job": JSON, "attempt": JSON, "started": JSON},
                                             optional={k: JSON for k in ("ended", "gpus", "node_count", "flush_s",
                                                                         "restore_s", "first_progress", "last_commit",
                                                                         "end", "why", "requeued")}),
                max_size=6))
def test_ledger_records(records):
    for r in records:
        rec, why = clean_record(r)
        assert (rec is None) == bool(why)
    report = timed(lambda: build_report(records, now=2e9))
    json.dumps(report, allow_nan=False)
    format_text(report)


@given(BYTES)
def test_manifests_and_commit_records(raw):
    try:
        assert isinstance(timed(lambda: Manifest.from_json(raw)), Manifest)
    except ManifestError:
        pass


@given(st.fixed_dictionaries({"schema": st.sampled_from([1, 2]), "attempt": st.integers(-2, 5) | JSON},
                             optional={"files": JSON, "node_count": JSON, "writers": JSON, "no_progress": JSON,
                                       "owner": JSON}))
def test_manifests_near_valid(doc):
    try:
        Manifest.from_json(json.dumps(doc))
    except ManifestError:
        pass


TEXT = st.text(max_size=400) | st.lists(st.sampled_from(["NodeName=n1", "State=IDLE+DRAIN", "Reason=x y",
                                                         "JobId=7", "JobState=RUNNING", "NodeList=n[1-3]",
                                                         "NodeList=n[1-", "|", "=", " ", "\n", "(null)", "Gres=gpu:8",
                                                         "Comment=slurmagent:x", "UserId=a(1000)", "n[0-99999999]"]),
                                        max_size=30).map("".join)


@given(TEXT)
def test_scontrol_and_squeue_output(text):
    timed(lambda: model.nodes_from_text(text))
    timed(lambda: model.running_jobs_from_text(text))
    model.job_from_text(text, "7")
    model.owner_from_squeue(text)
    model.parse_kv(text)
    model.parse_comment(text)
    parse_show_config(text)
    parse_version(text)


@given(st.none() | st.text(max_size=200))
def test_metadata_and_compute_answers(value):
    parse_created_by(value)


def socket_with(data: bytes) -> socket.socket:
    a, b = socket.socketpair()
    b.sendall(data)
    b.close()
    a.settimeout(1)
    return a


@given(st.binary(max_size=600))
def test_peer_protocol_lines(data):
    with socket_with(data) as s:
        try:
            assert isinstance(read_line(s, limit=256), str)
        except PeerFailed:
            pass
    with socket_with(data) as s:
        try:
            assert isinstance(read_json_line(s, limit=512), dict)
        except PeerFailed:
            pass


SECTIONS = ["watch", "health", "repair", "checkpoint", "slurm", "gcp", "hooks", "expiry", "hang", "run"]


@given(st.dictionaries(st.sampled_from(SECTIONS + ["state_dir", "bogus"]),
                       JSON | st.dictionaries(st.text(max_size=20) | st.sampled_from(
                           ["channel_socket", "keep_commits", "settle_s", "gc_grace_s", "strategy", "interval_s"]),
                           JSON, max_size=4), max_size=4))
def test_the_config_file(data):
    try:
        assert isinstance(parse(data), Config)
    except ConfigError:
        pass


@pytest.mark.parametrize("raw", [b"[" * 20000, b'{"a":' * 20000])
def test_deep_nesting_is_each_readers_own_error(raw):
    with pytest.raises(RequestError):
        parse_request(raw)
    with pytest.raises(ManifestError):
        Manifest.from_json(raw)
    with socket_with(raw + b"\n") as s, pytest.raises(PeerFailed):
        read_json_line(s)


TIMES = st.text(max_size=40) | st.sampled_from(["2026-12-05T10:00:00Z", "2026-12-05T10:00:00.123-08:00", "9999-12-31T23:59:59Z",
                                               "0001-01-01T00:00:00Z", "2026-13-45T99:99:99Z", "NaN", ""])


@given(st.fixed_dictionaries({}, optional={
    "scheduling": st.fixed_dictionaries({}, optional={
        "provisioning_model": st.text(max_size=12), "instance_termination_action": st.text(max_size=12),
        "termination_time": TIMES, "on_host_maintenance": st.text(max_size=12),
        "max_run_duration": st.fixed_dictionaries({"seconds": st.integers(-2**40, 2**40)})}),
    "resource_status": st.fixed_dictionaries({}, optional={
        "scheduling": st.fixed_dictionaries({"termination_timestamp": TIMES}),
        "upcoming_maintenance": st.fixed_dictionaries({}, optional={"window_start_time": TIMES,
                                                                    "can_reschedule": st.booleans()})}),
    "last_start_timestamp": TIMES, "machine_type": st.text(max_size=60)}))
def test_compute_instance_answers(doc):
    """instances.get as the Compute API answers it (any field, any time text): scheduling facts or
    ExpiryError naming the field, never another exception (an out-of-range year included)."""
    from google.cloud import compute_v1

    from slurmagent.errors import ExpiryError
    from slurmagent.gcp.compute import scheduling_from_instance

    inst = compute_v1.Instance(doc)
    try:
        timed(lambda: scheduling_from_instance(inst))
    except ExpiryError:
        pass
