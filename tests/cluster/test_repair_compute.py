"""gcp/compute.py with the real google-cloud-compute client against the fake on 127.0.0.1.

Timing (parallel lanes): nothing here is in the serial group; deadlines are asserted as the
number of requests they allow, with wall bounds that only catch a hang.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from support import REPO
from support.fake_gcp import FakeGcp
from slurmagent.gcp.compute import Compute, ComputeError, chunk_request_id, is_local_endpoint
from slurmagent.gcp.metadata import MigRef

ZONE = "us-central1-a"


@pytest.fixture
def fake():
    f = FakeGcp().start()
    yield f
    f.stop()


def compute(fake, **kw) -> Compute:
    kw.setdefault("backoff_s", 0.01)
    return Compute(fake.project, fake.url, **kw)


def test_local_endpoint_detection():
    assert is_local_endpoint("http://127.0.0.1:8080") and is_local_endpoint("http://localhost:1")
    assert not is_local_endpoint("https://compute.googleapis.com") and not is_local_endpoint("http://10.0.0.1:80")


def test_instance_mig_zonal_regional_and_none(fake):
    fake.add_instance("a", ZONE, mig="mig-a")
    fake.add_instance("b", ZONE, mig="mig-r", region="us-central1")
    fake.add_instance("c", ZONE)
    c = compute(fake)
    assert c.instance_mig(ZONE, "a") == MigRef(fake.project_number, "zones", ZONE, "mig-a")
    assert c.instance_mig(ZONE, "b") == MigRef(fake.project_number, "regions", "us-central1", "mig-r")
    assert c.instance_mig(ZONE, "c") is None
    assert c.calls["instances.get"] == 3


def test_recreate_chunks_beyond_1000(fake):
    names = [f"g{i}" for i in range(1001)]
    for n in names:
        fake.add_instance(n, ZONE, mig="big")
    c = compute(fake)
    rid = str(uuid.uuid4())
    ops = c.recreate(MigRef("1", "zones", ZONE, "big"), [(ZONE, n) for n in names], rid)
    calls = fake.calls_of("instanceGroupManagers.recreateInstances")
    assert [len(x.body["instances"]) for x in calls] == [1000, 1]
    assert [x.query["requestId"] for x in calls] == [rid, chunk_request_id(rid, 1)]
    assert len(ops) == 2


def test_replayed_request_id_does_not_act_twice(fake):
    fake.add_instance("a", ZONE, mig="m")
    c = compute(fake)
    rid = str(uuid.uuid4())
    mig = MigRef("1", "zones", ZONE, "m")
    first = c.recreate(mig, [(ZONE, "a")], rid)
    again = c.recreate(mig, [(ZONE, "a")], rid)
    assert first == again and fake.instances[(ZONE, "a")].recreated == 1


def test_retries_429_and_5xx_then_gives_up_with_a_retriable_error(fake):
    fake.add_instance("a", ZONE, mig="m")
    c = compute(fake, retries=2)
    fake.fail("instances.get", 429, 503)
    assert c.instance_mig(ZONE, "a") is not None
    fake.fail("instances.get", 500, 500, 500)
    with pytest.raises(ComputeError) as info:
        c.instance_mig(ZONE, "a")
    assert info.value.status == 500 and info.value.retriable and "after 3 attempts" in str(info.value)


@pytest.mark.parametrize("code", [403, 404])
def test_403_404_are_not_retried(fake, code):
    fake.add_instance("a", ZONE, mig="m")
    fake.fail("instanceGroupManagers.recreateInstances", code)
    c = compute(fake)
    with pytest.raises(ComputeError) as info:
        c.recreate(MigRef("1", "zones", ZONE, "m"), [(ZONE, "a")], str(uuid.uuid4()))
    assert info.value.status == code and not info.value.retriable
    assert len(fake.calls_of("instanceGroupManagers.recreateInstances")) == 1


def test_operation_polled_on_the_same_endpoint_until_done(fake):
    fake.add_instance("a", ZONE, mig="m")
    fake.polls_until_done = 3
    slept = []
    c = compute(fake, sleep=slept.append)
    [op] = c.recreate(MigRef("1", "zones", ZONE, "m"), [(ZONE, "a")], str(uuid.uuid4()))
    c.wait(op, poll_s=0.01)
    assert len(fake.calls_of("zoneOperations.get")) == 3 and len(slept) == 2


def test_operation_error_is_reported(fake):
    fake.add_instance("a", ZONE, mig="m")
    fake.op_errors.append({"code": "RESOURCE_NOT_READY", "message": "instance is being deleted", "status": 400})
    c = compute(fake)
    [op] = c.recreate(MigRef("1", "zones", ZONE, "m"), [(ZONE, "a")], str(uuid.uuid4()))
    with pytest.raises(ComputeError) as info:
        c.wait(op)
    assert "RESOURCE_NOT_READY: instance is being deleted" in str(info.value) and info.value.status == 400


def test_operation_deadline(fake):
    fake.add_instance("a", ZONE, mig="m")
    fake.polls_until_done = 10**6
    c = compute(fake)
    [op] = c.recreate(MigRef("1", "zones", ZONE, "m"), [(ZONE, "a")], str(uuid.uuid4()))
    start = time.monotonic()
    with pytest.raises(ComputeError, match="not done within the deadline"):
        c.wait(op, deadline_s=0.5, poll_s=0.1)
    # polls at 0, 0.1, 0.25 and 0.475 s at the most (0.1 s growing 1.5x), then the next would pass
    # the deadline: a loaded machine makes fewer, never more; the wall bound only catches a hang
    assert 1 <= len(fake.calls_of("zoneOperations.get")) <= 4
    assert time.monotonic() - start < 0.5 + 10


def test_unreachable_endpoint_fails_within_the_deadline():
    from google.cloud import compute_v1  # noqa: F401 - imported before the clock starts (seconds, loaded)

    c = Compute("p", "http://127.0.0.1:9", retries=1, backoff_s=0.01, call_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(ComputeError) as info:
        c.instance_mig(ZONE, "a")
    # the retries it was given (2 tries of at most call_timeout_s each), then a retriable error;
    # the wall bound only catches a hang (the default deadline is 120 s)
    assert info.value.retriable and sum(c.calls.values()) == 2, c.calls
    assert time.monotonic() - start < 2 * 1 + 10


def test_report_faulty_request(fake):
    fake.add_instance("a", ZONE, machine_type="a3-ultragpu-8g", provisioning_model="RESERVATION_BOUND")
    c = compute(fake)
    op = c.report_faulty(ZONE, "a", "UNRECOVERABLE_GPU_ERROR", "slurmagent: xid 79 on gpu 3", str(uuid.uuid4()))
    c.wait(op)
    [call] = fake.calls_of("instances.reportHostAsFaulty")
    assert call.body == {"disruptionSchedule": "IMMEDIATE", "faultReasons": [
        {"behavior": "UNRECOVERABLE_GPU_ERROR", "description": "slurmagent: xid 79 on gpu 3"}]}
    assert fake.instances[(ZONE, "a")].reported == 1


def test_healthy_prolog_path_imports_no_google_module(tmp_path):
    code = ("import sys, slurmagent.commands.hooks, slurmagent.hookmain, slurmagent.commands.repair, slurmagent.state.journal, "
            "slurmagent.policy, slurmagent.gcp.compute, slurmagent.gcp.metadata\n"
            "bad = [m for m in sys.modules if m.startswith('google')]\nprint(bad)\nsys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- what `repair` decides by, and Google's refusal of reportHostAsFaulty ---------------------


def test_vm_facts_through_the_real_client(fake):
    fake.add_instance("u1", ZONE, mig="mig-u", machine_type="a3-ultragpu-8g", provisioning_model="RESERVATION_BOUND",
                      reservation="SPECIFIC_RESERVATION")
    fake.add_instance("f1", ZONE, mig="mig-f", machine_type="a3-highgpu-8g", provisioning_model="FLEX_START", gpus=8)
    fake.add_instance("c1", ZONE, machine_type="n2-standard-8", gpus=0, status="TERMINATED")
    c = compute(fake)
    u1, f1, c1 = (c.vm(ZONE, n) for n in ("u1", "f1", "c1"))
    assert (u1.machine_type, u1.provisioning_model, u1.reservation, u1.status, u1.gpus) == (
        "a3-ultragpu-8g", "RESERVATION_BOUND", "SPECIFIC_RESERVATION", "RUNNING", 8)
    assert u1.mig == MigRef(fake.project_number, "zones", ZONE, "mig-u").to_dict() and u1.zone == ZONE
    assert u1.reservation_bound and u1.gpu_vm and not f1.reservation_bound and f1.provisioning_model == "FLEX_START"
    assert c1.mig is None and c1.status == "TERMINATED" and not c1.gpu_vm


def test_find_vms_in_listed_zones_or_one_aggregated_list(fake):
    fake.add_instance("r1", "us-central1-a", mig="mig-r", region="us-central1")
    fake.add_instance("r2", "us-central1-b", mig="mig-r", region="us-central1")
    fake.add_instance("r3.x", "us-central1-c")
    fake.add_instance("r10", "us-central1-b")  # a name the filter must not take for r1
    c = compute(fake)
    found = c.find_vms(["r1", "r2", "r3.x", "gone"])
    assert {n: v.zone for n, v in found.items()} == {"r1": "us-central1-a", "r2": "us-central1-b",
                                                      "r3.x": "us-central1-c"}
    [agg] = fake.calls_of("instances.aggregatedList")
    assert agg.query["filter"] == 'name eq "(r1|r2|r3\\.x|gone)"'
    found = c.find_vms(["r1", "r2"], zones=["us-central1-b", "us-central1-c"])
    assert list(found) == ["r2"] and found["r2"].mig["scope"] == "regions"
    assert [x.path.split("/")[-2] for x in fake.calls_of("instances.list")] == ["us-central1-b", "us-central1-c"]


@pytest.mark.parametrize("in_operation", [False, True])
def test_report_faulty_refused_for_a_flex_vm_as_google_does(fake, in_operation):
    fake.refuse_in_operation = in_operation
    fake.add_instance("f1", ZONE, mig="m", provisioning_model="FLEX_START", machine_type="a3-ultragpu-8g")
    c = compute(fake)
    with pytest.raises(ComputeError) as info:
        op = c.report_faulty(ZONE, "f1", "UNRECOVERABLE_GPU_ERROR", "slurmagent: xid 79", str(uuid.uuid4()))
        c.wait(op)
    assert info.value.refused and not info.value.retriable and info.value.status == 400
    assert "INSTANCES_WITHOUT_RESERVATION_NOT_SUPPORTED" in str(info.value)
    assert len(fake.calls_of("instances.reportHostAsFaulty")) == 1 and fake.instances[(ZONE, "f1")].reported == 0
