"""Read this node's GPU state through NVML into a :class:`NodeSnapshot`.

This is the only module that touches ``pynvml``, and it imports it lazily so that paths
which never read NVML (replayed snapshots, the CLI's help) pay nothing for it.

Error mapping (why: a health check must tell "not measured" from "broken"):

- ``NVML_ERROR_NOT_SUPPORTED`` / ``NO_PERMISSION`` / ``FUNCTION_NOT_FOUND`` on a query, or a
  binding too old to have the function: the field stays ``None`` ("not measured").
- ``NVML_ERROR_GPU_IS_LOST`` on any per-GPU call: ``lost=True`` and that GPU is not read further.
- Any other NVML error on a per-GPU query: the field stays ``None`` and a warning is logged.
- ``nvmlInit`` / ``nvmlDeviceGetCount`` failing: ``nvml_error`` holds the ``NVML_ERROR_*`` name.

:func:`read_snapshot_with_deadline` runs the read in a forked child so that a hung driver
call can be abandoned (SIGKILL) instead of hanging a Slurm hook.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import time
from typing import Any

from .errors import NvmlTimeout, SlurmagentError
from .snapshot import Ecc, GpuState, NodeSnapshot, NvLink, Pcie, RemappedRows, RetiredPages

log = logging.getLogger(__name__)

#: ``nvml_error`` when the forked reader died (signal, or exit without an answer).
NVML_READ_CRASHED = "NVML_READ_CRASHED"

# Documented NVML return codes, used when a (fake or old) binding lacks the constant.
_DOCUMENTED_CODES = {
    "NVML_SUCCESS": 0,
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_RESET_REQUIRED": 16,
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": 18,
    "NVML_ERROR_UNKNOWN": 999,
}
_UNMEASURED = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND")
# A link index past the part's last link answers one of these (varies by driver).
_NO_SUCH_LINK = (*_UNMEASURED, "NVML_ERROR_INVALID_ARGUMENT")

# (snapshot name, suffix of nvmlClocksEventReason*/nvmlClocksThrottleReason*, documented bit)
_CLOCK_REASONS = (
    ("gpu_idle", "GpuIdle", 0x1),
    ("applications_clocks_setting", "ApplicationsClocksSetting", 0x2),
    ("sw_power_cap", "SwPowerCap", 0x4),
    ("hw_slowdown", "HwSlowdown", 0x8),
    ("sync_boost", "SyncBoost", 0x10),
    ("sw_thermal_slowdown", "SwThermalSlowdown", 0x20),
    ("hw_thermal_slowdown", "HwThermalSlowdown", 0x40),
    ("hw_power_brake_slowdown", "HwPowerBrakeSlowdown", 0x80),
    ("display_clock_setting", "DisplayClockSetting", 0x100),
)

# nvmlValueType_t -> member of the c_nvmlValue_t union.
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

_KILL_REAP_S = 2.0  # after SIGKILL; a child stuck in the driver (D state) may never die


# --- in-process read ------------------------------------------------------------------------


def read_snapshot(nvml: Any = None, hostname: str | None = None) -> NodeSnapshot:
    """Read every GPU of this node; NVML failing to start is data (``nvml_error``), not an exception."""
    nv = _load(nvml)
    snap = NodeSnapshot(hostname=hostname or socket.gethostname())
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        snap.nvml_error = error_name(exc, nv)
        return snap
    try:
        snap.driver_version = _text(_query(nv, "nvmlSystemGetDriverVersion"))
        try:
            count = int(nv.nvmlDeviceGetCount())
        except nv.NVMLError as exc:
            snap.nvml_error = error_name(exc, nv)
            return snap
        snap.gpus = [_read_gpu(nv, index) for index in range(count)]
        return snap
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)


def error_name(exc: BaseException, nvml: Any = None) -> str:
    """The ``NVML_ERROR_*`` constant name for an NVMLError, looked up in the binding itself."""
    value = getattr(exc, "value", None)
    for name in dir(nvml) if nvml is not None else ():
        if name.startswith("NVML_ERROR_") and getattr(nvml, name) == value:
            return name
    for name, code in _DOCUMENTED_CODES.items():
        if name.startswith("NVML_ERROR_") and code == value:
            return name
    return f"NVML_ERROR_{value}"


def decode_clocks_event_reasons(mask: int, nvml: Any = None) -> list[str]:
    """Bitmask -> lower-case reason names; unknown bits appear as ``unknown_0x...`` so none is lost."""
    names: list[str] = []
    known = 0
    for name, suffix, documented in _CLOCK_REASONS:
        older = getattr(nvml, "nvmlClocksThrottleReason" + suffix, documented)
        bit = int(getattr(nvml, "nvmlClocksEventReason" + suffix, older))
        known |= bit
        if mask & bit:
            names.append(name)
    rest = mask & ~known
    while rest:
        lowest = rest & -rest
        names.append(f"unknown_{lowest:#x}")
        rest ^= lowest
    return names


def _load(nvml: Any) -> Any:
    if nvml is not None:
        return nvml
    try:
        import pynvml  # the only import of pynvml in slurmagent
    except ImportError as exc:
        raise SlurmagentError(f"cannot import pynvml ({exc}); install the nvidia-ml-py package") from None
    return pynvml


def _const(nv: Any, name: str) -> int:
    return int(getattr(nv, name, _DOCUMENTED_CODES[name]))


def _query(nv: Any, func: str, *args: Any, unmeasured: tuple[str, ...] = _UNMEASURED) -> Any:
    """Call ``nv.<func>(*args)``; None when not measurable. Only GPU_IS_LOST propagates."""
    fn = getattr(nv, func, None)
    if fn is None:  # binding older than the query
        return None
    try:
        return fn(*args)
    except nv.NVMLError as exc:
        value = getattr(exc, "value", None)
        if value == _const(nv, "NVML_ERROR_GPU_IS_LOST"):
            raise
        if value not in {_const(nv, name) for name in unmeasured}:
            log.warning("NVML %s failed: %s (%s); field left unmeasured", func, error_name(exc, nv), exc)
        return None


def _read_gpu(nv: Any, index: int) -> GpuState:
    gpu = GpuState(index=index)
    try:
        handle = _query(nv, "nvmlDeviceGetHandleByIndex", index)
        if handle is not None:
            _fill_gpu(nv, handle, gpu)
    except nv.NVMLError:  # _query lets only GPU_IS_LOST through
        gpu.lost = True
    return gpu


def _fill_gpu(nv: Any, h: Any, gpu: GpuState) -> None:
    """Fill ``gpu`` field by field, so a GPU lost half-way keeps what was read before."""
    gpu.uuid = _text(_query(nv, "nvmlDeviceGetUUID", h))
    gpu.name = _text(_query(nv, "nvmlDeviceGetName", h))
    pci = _query(nv, "nvmlDeviceGetPciInfo", h)
    gpu.pci_bus_id = _text(getattr(pci, "busId", None)) or None
    gpu.temperature_c = _query(nv, "nvmlDeviceGetTemperature", h, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
    power_mw = _query(nv, "nvmlDeviceGetPowerUsage", h)
    gpu.power_w = None if power_mw is None else power_mw / 1000.0
    mode = _query(nv, "nvmlDeviceGetPersistenceMode", h)
    gpu.persistence_mode = None if mode is None else mode == getattr(nv, "NVML_FEATURE_ENABLED", 1)
    gpu.ecc = _read_ecc(nv, h)
    gpu.remapped_rows = _read_remapped_rows(nv, h)
    gpu.retired_pages = _read_retired_pages(nv, h)
    gpu.pcie = Pcie(
        gen=_query(nv, "nvmlDeviceGetCurrPcieLinkGeneration", h),
        max_gen=_query(nv, "nvmlDeviceGetMaxPcieLinkGeneration", h),
        width=_query(nv, "nvmlDeviceGetCurrPcieLinkWidth", h),
        max_width=_query(nv, "nvmlDeviceGetMaxPcieLinkWidth", h),
    )
    gpu.nvlink = _read_nvlinks(nv, h)
    mask = _query(nv, "nvmlDeviceGetCurrentClocksEventReasons", h)
    if mask is None:  # drivers/bindings before the "event" rename
        mask = _query(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", h)
    gpu.clocks_event_reasons = None if mask is None else decode_clocks_event_reasons(int(mask), nv)
    gpu.recovery_action = _read_recovery_action(nv, h)


def _read_ecc(nv: Any, h: Any) -> Ecc:
    unc = getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    cor = getattr(nv, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
    vol = getattr(nv, "NVML_VOLATILE_ECC", 0)
    agg = getattr(nv, "NVML_AGGREGATE_ECC", 1)
    return Ecc(
        volatile_uncorrected=_query(nv, "nvmlDeviceGetTotalEccErrors", h, unc, vol),
        aggregate_uncorrected=_query(nv, "nvmlDeviceGetTotalEccErrors", h, unc, agg),
        volatile_corrected=_query(nv, "nvmlDeviceGetTotalEccErrors", h, cor, vol),
    )


def _read_remapped_rows(nv: Any, h: Any) -> RemappedRows:
    rows = _query(nv, "nvmlDeviceGetRemappedRows", h)
    if rows is None:  # pre-Ampere parts retire pages instead
        return RemappedRows()
    correctable, uncorrectable, pending, failure = rows
    return RemappedRows(int(correctable), int(uncorrectable), bool(pending), bool(failure))


def _read_retired_pages(nv: Any, h: Any) -> RetiredPages:
    sbe_cause = getattr(nv, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0)
    dbe_cause = getattr(nv, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1)
    sbe = _query(nv, "nvmlDeviceGetRetiredPages", h, sbe_cause)
    dbe = _query(nv, "nvmlDeviceGetRetiredPages", h, dbe_cause)
    pending = _query(nv, "nvmlDeviceGetRetiredPagesPendingStatus", h)
    return RetiredPages(
        sbe=None if sbe is None else len(sbe),
        dbe=None if dbe is None else len(dbe),
        pending=None if pending is None else bool(pending),
    )


def _read_nvlinks(nv: Any, h: Any) -> list[NvLink]:
    """Every link the part has; indices past its last link (or without NVLink) are skipped."""
    counters = (
        ("replay_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_REPLAY", 0)),
        ("recovery_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_RECOVERY", 1)),
        ("crc_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2)),
    )
    links: list[NvLink] = []
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        state = _query(nv, "nvmlDeviceGetNvLinkState", h, link, unmeasured=_NO_SUCH_LINK)
        if state is None:
            continue
        entry = NvLink(link=link, active=state == getattr(nv, "NVML_FEATURE_ENABLED", 1))
        for attr, counter in counters:
            value = _query(nv, "nvmlDeviceGetNvLinkErrorCounter", h, link, counter, unmeasured=_NO_SUCH_LINK)
            setattr(entry, attr, None if value is None else int(value))
        links.append(entry)
    return links


def _read_recovery_action(nv: Any, h: Any) -> int | None:
    """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (drivers 565+); None where the binding or GPU lacks it."""
    field_id = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field_id is None:
        return None
    values = _query(nv, "nvmlDeviceGetFieldValues", h, [field_id])
    if not values:
        return None
    fv = values[0]
    ret = int(getattr(fv, "nvmlReturn", 0))
    if ret == _const(nv, "NVML_ERROR_GPU_IS_LOST"):
        raise nv.NVMLError(ret)
    if ret != _const(nv, "NVML_SUCCESS"):
        return None
    member = _VALUE_MEMBER.get(int(getattr(fv, "valueType", 1)), "uiVal")
    return int(getattr(fv.value, member))


def _text(value: Any) -> str | None:
    """Older bindings return bytes for strings; the snapshot wants str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return None if value is None else str(value)


