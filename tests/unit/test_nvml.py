"""slurmagent.gpu.nvml against a fake pynvml that raises the real pynvml error classes."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pynvml
import pytest

from slurmagent.gpu import nvml as reader
from slurmagent.gpu import nvml_deadline as deadline
from slurmagent.errors import NvmlTimeout, SlurmagentError
from slurmagent.core.snapshot import NodeSnapshot

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
H100_LINKS = 18
EVENT_HW_SLOWDOWN = pynvml.nvmlClocksEventReasonHwSlowdown
EVENT_SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap


@dataclass
class FakeGpu:
    """What one fake GPU answers; ``None`` for a query means it answers NOT_SUPPORTED."""

    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    name: str = "NVIDIA H100 80GB HBM3"
    bus_id: bytes = b"00000000:04:00.0"  # pynvml gives the raw c_char array: bytes
    temperature: int | None = 41
    power_mw: int | None = 120500
    persistence: int | None = 1
    ecc: dict[tuple[int, int], int] | None = field(default_factory=dict)
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    retired_pages: dict[int, list[int]] | None = None  # None: not supported (Ampere+)
    retired_pending: int | None = None
    pcie: tuple[int, int, int, int] = (5, 5, 16, 16)
    nvlink_states: list[int] = field(default_factory=lambda: [1] * H100_LINKS)
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    link_past_end_error: int = pynvml.NVML_ERROR_INVALID_ARGUMENT
    clocks_event: int | None = 0
    throttle: int | None = 0
    recovery_action: int | None = 0
    lost_at: str | None = None  # a function name that answers GPU_IS_LOST
    hang_at: str | None = None  # a function name that sleeps 60 s


class FakeNvml(SimpleNamespace):
    """Exposes the names the reader uses; records every call as (function, gpu index)."""

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None, driver: str = "550.90.07") -> None:
        consts = {k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith(("NVML_", "nvmlClocks"))}
        super().__init__(**consts, NVMLError=pynvml.NVMLError)
        self.gpus = gpus
        self.init_error = init_error
        self.driver = driver
        self.calls: list[tuple[str, int | None]] = []
        self.shutdowns = 0
        self.hidden: set[str] = set()  # names an older binding lacks

    def __getattribute__(self, name: str) -> Any:
        if name != "hidden" and name in object.__getattribute__(self, "hidden"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def _gpu(self, func: str, handle: int) -> FakeGpu:
        self.calls.append((func, handle))
        gpu = self.gpus[handle]
        if gpu.lost_at == func:
            raise pynvml.NVMLError_GpuIsLost()
        if gpu.hang_at == func:
            time.sleep(60)
        return gpu

    @staticmethod
    def _answer(value: T | None) -> T:
        if value is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return value

    def nvmlInit(self) -> None:
        self.calls.append(("nvmlInit", None))
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._gpu("nvmlDeviceGetHandleByIndex", index)
        return index

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._gpu("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._gpu("nvmlDeviceGetName", h).name

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self._gpu("nvmlDeviceGetPciInfo", h).bus_id)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._answer(self._gpu("nvmlDeviceGetTemperature", h).temperature)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._answer(self._gpu("nvmlDeviceGetPowerUsage", h).power_mw)

    def nvmlDeviceGetPersistenceMode(self, h: int) -> int:
        return self._answer(self._gpu("nvmlDeviceGetPersistenceMode", h).persistence)

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter_type: int) -> int:
        ecc = self._answer(self._gpu("nvmlDeviceGetTotalEccErrors", h).ecc)
        return ecc.get((error_type, counter_type), 0)

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self._answer(self._gpu("nvmlDeviceGetRemappedRows", h).remapped_rows)

    def nvmlDeviceGetRetiredPages(self, h: int, cause: int) -> list[int]:
        return self._answer(self._gpu("nvmlDeviceGetRetiredPages", h).retired_pages)[cause]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        return self._answer(self._gpu("nvmlDeviceGetRetiredPagesPendingStatus", h).retired_pending)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return self._gpu("nvmlDeviceGetCurrPcieLinkGeneration", h).pcie[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return self._gpu("nvmlDeviceGetMaxPcieLinkGeneration", h).pcie[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return self._gpu("nvmlDeviceGetCurrPcieLinkWidth", h).pcie[2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return self._gpu("nvmlDeviceGetMaxPcieLinkWidth", h).pcie[3]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        gpu = self._gpu("nvmlDeviceGetNvLinkState", h)
        if link >= len(gpu.nvlink_states):
            raise pynvml.NVMLError(gpu.link_past_end_error)
        return gpu.nvlink_states[link]

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        gpu = self._gpu("nvmlDeviceGetNvLinkErrorCounter", h)
        if not gpu.nvlink_states[link]:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return gpu.nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        gpu = self._gpu("nvmlDeviceGetCurrentClocksEventReasons", h)
        if gpu.clocks_event is None:  # driver older than the rename
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return gpu.clocks_event

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:
        return self._answer(self._gpu("nvmlDeviceGetCurrentClocksThrottleReasons", h).throttle)

    def nvmlDeviceGetFieldValues(self, h: int, field_ids: list[int]) -> list[Any]:
        gpu = self._gpu("nvmlDeviceGetFieldValues", h)
        assert field_ids == [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        if gpu.recovery_action is None:  # per-field answer, as NVML gives it
            ret, value = NOT_SUPPORTED, 0
        else:
            ret, value = pynvml.NVML_SUCCESS, gpu.recovery_action
        return [
            SimpleNamespace(
                fieldId=field_ids[0],
                nvmlReturn=ret,
                valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                value=SimpleNamespace(uiVal=value),
            )
        ]


def h100_node(n: int = 8) -> list[FakeGpu]:
    return [
        FakeGpu(uuid=f"GPU-{i:08d}-aaaa-bbbb-cccc-000000000000", bus_id=f"00000000:{0x04 + i:02X}:00.0".encode())
        for i in range(n)
    ]


def v100_like() -> FakeGpu:
    """An older part on an older driver: no row remapping, no recovery field, no clocks-event call."""
    return FakeGpu(
        name="Tesla V100-SXM2-16GB",
        remapped_rows=None,
        retired_pages={0: [0x1000, 0x2000], 1: [0x3000]},
        retired_pending=0,
        pcie=(3, 3, 16, 16),
        nvlink_states=[1] * 6,
        link_past_end_error=NOT_SUPPORTED,
        clocks_event=None,
        throttle=pynvml.nvmlClocksThrottleReasonGpuIdle,
        recovery_action=None,
        power_mw=None,
    )


# --- in-process read ------------------------------------------------------------------------


def test_healthy_h100_node_fills_every_field() -> None:
    fake = FakeNvml(h100_node())
    snap = reader.read_snapshot(fake, hostname="n1")

    assert snap.hostname == "n1"
    assert snap.driver_version == "550.90.07"
    assert snap.nvml_error is None
    assert [g.index for g in snap.gpus] == list(range(8))
    g = snap.gpus[3]
    assert g.uuid == "GPU-00000003-aaaa-bbbb-cccc-000000000000"
    assert g.name == "NVIDIA H100 80GB HBM3"
    assert g.pci_bus_id == "00000000:07:00.0"
    assert g.lost is False
    assert g.temperature_c == 41
    assert g.power_w == pytest.approx(120.5)
    assert g.persistence_mode is True
    assert (g.ecc.volatile_uncorrected, g.ecc.aggregate_uncorrected, g.ecc.volatile_corrected) == (0, 0, 0)
    assert vars(g.remapped_rows) == {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}
    assert vars(g.retired_pages) == {"sbe": None, "dbe": None, "pending": None}  # H100 remaps rows instead
    assert vars(g.pcie) == {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16}
    assert [link.link for link in g.nvlink] == list(range(H100_LINKS))
    assert all(link.active and link.replay_errors == link.recovery_errors == link.crc_errors == 0 for link in g.nvlink)
    assert g.clocks_event_reasons == []
    assert g.recovery_action == 0
    assert fake.shutdowns == 1
    assert ("nvmlDeviceGetCurrentClocksThrottleReasons", 0) not in fake.calls


def test_ecc_counters_map_to_the_right_kinds() -> None:
    gpu = FakeGpu(
        ecc={
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): 2,
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC): 7,
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC): 130,
        },
        remapped_rows=(3, 1, 1, 0),
        recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET,
        persistence=0,
    )
    g = reader.read_snapshot(FakeNvml([gpu]), hostname="n1").gpus[0]
    assert (g.ecc.volatile_uncorrected, g.ecc.aggregate_uncorrected, g.ecc.volatile_corrected) == (2, 7, 130)
    assert vars(g.remapped_rows) == {"correctable": 3, "uncorrectable": 1, "pending": True, "failure": False}
    assert g.recovery_action == 4
    assert g.persistence_mode is False


def test_older_part_not_supported_leaves_fields_unmeasured() -> None:
    fake = FakeNvml([v100_like()])
    g = reader.read_snapshot(fake, hostname="n1").gpus[0]
    assert vars(g.remapped_rows) == {"correctable": None, "uncorrectable": None, "pending": None, "failure": None}
    assert vars(g.retired_pages) == {"sbe": 2, "dbe": 1, "pending": False}
    assert g.recovery_action is None
    assert g.power_w is None
    assert g.lost is False
    assert [link.link for link in g.nvlink] == list(range(6))
    assert g.clocks_event_reasons == ["gpu_idle"]  # from the throttle-reasons fallback
    assert ("nvmlDeviceGetCurrentClocksThrottleReasons", 0) in fake.calls


def test_binding_without_clocks_event_or_recovery_names_falls_back() -> None:
    fake = FakeNvml([FakeGpu(throttle=pynvml.nvmlClocksThrottleReasonHwSlowdown)])
    fake.hidden = {"nvmlDeviceGetCurrentClocksEventReasons", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"}
    g = reader.read_snapshot(fake, hostname="n1").gpus[0]
    assert g.clocks_event_reasons == ["hw_slowdown"]
    assert g.recovery_action is None
    assert ("nvmlDeviceGetFieldValues", 0) not in fake.calls
    assert ("nvmlDeviceGetCurrentClocksEventReasons", 0) not in fake.calls


def test_everything_not_supported_gives_an_all_none_gpu() -> None:
    gpu = FakeGpu(
        temperature=None, power_mw=None, persistence=None, ecc=None, remapped_rows=None,
        nvlink_states=[], link_past_end_error=NOT_SUPPORTED, clocks_event=None, throttle=None,
        recovery_action=None,
    )  # fmt: skip
    snap = reader.read_snapshot(FakeNvml([gpu]), hostname="n1")
    assert snap.to_dict()["gpus"][0] == {
        "index": 0,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "pci_bus_id": "00000000:04:00.0",
        "lost": False,
        "pcie": {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16},
    }


def test_no_permission_is_unmeasured_and_other_errors_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    class Fake(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, h: int) -> int:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

        def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    with caplog.at_level(logging.WARNING, logger="slurmagent.gpu.nvml"):
        g = reader.read_snapshot(Fake([FakeGpu()]), hostname="n1").gpus[0]
    assert g.power_w is None and g.temperature_c is None and not g.lost
    assert "NVML_ERROR_UNKNOWN" in caplog.text and "nvmlDeviceGetTemperature" in caplog.text
    assert "nvmlDeviceGetPowerUsage" not in caplog.text


def test_gpu_lost_at_handle_is_recorded_and_others_still_read() -> None:
    gpus = h100_node()
    gpus[5].lost_at = "nvmlDeviceGetHandleByIndex"
    fake = FakeNvml(gpus)
    snap = reader.read_snapshot(fake, hostname="n1")
    assert [g.lost for g in snap.gpus] == [False] * 5 + [True] + [False] * 2
    assert snap.gpus[5].uuid is None
    assert snap.gpus[6].uuid is not None and snap.gpus[6].temperature_c == 41
    assert [c for c in fake.calls if c[1] == 5] == [("nvmlDeviceGetHandleByIndex", 5)]
    assert snap.to_dict()["gpus"][5] == {"index": 5, "lost": True}
    assert fake.shutdowns == 1


def test_gpu_lost_mid_read_stops_reading_that_gpu() -> None:
    gpus = h100_node(2)
    gpus[0].lost_at = "nvmlDeviceGetTemperature"
    fake = FakeNvml(gpus)
    g = reader.read_snapshot(fake, hostname="n1").gpus[0]
    assert g.lost is True
    assert g.uuid == gpus[0].uuid  # read before the loss is kept
    assert g.temperature_c is None and g.nvlink == [] and g.recovery_action is None
    assert [c[0] for c in fake.calls if c[1] == 0][-1] == "nvmlDeviceGetTemperature"


def test_gpu_lost_in_field_values_answer() -> None:
    class Fake(FakeNvml):
        def nvmlDeviceGetFieldValues(self, h: int, field_ids: list[int]) -> list[Any]:
            values = super().nvmlDeviceGetFieldValues(h, field_ids)
            values[0].nvmlReturn = pynvml.NVML_ERROR_GPU_IS_LOST
            return values

    assert reader.read_snapshot(Fake([FakeGpu()]), hostname="n1").gpus[0].lost is True


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML_ERROR_LIBRARY_NOT_FOUND"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "NVML_ERROR_DRIVER_NOT_LOADED"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "NVML_ERROR_NO_PERMISSION"),
        (pynvml.NVML_ERROR_UNKNOWN, "NVML_ERROR_UNKNOWN"),
    ],
)
def test_init_failure_is_named_and_gives_no_gpus(code: int, name: str) -> None:
    fake = FakeNvml(h100_node(), init_error=code)
    snap = reader.read_snapshot(fake, hostname="n1")
    assert snap.nvml_error == name
    assert snap.gpus == [] and snap.driver_version is None
    assert fake.shutdowns == 0  # NVML never started
    assert snap.to_dict()["nvml_error"] == name


def test_error_name_uses_the_binding_then_documented_codes() -> None:
    assert reader.error_name(pynvml.NVMLError_DriverNotLoaded(), pynvml) == "NVML_ERROR_DRIVER_NOT_LOADED"
    assert reader.error_name(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)) == "NVML_ERROR_GPU_IS_LOST"
    assert reader.error_name(pynvml.NVMLError(4242), pynvml) == "NVML_ERROR_4242"


def test_device_count_failure_is_an_nvml_error() -> None:
    class Fake(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    fake = Fake(h100_node())
    snap = reader.read_snapshot(fake, hostname="n1")
    assert snap.nvml_error == "NVML_ERROR_UNKNOWN" and snap.gpus == []
    assert fake.shutdowns == 1


def test_shutdown_runs_when_the_read_raises() -> None:
    class Fake(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise ZeroDivisionError("bug")

    fake = Fake(h100_node())
    with pytest.raises(ZeroDivisionError):
        reader.read_snapshot(fake, hostname="n1")
    assert fake.shutdowns == 1


def test_real_pynvml_without_a_driver_reports_library_not_found() -> None:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        for snap in reader.read_snapshot(hostname="n1"), deadline.read_snapshot_with_deadline(10, hostname="n1"):
            assert snap.nvml_error == "NVML_ERROR_LIBRARY_NOT_FOUND" and snap.gpus == []
    else:  # a GPU node: the real read must at least produce a loadable snapshot
        snap = reader.read_snapshot(hostname="n1")
        assert NodeSnapshot.from_dict(json.loads(snap.to_json())) == snap


# --- decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mask", "names"),
    [
        (0, []),
        (0x1, ["gpu_idle"]),
        (0x4 | 0x8, ["sw_power_cap", "hw_slowdown"]),
        (0x40 | 0x80, ["hw_thermal_slowdown", "hw_power_brake_slowdown"]),
        (
            0x2 | 0x10 | 0x20 | 0x100,
            ["applications_clocks_setting", "sync_boost", "sw_thermal_slowdown", "display_clock_setting"],
        ),
        (0x1FF, [n for n, _, _ in reader.CLOCK_REASONS]),
        (0x8 | 0x400, ["hw_slowdown", "unknown_0x400"]),
    ],
)
def test_clocks_reason_bitmask(mask: int, names: list[str]) -> None:
    assert reader.decode_clocks_event_reasons(mask, pynvml) == names
    assert reader.decode_clocks_event_reasons(mask) == names  # documented bits, no binding


def test_clocks_reasons_in_the_snapshot() -> None:
    fake = FakeNvml([FakeGpu(clocks_event=EVENT_HW_SLOWDOWN | EVENT_SW_POWER_CAP)])
    assert reader.read_snapshot(fake, hostname="n1").gpus[0].clocks_event_reasons == ["sw_power_cap", "hw_slowdown"]


def test_nvlink_inactive_link_and_counters() -> None:
    states = [1] * H100_LINKS
    states[7] = 0
    errors = {
        (2, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 5,
        (2, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY): 1,
        (3, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 99,
    }
    fake = FakeNvml([FakeGpu(nvlink_states=states, nvlink_errors=errors)])
    links = reader.read_snapshot(fake, hostname="n1").gpus[0].nvlink
    assert len(links) == H100_LINKS
    assert vars(links[7]) == {
        "link": 7,
        "active": False,
        "replay_errors": None,
        "recovery_errors": None,
        "crc_errors": None,
    }
    assert vars(links[2]) == {"link": 2, "active": True, "replay_errors": 5, "recovery_errors": 1, "crc_errors": 0}
    assert links[3].crc_errors == 99
    state_calls = [c for c in fake.calls if c[0] == "nvmlDeviceGetNvLinkState"]
    assert len(state_calls) == pynvml.NVML_NVLINK_MAX_LINKS  # indices past the last link are skipped


def test_no_nvlink_at_all_gives_an_empty_list() -> None:
    fake = FakeNvml([FakeGpu(nvlink_states=[], link_past_end_error=NOT_SUPPORTED)])
    assert reader.read_snapshot(fake, hostname="n1").gpus[0].nvlink == []


# --- read with a deadline -------------------------------------------------------------------


@pytest.fixture
def forked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the pids that the reader forks."""
    pids: list[int] = []
    real_fork = os.fork

    def fork() -> int:
        pid = real_fork()
        if pid:
            pids.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", fork)
    return pids


