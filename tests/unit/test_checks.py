"""Health verdicts (DESIGN.md "Health verdicts"): one test per rule, on replay snapshots."""

from __future__ import annotations

import re

import pytest

from support import healthy_snapshot_dict, xid_snapshot_dict
from slurmagent.core.checks import RULE_ORDER, Limits, Report, Severity, run_checks, timeout_report
from slurmagent.core.reasons import reason_for
from slurmagent.core.snapshot import GpuState, NodeSnapshot

REASON_CHARS = re.compile(r"^[A-Za-z0-9 _.,:;/()@+#%-]*$")
DRAIN_XIDS = [48, 62, 64, 74, 79, 95, 109, 119, 120]
WARN_XIDS = [8, 13, 31, 43, 45, 94, 63, 92]


def judge(data: dict, expected: int | None = 8, limits: Limits = Limits(), kernel_xids=()) -> Report:
    return run_checks(NodeSnapshot.from_dict(data), expected, limits, kernel_xids)


def with_gpu(gpu: int = 2, **changes) -> dict:
    """The healthy 8-GPU node with `changes` applied to one GPU (nested dicts are merged)."""
    d = healthy_snapshot_dict()
    g = d["gpus"][gpu]
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(g.get(key), dict):
            g[key] = {**g[key], **value}
        else:
            g[key] = value
    return d


def only(report: Report, severity: Severity | None = None):
    found = [f for f in report.findings if severity is None or f.severity is severity]
    assert len(found) == 1, [f.summary for f in report.findings]
    return found[0]


def assert_reason_ok(report: Report) -> str:
    reason = reason_for(report)
    assert reason.startswith("slurmagent:")
    assert len(reason) <= 200
    assert REASON_CHARS.match(reason), reason
    return reason


def test_healthy_node_has_no_findings() -> None:
    report = judge(healthy_snapshot_dict())
    assert report.healthy and report.findings == [] and report.worst is None
    assert report.gpus_seen == 8


# --- node-level verdicts ----------------------------------------------------------------


def test_nvml_cannot_start() -> None:
    d = healthy_snapshot_dict()
    d["nvml_error"] = "NVML_ERROR_DRIVER_NOT_LOADED"
    d["gpus"] = []
    report = judge(d)
    assert not report.healthy
    f = only(report)
    assert f.rule == "nvml-error" and f.severity is Severity.DRAIN
    assert f.observed == "NVML_ERROR_DRIVER_NOT_LOADED"
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in assert_reason_ok(report)


@pytest.mark.parametrize("seen", [0, 5, 7])
def test_fewer_gpus_than_expected(seen: int) -> None:
    report = judge(healthy_snapshot_dict(n=seen), expected=8)
    f = only(report)
    assert (f.rule, f.severity, f.observed, f.gpu) == ("gpu-count", Severity.DRAIN, seen, None)
    assert f"{seen} of 8" in assert_reason_ok(report)


@pytest.mark.parametrize(("seen", "expected"), [(8, 8), (8, None), (8, 4), (0, None), (0, 0)])
def test_enough_gpus(seen: int, expected: int | None) -> None:
    assert judge(healthy_snapshot_dict(n=seen), expected=expected).findings == []


def test_nvml_timeout_report() -> None:
    report = timeout_report(15, 8)
    assert not report.healthy and report.worst.rule == "nvml-timeout"
    assert "15" in assert_reason_ok(report)


# --- per-GPU drain verdicts -------------------------------------------------------------


def test_gpu_lost() -> None:
    report = judge(with_gpu(5, lost=True))
    f = only(report)
    assert (f.rule, f.severity, f.gpu, f.observed) == ("gpu-lost", Severity.DRAIN, 5, True)
    assert "gpu 5" in assert_reason_ok(report)


@pytest.mark.parametrize("code", DRAIN_XIDS)
def test_drain_class_xid(code: int) -> None:
    report = judge(xid_snapshot_dict(code, gpu=6))
    assert not report.healthy
    f = only(report)
    assert (f.rule, f.severity, f.gpu, f.observed) == ("xid", Severity.DRAIN, 6, code)
    assert assert_reason_ok(report).startswith(f"slurmagent: xid {code} on gpu 6 (")