# --- read with a deadline -------------------------------------------------------------------


def read_snapshot_with_deadline(timeout_s: float, nvml: Any = None, hostname: str | None = None) -> NodeSnapshot:
    """:func:`read_snapshot` in a forked child that is SIGKILLed at the deadline.

    Why a fork: a hung NVML call sits in the driver and cannot be interrupted in-process;
    a forked child costs no interpreter start and can be abandoned. Raises NvmlTimeout at the
    deadline; a child that dies without answering gives ``nvml_error="NVML_READ_CRASHED"``.
    An exception raised by the read is raised again here (SlurmagentError as such, others as
    RuntimeError) so a slurmagent bug is never mistaken for an unhealthy GPU.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, not {timeout_s!r}")
    nv = _load(nvml)  # import errors surface here, not in the child
    hostname = hostname or socket.gethostname()
    deadline = time.monotonic() + timeout_s
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:  # child: never returns
        os.close(read_fd)
        _child(write_fd, nv, hostname)
    os.close(write_fd)
    reaped = False
    try:
        data = _read_until_eof(read_fd, deadline)
        if data is None:
            raise NvmlTimeout(f"NVML read did not finish within {float(timeout_s)} s (hung driver?)")
        reaped = _reap(pid, deadline)
    finally:
        os.close(read_fd)
        if not reaped:
            _kill(pid)
    return _decode(data, hostname)


def _child(write_fd: int, nv: Any, hostname: str) -> None:
    """Read, send one JSON answer down the pipe, and leave with os._exit (no atexit, no flush)."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            answer: dict[str, Any] = {"snapshot": read_snapshot(nv, hostname).to_dict()}
        except BaseException as exc:  # carried to the parent, raised there
            answer = {"error": type(exc).__name__, "domain": isinstance(exc, SlurmagentError), "message": str(exc)}
        data = json.dumps(answer).encode()
        while data:
            data = data[os.write(write_fd, data) :]
    except BaseException:  # even a failed write must end in os._exit
        code = 70
    finally:
        os._exit(code)


def _read_until_eof(fd: int, deadline: float) -> bytes | None:
    """All the child wrote, or None when the deadline passed first."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        if not poller.poll(max(1, int(remaining * 1000 + 0.999))):
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _reap(pid: int, deadline: float) -> bool:
    """Wait for the child to exit until the deadline; True once reaped."""
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if not _reap(pid, time.monotonic() + _KILL_REAP_S):
        log.warning("NVML reader pid %d did not die after SIGKILL (stuck in the driver?)", pid)


def _decode(data: bytes, hostname: str) -> NodeSnapshot:
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):  # died before answering (signal, os._exit, OOM)
        return NodeSnapshot(hostname=hostname, nvml_error=NVML_READ_CRASHED)
    if "snapshot" in answer:
        return NodeSnapshot.from_dict(answer["snapshot"], source="NVML reader")
    message = str(answer.get("message", ""))
    if answer.get("domain"):
        raise SlurmagentError(message)
    raise RuntimeError(f"NVML reader raised {answer.get('error')}: {message}")