def assert_gone(pid: int) -> None:
    with pytest.raises(ChildProcessError):  # already reaped by the reader
        os.waitpid(pid, os.WNOHANG)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_deadline_read_matches_the_in_process_read(forked: list[int]) -> None:
    gpus = h100_node()
    gpus[1].ecc = {(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): 3}
    gpus[2].nvlink_states[4] = 0
    gpus[3].lost_at = "nvmlDeviceGetPcieReplayCounter"  # never called: stays healthy
    gpus[4].lost_at = "nvmlDeviceGetName"
    gpus[5].clocks_event = EVENT_HW_SLOWDOWN
    direct = reader.read_snapshot(FakeNvml(gpus), hostname="n1")
    via_child = deadline.read_snapshot_with_deadline(10, nvml=FakeNvml(gpus), hostname="n1")
    assert via_child == direct
    assert via_child.to_json() == direct.to_json()
    assert len(forked) == 1
    assert_gone(forked[0])


def test_deadline_read_of_an_init_failure(forked: list[int]) -> None:
    fake = FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    snap = deadline.read_snapshot_with_deadline(10, nvml=fake, hostname="n1")
    assert snap.nvml_error == "NVML_ERROR_DRIVER_NOT_LOADED" and snap.gpus == []
    assert_gone(forked[0])