@pytest.mark.parametrize("code", WARN_XIDS)
def test_warn_only_xid(code: int) -> None:
    report = judge(xid_snapshot_dict(code, gpu=1))
    assert report.healthy and report.worst is None
    f = only(report)
    assert (f.severity, f.gpu, f.observed) == (Severity.WARN, 1, code)
    assert f.rule == "xid-app"
    assert f"xid {code} on gpu 1" in f.summary


def test_xid79_reason_text() -> None:
    assert reason_for(judge(xid_snapshot_dict(79, gpu=3))) == "slurmagent: xid 79 on gpu 3 (fallen off the bus)"


def test_kernel_log_xids_are_judged_like_snapshot_xids() -> None:
    report = judge(healthy_snapshot_dict(), kernel_xids=[(4, 79, ""), (2, 13, "")])
    assert not report.healthy
    assert report.worst.gpu == 4 and report.worst.observed == 79
    assert {(f.rule, f.gpu) for f in report.findings} == {("xid", 4), ("xid-app", 2)}


def test_kernel_xid_with_unknown_gpu() -> None:
    report = judge(healthy_snapshot_dict(), kernel_xids=[(None, 79, "")])
    assert report.worst.gpu is None
    assert "xid 79" in assert_reason_ok(report)


@pytest.mark.parametrize("count", [1, 17])
def test_volatile_uncorrectable_ecc(count: int) -> None:
    report = judge(with_gpu(0, ecc={"volatile_uncorrected": count}))
    f = only(report)
    assert (f.rule, f.severity, f.gpu, f.observed) == ("ecc-uncorrectable", Severity.DRAIN, 0, count)
    assert str(count) in f.detail


def test_aggregate_uncorrectable_ecc_is_only_a_warning() -> None:
    report = judge(with_gpu(0, ecc={"aggregate_uncorrected": 3}))
    assert report.healthy
    assert only(report).observed == 3


@pytest.mark.parametrize(("field", "rule"), [("failure", "row-remap-failure"), ("pending", "row-remap-pending")])
def test_row_remap(field: str, rule: str) -> None:
    report = judge(with_gpu(7, remapped_rows={field: True}))
    f = only(report)
    assert (f.rule, f.severity, f.gpu, f.observed) == (rule, Severity.DRAIN, 7, True)
    assert "gpu 7" in assert_reason_ok(report)


def test_row_remap_counts_alone_are_healthy() -> None:
    assert judge(with_gpu(7, remapped_rows={"correctable": 12, "uncorrectable": 2})).healthy


def test_retired_pages_pending() -> None:
    report = judge(with_gpu(3, retired_pages={"sbe": 2, "dbe": 1, "pending": True}))
    f = only(report)
    assert (f.rule, f.severity, f.gpu, f.observed) == ("retired-pages-pending", Severity.DRAIN, 3, True)


def test_retired_pages_not_pending_is_healthy() -> None:
    assert judge(with_gpu(3, retired_pages={"sbe": 2, "dbe": 1, "pending": False})).findings == []


def test_inactive_nvlink() -> None:
    d = healthy_snapshot_dict()
    d["gpus"][4]["nvlink"][11]["active"] = False
    report = judge(d)
    f = only(report)
    assert (f.rule, f.severity, f.gpu, f.observed) == ("nvlink-down", Severity.DRAIN, 4, 11)
    assert "11" in assert_reason_ok(report) and "gpu 4" in reason_for(report)


def test_nvlink_errors_warn_at_limit() -> None:
    d = healthy_snapshot_dict()
    d["gpus"][4]["nvlink"][0].update(replay_errors=5, recovery_errors=3, crc_errors=2)
    assert judge(d, limits=Limits(nvlink_errors_warn=11)).findings == []
    report = judge(d, limits=Limits(nvlink_errors_warn=10))
    f = only(report)
    assert report.healthy and (f.rule, f.gpu, f.observed) == ("nvlink-errors", 4, 10)


def test_pcie_width_below_max_drains() -> None:
    report = judge(with_gpu(1, pcie={"width": 8, "max_width": 16}))
    f = only(report)
    assert (f.rule, f.severity, f.gpu, f.observed) == ("pcie-width", Severity.DRAIN, 1, 8)
    assert "x8" in assert_reason_ok(report)


