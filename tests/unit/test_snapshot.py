"""The replay snapshot format: round trips, optional fields, clear errors, atomic save, CLI."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import healthy_snapshot_dict, write_json, xid_snapshot_dict
from slurmagent.core import snapshot as snapshot_mod
from slurmagent.core.checks import run_checks
from slurmagent.errors import SnapshotError
from slurmagent.state.fsutil import atomic_write_text
from slurmagent.core.snapshot import GpuState, NodeSnapshot, load


def save(snapshot: NodeSnapshot, path) -> None:
    """What `slurmagent snapshot -o FILE` does."""
    atomic_write_text(path, snapshot.to_json())


VENV_BIN = Path(sys.executable).parent

# The example from DESIGN.md "Snapshot replay format", verbatim.
DESIGN_EXAMPLE = json.loads("""
{"schema": 1, "hostname": "n1", "driver_version": "550.90.07",
 "nvml_error": null,
 "gpus": [{"index": 0, "uuid": "GPU-\u2026", "name": "NVIDIA H200", "pci_bus_id": "00000000:04:00.0",
   "lost": false,
   "temperature_c": 41, "power_w": 120.5, "persistence_mode": true,
   "ecc": {"volatile_uncorrected": 0, "aggregate_uncorrected": 0, "volatile_corrected": 0},
   "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": false, "failure": false},
   "retired_pages": {"sbe": 0, "dbe": 0, "pending": false},
   "pcie": {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16},
   "nvlink": [{"link": 0, "active": true, "replay_errors": 0, "recovery_errors": 0, "crc_errors": 0}],
   "clocks_event_reasons": [],
   "recovery_action": 0,
   "xid_events": [{"xid": 79, "time": "2026-11-30T05:00:00Z"}]}]}