def test_hung_call_times_out_and_the_child_is_killed(forked: list[int]) -> None:
    gpus = h100_node()
    gpus[6].hang_at = "nvmlDeviceGetTemperature"
    start = time.monotonic()
    with pytest.raises(NvmlTimeout) as info:
        deadline.read_snapshot_with_deadline(1, nvml=FakeNvml(gpus), hostname="n1")
    elapsed = time.monotonic() - start
    assert 0.9 < elapsed < 1 + 10 < 60 / 2  # the deadline, give or take a loaded machine; not the hung call's 60 s
    assert str(info.value) == "NVML read did not finish within 1.0 s (hung driver?)"
    assert "\n" not in str(info.value)
    assert isinstance(info.value, SlurmagentError) and info.value.exit_code == 1
    assert len(forked) == 1
    assert_gone(forked[0])


def test_child_that_dies_gives_read_crashed(forked: list[int]) -> None:
    class Fake(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            os.kill(os.getpid(), signal.SIGKILL)  # as a segfault in libnvidia-ml would
            return 0

    snap = deadline.read_snapshot_with_deadline(10, nvml=Fake([]), hostname="n1")
    assert snap.nvml_error == deadline.NVML_READ_CRASHED == "NVML_READ_CRASHED"
    assert snap.hostname == "n1" and snap.gpus == []
    assert_gone(forked[0])


def test_exception_in_child_is_raised_in_parent_not_hidden(forked: list[int]) -> None:
    class Fake(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise ZeroDivisionError("a bug")

    with pytest.raises(RuntimeError, match="ZeroDivisionError: a bug"):
        deadline.read_snapshot_with_deadline(10, nvml=Fake([]), hostname="n1")
    assert_gone(forked[0])


def test_deadline_rejects_a_non_positive_timeout() -> None:
    with pytest.raises(ValueError):
        deadline.read_snapshot_with_deadline(0, nvml=FakeNvml([]))


def test_large_snapshot_passes_the_pipe(forked: list[int]) -> None:
    """More than a pipe buffer (64 KiB) of JSON must not deadlock the child."""
    gpus = [FakeGpu(nvlink_states=[1] * pynvml.NVML_NVLINK_MAX_LINKS) for _ in range(64)]
    snap = deadline.read_snapshot_with_deadline(20, nvml=FakeNvml(gpus), hostname="n1")
    assert len(json.dumps(snap.to_dict())) > 1 << 16
    assert len(snap.gpus) == 64 and all(len(g.nvlink) == pynvml.NVML_NVLINK_MAX_LINKS for g in snap.gpus)


# --- import hygiene -------------------------------------------------------------------------


def test_importing_the_module_does_not_import_pynvml() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import slurmagent.gpu.nvml, slurmagent.gpu.nvml_deadline, sys; print('pynvml' in sys.modules)"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "False"