def test_pcie_gen_below_max_only_warns() -> None:
    report = judge(with_gpu(1, pcie={"gen": 1, "max_gen": 5}))
    assert report.healthy
    f = only(report)
    assert (f.rule, f.severity, f.gpu, f.observed) == ("pcie-gen", Severity.WARN, 1, 1)


@pytest.mark.parametrize(("action", "word"), [(1, "gpu reset"), (2, "node reboot"), (3, "drain p2p"), (4, "drain and reset")])
def test_recovery_action(action: int, word: str) -> None:
    report = judge(with_gpu(2, recovery_action=action))
    f = only(report)
    assert (f.rule, f.severity, f.gpu, f.observed) == ("recovery-action", Severity.DRAIN, 2, action)
    assert word in assert_reason_ok(report)


@pytest.mark.parametrize("reason", ["hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"])
def test_hardware_slowdown(reason: str) -> None:
    report = judge(with_gpu(5, clocks_event_reasons=[reason]))
    f = only(report)
    assert (f.rule, f.severity, f.gpu) == ("hw-slowdown", Severity.DRAIN, 5)
    assert reason in f.observed
    assert reason in assert_reason_ok(report)


@pytest.mark.parametrize("reason", ["sw_power_cap", "gpu_idle", "sw_thermal_slowdown"])
def test_soft_clock_reasons_only_warn(reason: str) -> None:
    report = judge(with_gpu(0, clocks_event_reasons=[reason]))
    assert report.healthy
    f = only(report)
    assert (f.severity, f.gpu, f.observed) == (Severity.WARN, 0, reason)


def test_temperature_warning_at_and_above_limit() -> None:
    limits = Limits(temperature_warn_c=80)
    assert judge(with_gpu(6, temperature_c=79.9), limits=limits).findings == []
    for temp in (80, 95):
        report = judge(with_gpu(6, temperature_c=temp), limits=limits)
        f = only(report)
        assert report.healthy and (f.rule, f.severity, f.gpu, f.observed) == ("temperature", Severity.WARN, 6, temp)


def test_default_temperature_limit() -> None:
    assert judge(with_gpu(0, temperature_c=84)).findings == []
    assert only(judge(with_gpu(0, temperature_c=85))).rule == "temperature"


def test_corrected_ecc_warning_uses_limit() -> None:
    report = judge(with_gpu(0, ecc={"volatile_corrected": 50}), limits=Limits(ecc_corrected_warn=50))
    assert report.healthy and only(report).rule == "ecc-corrected"


# --- worst finding, drain reason --------------------------------------------------------


def test_worst_follows_rule_order_not_gpu_order() -> None:
    d = healthy_snapshot_dict()
    d["gpus"][0]["pcie"]["width"] = 4          # pcie-width on gpu 0
    d["gpus"][5]["ecc"]["volatile_uncorrected"] = 1  # ecc on gpu 5
    d["gpus"][7]["xid_events"] = [{"xid": 79}]  # xid on gpu 7
    d["gpus"][3]["temperature_c"] = 99          # warning only
    report = judge(d)
    assert report.worst.rule == "xid" and report.worst.gpu == 7
    assert reason_for(report) == "slurmagent: xid 79 on gpu 7 (fallen off the bus)"


def test_worst_prefers_lost_gpu_over_everything_per_gpu() -> None:
    d = with_gpu(2, recovery_action=1)
    d["gpus"][6]["lost"] = True
    assert judge(d).worst.rule == "gpu-lost"


def test_worst_ties_break_on_lowest_gpu() -> None:
    d = with_gpu(6, pcie={"width": 8})
    d["gpus"][3]["pcie"]["width"] = 8
    assert judge(d).worst.gpu == 3