""")


# --- round trips ------------------------------------------------------------------------


def test_design_example_parses_field_by_field() -> None:
    snap = NodeSnapshot.from_dict(DESIGN_EXAMPLE)
    assert snap.hostname == "n1" and snap.driver_version == "550.90.07" and snap.nvml_error is None
    g = snap.gpus[0]
    assert (g.index, g.name, g.pci_bus_id, g.lost) == (0, "NVIDIA H200", "00000000:04:00.0", False)
    assert g.temperature_c == 41 and g.power_w == 120.5 and g.persistence_mode is True
    assert g.ecc.volatile_uncorrected == 0
    assert g.remapped_rows.failure is False
    assert g.retired_pages.pending is False
    assert (g.pcie.gen, g.pcie.max_width) == (5, 16)
    assert g.nvlink[0].link == 0 and g.nvlink[0].active is True
    assert g.clocks_event_reasons == []
    assert g.recovery_action == 0
    assert [(e.xid, e.time) for e in g.xid_events] == [(79, "2026-11-30T05:00:00Z")]


def test_design_example_dict_round_trip() -> None:
    assert NodeSnapshot.from_dict(DESIGN_EXAMPLE).to_dict() == DESIGN_EXAMPLE


def test_design_example_file_round_trip(tmp_path) -> None:
    path = tmp_path / "snap.json"
    original = NodeSnapshot.from_dict(DESIGN_EXAMPLE)
    save(original, path)
    again = load(path)
    assert again == original
    assert json.loads(path.read_text()) == DESIGN_EXAMPLE


def test_conftest_fixture_round_trip(tmp_path) -> None:
    data = xid_snapshot_dict(48, gpu=5)
    path = tmp_path / "x.json"
    save(NodeSnapshot.from_dict(data), path)
    assert load(path).to_dict() == data


def test_to_dict_keeps_nvml_error_null_and_drops_unmeasured() -> None:
    d = NodeSnapshot(hostname="n", gpus=[GpuState(index=2)]).to_dict()
    assert d["nvml_error"] is None and d["schema"] == 1
    assert d["gpus"] == [{"index": 2, "lost": False}]
    assert "driver_version" not in d


# --- absent and unknown keys ------------------------------------------------------------


def test_absent_keys_are_not_measured_and_no_fault() -> None:
    snap = NodeSnapshot.from_dict({"schema": 1, "gpus": [{"index": 0}, {}]})
    assert [g.index for g in snap.gpus] == [0, 1]  # index defaults to the position
    g = snap.gpus[0]
    assert g.temperature_c is None and g.recovery_action is None and g.clocks_event_reasons is None
    assert g.ecc.volatile_uncorrected is None and g.pcie.width is None and g.remapped_rows.pending is None
    assert g.lost is False and g.nvlink == [] and g.xid_events == []
    assert run_checks(snap, expected_gpus=2).findings == []


def test_null_values_equal_absent_keys() -> None:
    gpu = {k: None for k in ("uuid", "name", "temperature_c", "power_w", "persistence_mode", "lost",
                             "ecc", "pcie", "remapped_rows", "retired_pages", "nvlink",
                             "clocks_event_reasons", "recovery_action", "xid_events")}
    gpu["index"] = 0
    gpu["nvlink"] = [{"link": None, "active": None}]
    gpu["pcie"] = {"gen": None, "width": 8, "max_width": None}
    snap = NodeSnapshot.from_dict({"schema": 1, "hostname": None, "gpus": [gpu]})
    assert snap.gpus[0].nvlink[0].link == 0
    assert snap.gpus[0].pcie.width == 8
    assert run_checks(snap).findings == []


def test_partial_nested_objects() -> None:
    snap = NodeSnapshot.from_dict({"schema": 1, "gpus": [{"index": 0, "ecc": {"volatile_uncorrected": 2}}]})
    assert snap.gpus[0].ecc.volatile_uncorrected == 2
    assert snap.gpus[0].ecc.aggregate_uncorrected is None


def test_unknown_keys_are_ignored_at_every_level() -> None:
    data = copy.deepcopy(DESIGN_EXAMPLE)
    data["future_top"] = {"x": [1, 2]}
    g = data["gpus"][0]
    g["mig_mode"] = "enabled"
    g["ecc"]["sram_uncorrected"] = 3
    g["pcie"]["replay_counter"] = 9
    g["nvlink"][0]["bandwidth"] = "400GB/s"
    g["xid_events"][0]["pid"] = 1234
    assert NodeSnapshot.from_dict(data) == NodeSnapshot.from_dict(DESIGN_EXAMPLE)


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("schema", [2, 0, "1", None, True, 1.5])
def test_unsupported_schema(schema) -> None:
    data = healthy_snapshot_dict()
    if schema is None:
        del data["schema"]
    else:
        data["schema"] = schema
    with pytest.raises(SnapshotError) as exc:
        NodeSnapshot.from_dict(data, source="snapshot s.json")
    msg = str(exc.value)
    assert "s.json" in msg and "unsupported schema" in msg and repr(schema) in msg and "schema 1" in msg


def test_unsupported_schema_from_file_names_file(tmp_path) -> None:
    path = write_json(tmp_path / "v2.json", {**healthy_snapshot_dict(), "schema": 2})
    with pytest.raises(SnapshotError) as exc:
        load(path)
    assert str(path) in str(exc.value) and "unsupported schema 2" in str(exc.value)


@pytest.mark.parametrize("top", [[], "x", 3, None])
def test_top_level_must_be_object(top) -> None:
    with pytest.raises(SnapshotError, match="object"):
        NodeSnapshot.from_dict(top)


def test_broken_json_names_line_and_column(tmp_path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"schema": 1,\n "gpus": [\n  {"index": 0,, }\n ]}\n')
    with pytest.raises(SnapshotError) as exc:
        load(path)
    msg = str(exc.value)
    assert str(path) in msg and "line 3 column 15" in msg
    assert "\n" not in msg


def test_missing_file(tmp_path) -> None:
    with pytest.raises(SnapshotError) as exc:
        load(tmp_path / "none.json")
    assert "none.json" in str(exc.value)


def test_not_utf8(tmp_path) -> None:
    path = tmp_path / "bin.json"
    path.write_bytes(b'{"schema": 1, "hostname": "\xff"}')
    with pytest.raises(SnapshotError) as exc:
        load(path)
    assert str(path) in str(exc.value)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda g: g["ecc"].update(volatile_uncorrected="0"), "gpus[1].ecc.volatile_uncorrected"),
        (lambda g: g["remapped_rows"].update(pending="no"), "gpus[1].remapped_rows.pending"),
        (lambda g: g["pcie"].update(width=16.0), "gpus[1].pcie.width"),
        (lambda g: g["nvlink"][2].update(active=1), "gpus[1].nvlink[2].active"),
        (lambda g: g.update(temperature_c="hot"), "gpus[1].temperature_c"),
        (lambda g: g.update(lost="false"), "gpus[1].lost"),
        (lambda g: g.update(recovery_action=True), "gpus[1].recovery_action"),
        (lambda g: g.update(index="1"), "gpus[1].index"),
        (lambda g: g.update(ecc=[0, 0]), "gpus[1].ecc"),
        (lambda g: g.update(nvlink={"link": 0}), "gpus[1].nvlink"),
        (lambda g: g.update(clocks_event_reasons="hw_slowdown"), "gpus[1].clocks_event_reasons"),
        (lambda g: g.update(xid_events=[{"xid": "79"}]), "gpus[1].xid_events[0]"),
        (lambda g: g.update(xid_events=[{"xid": 79, "time": 1700000000}]), "gpus[1].xid_events[0].time"),
    ],
)
def test_wrong_nested_type_names_the_field(mutate, field: str) -> None:
    data = healthy_snapshot_dict(n=2)
    mutate(data["gpus"][1])
    with pytest.raises(SnapshotError) as exc:
        NodeSnapshot.from_dict(data, source="snapshot s.json")
    assert field in str(exc.value)
    assert str(exc.value).startswith("snapshot s.json: ")


def test_wrong_top_level_types() -> None:
    with pytest.raises(SnapshotError, match="gpus"):
        NodeSnapshot.from_dict({"schema": 1, "gpus": {"0": {}}})
    with pytest.raises(SnapshotError, match="hostname"):
        NodeSnapshot.from_dict({"schema": 1, "hostname": 7})
    with pytest.raises(SnapshotError, match=r"gpus\[0\]"):
        NodeSnapshot.from_dict({"schema": 1, "gpus": ["gpu0"]})


# --- atomic save --------------------------------------------------------------------------


def test_save_leaves_no_temp_files(tmp_path) -> None:
    path = tmp_path / "out" / "snap.json"
    snap = NodeSnapshot.from_dict(healthy_snapshot_dict())
    save(snap, path)
    save(snap, path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["snap.json"]
    assert load(path) == snap


def test_failed_save_keeps_old_file_and_removes_temp(tmp_path, monkeypatch) -> None:
    path = tmp_path / "snap.json"
    old = NodeSnapshot.from_dict(healthy_snapshot_dict())
    save(old, path)

    def boom(src, dst, **dir_fds):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_mod.os, "replace", boom)
    with pytest.raises(OSError):
        save(NodeSnapshot.from_dict(xid_snapshot_dict()), path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap.json"]
    assert load(path) == old


# --- fuzz: any JSON value parses or is a SnapshotError ------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)

GPU_KEYS = ["index", "uuid", "name", "pci_bus_id", "lost", "temperature_c", "power_w", "persistence_mode",
            "ecc", "remapped_rows", "retired_pages", "pcie", "nvlink", "clocks_event_reasons",
            "recovery_action", "xid_events"]
NESTED_KEYS = ["volatile_uncorrected", "pending", "failure", "width", "max_width", "link", "active",
               "replay_errors", "xid", "time", "detail"]
nested = st.dictionaries(st.sampled_from(NESTED_KEYS), json_values, max_size=4)
gpu_values = json_values | nested | st.lists(nested | json_values, max_size=3)
gpus = st.lists(st.dictionaries(st.sampled_from(GPU_KEYS), gpu_values, max_size=6) | json_values, max_size=3)
near_valid = st.fixed_dictionaries(
    {"schema": st.just(1) | json_values},
    optional={"hostname": json_values, "driver_version": json_values, "nvml_error": json_values, "gpus": gpus},
)


def parse_or_snapshot_error(data) -> None:
    try:
        snap = NodeSnapshot.from_dict(data)
    except SnapshotError as exc:
        assert str(exc)
        return
    # whatever parsed must also survive the checks and a round trip
    run_checks(snap, expected_gpus=1)
    assert NodeSnapshot.from_dict(json.loads(json.dumps(snap.to_dict()))).to_dict() == json.loads(
        json.dumps(snap.to_dict()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_fuzz_arbitrary_json(data) -> None:
    parse_or_snapshot_error(data)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_valid)
def test_fuzz_near_valid_snapshots(data) -> None:
    parse_or_snapshot_error(data)


# --- CLI ----------------------------------------------------------------------------------


@pytest.fixture
def cli_env(tmp_path) -> tuple[Path, dict[str, str]]:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[health]\nexpected_gpus = 8\n[hooks]\nsyslog = false\n')
    env = {k: v for k, v in os.environ.items() if k != "SLURMAGENT_CONFIG"}
    env["SLURM_CONF"] = str(tmp_path / "no-slurm.conf")
    return cfg, env


def check_cli(cli_env, *args: str) -> subprocess.CompletedProcess:
    cfg, env = cli_env
    return subprocess.run([str(VENV_BIN / "slurmagent"), "--config", str(cfg), "check", "--node", "n1", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_cli_broken_snapshot_exits_2_with_one_line(cli_env, tmp_path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"schema": 1, "gpus": [\n')
    proc = check_cli(cli_env, "--snapshot", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "line 2" in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_healthy_snapshot_exits_0(cli_env, tmp_path) -> None:
    path = write_json(tmp_path / "h.json", healthy_snapshot_dict())
    proc = check_cli(cli_env, "--snapshot", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "healthy" in proc.stdout and "UNHEALTHY" not in proc.stdout


def test_cli_xid79_exits_1_with_drain_reason(cli_env, tmp_path) -> None:
    path = write_json(tmp_path / "x.json", xid_snapshot_dict(79, gpu=3))
    proc = check_cli(cli_env, "--snapshot", str(path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "UNHEALTHY" in proc.stdout
    assert "slurmagent: xid 79 on gpu 3 (fallen off the bus)" in proc.stdout


def test_cli_missing_gpu_exits_1(cli_env, tmp_path) -> None:
    path = write_json(tmp_path / "seven.json", healthy_snapshot_dict(n=7))
    proc = check_cli(cli_env, "--snapshot", str(path))
    assert proc.returncode == 1
    assert "7 of 8" in proc.stdout


@pytest.mark.parametrize(("data", "healthy", "code"), [
    (healthy_snapshot_dict(), True, 0),
    (xid_snapshot_dict(79, gpu=3), False, 1),
])
def test_cli_json_output(cli_env, tmp_path, data, healthy: bool, code: int) -> None:
    path = write_json(tmp_path / "s.json", data)
    proc = check_cli(cli_env, "--snapshot", str(path), "--json")
    assert proc.returncode == code
    out = json.loads(proc.stdout)
    assert out["healthy"] is healthy
    assert out["node"] == "n1" and out["gpus_seen"] == 8 and out["expected_gpus"] == 8
    if healthy:
        assert out["findings"] == []
    else:
        f = out["findings"][0]
        assert (f["rule"], f["gpu"], f["observed"], f["severity"]) == ("xid", 3, 79, "drain")


def test_cli_deeply_nested_snapshot_exits_2_with_one_line(cli_env, tmp_path) -> None:
    """100,000 nested arrays once ended in a RecursionError traceback and rc 1, read as "unhealthy"."""
    path = tmp_path / "deep.json"
    path.write_text('{"schema": 1, "gpus": ' + "[" * 100_000 + "]" * 100_000 + "}")
    proc = check_cli(cli_env, "--snapshot", str(path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"slurmagent: snapshot {path} is not a snapshot: JSON nested too deeply\n"
    assert proc.stdout == ""


@pytest.mark.parametrize(("indexes", "message"), [
    ([0, 1, 2, 3, 0, 1, 2, 3], "gpus[4].index 0 repeats gpus[0]'s"),
    ([0, 1, 2, 3, 4, 5, 6, 6], "gpus[7].index 6 repeats gpus[6]'s"),
    ([0, 1, 2, 3, 4, 5, 6, -1], "gpus[7].index must not be negative, not -1"),
])
def test_cli_duplicate_or_negative_gpu_index_exits_2(cli_env, tmp_path, indexes, message) -> None:
    """Four GPUs listed twice were eight GPUs to the count check: a healthy verdict for half a node."""
    data = healthy_snapshot_dict(n=len(indexes))
    for gpu, index in zip(data["gpus"], indexes):
        gpu["index"] = index
    path = write_json(tmp_path / "dup.json", data)
    proc = check_cli(cli_env, "--snapshot", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"slurmagent: snapshot {path}: {message}\n"


def test_gpu_index_defaults_to_position_and_may_skip() -> None:
    snap = NodeSnapshot.from_dict({"schema": 1, "gpus": [{}, {}, {"index": 5}]})
    assert [g.index for g in snap.gpus] == [0, 1, 5]
    with pytest.raises(SnapshotError, match=r"gpus\[1\]\.index 0 repeats gpus\[0\]'s"):
        NodeSnapshot.from_dict({"schema": 1, "gpus": [{}, {"index": 0}]})


def test_cli_integer_too_long_to_convert_exits_2(cli_env, tmp_path) -> None:
    path = tmp_path / "digits.json"
    path.write_text('{"schema": 1, "gpus": [{"temperature_c": 1' + "0" * 5000 + "}]}")
    proc = check_cli(cli_env, "--snapshot", str(path))
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"slurmagent: snapshot {path} is not a snapshot: Exceeds the limit")