def test_worst_matches_rule_order_for_every_pair() -> None:
    makers = {
        "gpu-lost": lambda g: g.update(lost=True),
        "xid": lambda g: g.update(xid_events=[{"xid": 48}]),
        "recovery-action": lambda g: g.update(recovery_action=2),
        "ecc-uncorrectable": lambda g: g["ecc"].update(volatile_uncorrected=1),
        "row-remap-failure": lambda g: g["remapped_rows"].update(failure=True),
        "row-remap-pending": lambda g: g["remapped_rows"].update(pending=True),
        "retired-pages-pending": lambda g: g.update(retired_pages={"pending": True}),
        "nvlink-down": lambda g: g["nvlink"][0].update(active=False),
        "pcie-width": lambda g: g["pcie"].update(width=8),
        "hw-slowdown": lambda g: g.update(clocks_event_reasons=["hw_slowdown"]),
    }
    rules = list(makers)
    assert rules == [r for r in RULE_ORDER if r in makers]
    for i, a in enumerate(rules):
        for b in rules[i + 1:]:
            d = healthy_snapshot_dict()
            makers[b](d["gpus"][0])  # the less severe one on the lower GPU
            makers[a](d["gpus"][1])
            assert judge(d).worst.rule == a, (a, b)


def test_every_finding_names_gpu_rule_and_observed() -> None:
    d = healthy_snapshot_dict()
    d["gpus"][1]["pcie"].update(width=8, gen=3)
    d["gpus"][2]["ecc"].update(volatile_uncorrected=2, volatile_corrected=20000)
    d["gpus"][3]["clocks_event_reasons"] = ["hw_thermal_slowdown", "sw_power_cap"]
    d["gpus"][4]["remapped_rows"].update(pending=True, failure=True)
    d["gpus"][5]["xid_events"] = [{"xid": 13}, {"xid": 119}]
    d["gpus"][6].update(temperature_c=90, recovery_action=1, persistence_mode=False)
    d["gpus"][7]["nvlink"][3].update(active=False, crc_errors=5000)
    report = judge(d)
    assert len(report.findings) >= 14
    for f in report.findings:
        assert f.gpu is not None and f.rule and f.observed is not None
        assert f"gpu {f.gpu}" in f.summary
        as_dict = f.to_dict()
        assert as_dict["gpu"] == f.gpu and as_dict["rule"] == f.rule and as_dict["severity"] in ("warn", "drain")


def test_reason_is_sanitised_and_bounded() -> None:
    d = healthy_snapshot_dict()
    d["nvml_error"] = "NVML_ERROR_UNKNOWN'; `reboot` $(rm -rf /)\n\"x\"=y " + "z" * 500
    report = judge(d)
    reason = assert_reason_ok(report)
    for bad in ("'", '"', "`", "$", "\n", "="):
        assert bad not in reason


# --- missing fields never count as a fault ----------------------------------------------


def test_unmeasured_gpus_produce_no_findings() -> None:
    d = {"schema": 1, "gpus": [{"index": i} for i in range(8)]}
    assert judge(d, expected=8).findings == []


def test_partially_measured_values_produce_no_findings() -> None:
    d = {"schema": 1, "gpus": [{
        "index": 0,
        "pcie": {"width": 8},             # no max: nothing to compare
        "ecc": {"volatile_corrected": None},
        "remapped_rows": {"correctable": 3},
        "nvlink": [{"link": 0}],            # active not measured
        "clocks_event_reasons": None,
        "temperature_c": None,
        "recovery_action": None,
        "persistence_mode": None,
    }, {"index": 1, "pcie": {"gen": 3}}]}
    assert judge(d, expected=2).findings == []


@pytest.mark.parametrize("key", ["temperature_c", "persistence_mode", "ecc", "remapped_rows", "pcie", "nvlink",
                                 "clocks_event_reasons", "recovery_action", "lost"])
def test_dropping_any_key_stays_healthy(key: str) -> None:
    d = healthy_snapshot_dict()
    for g in d["gpus"]:
        del g[key]
    assert judge(d).findings == []


def test_a_gpu_listed_twice_counts_once() -> None:
    """Whatever built the snapshot, the count check counts GPUs (distinct indexes), not list entries."""
    gpus = [GpuState(index=i % 4) for i in range(8)]
    report = run_checks(NodeSnapshot(gpus=gpus), expected_gpus=8)
    assert report.gpus_seen == 4 and not report.healthy
    assert [f.summary for f in report.findings if f.rule == "gpu-count"] == ["gpu-count: found 4 of 8 GPUs"]
