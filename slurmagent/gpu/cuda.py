"""Does CUDA start? `cuInit(0)` + `cuDeviceGetCount` through the driver library (libcuda, via
ctypes: no CUDA toolkit), in a forked child that is SIGKILLed at the deadline (the NVML read's
`answer_in_child`), so a driver that hangs in cuInit never hangs the caller, and the caller's own
process never holds a CUDA context.

The library comes from an injectable loader (tests pass a fake library object). Why: a GPU
can answer NVML while CUDA fails (NVSwitch fabric not initialised: `CUDA_ERROR_SYSTEM_NOT_READY`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import time
from typing import Any, Callable

from ..core.gpu_occupancy import LIBCUDA_MISSING, UVM_UNREACHABLE
from ..core.snapshot import CudaProbe
from .nvml_deadline import answer_in_child

LIBCUDA = "libcuda.so.1"
HIDING = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY")  # unset for the probe
UVM_DEVICE = "/dev/nvidia-uvm"  # cuInit needs it; the nvidia-uvm module is loaded on the first CUDA use
# CUresult names for when cuGetErrorName itself is missing (cuda.h)
_NAMES = {1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY", 3: "CUDA_ERROR_NOT_INITIALIZED",
          4: "CUDA_ERROR_DEINITIALIZED", 100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE",
          802: "CUDA_ERROR_SYSTEM_NOT_READY", 803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", 999: "CUDA_ERROR_UNKNOWN"}


def load_libcuda() -> Any:
    return ctypes.CDLL(LIBCUDA)


def error_name(lib: Any, code: int) -> str:
    name = ctypes.c_char_p()
    with contextlib.suppress(Exception):
        if lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode("ascii", "replace")
    return _NAMES.get(code, f"CUDA_ERROR_{code}")


def probe(loader: Callable[[], Any] = load_libcuda, uvm: str = UVM_DEVICE) -> CudaProbe:
    """In this process: cuInit and the device count (use `probe_with_deadline` from a hook). A
    failed cuInit says whether `uvm` could be opened: where it cannot (a sandbox whose device
    list was made before nvidia-uvm was loaded), the failure is the sandbox's, not the GPUs'."""
    try:
        lib = loader()
    except OSError as exc:
        return CudaProbe(error=f"{LIBCUDA_MISSING}: {exc}")
    code = int(lib.cuInit(0))
    if code:
        try:
            os.close(os.open(uvm, os.O_RDWR | os.O_CLOEXEC))
        except OSError as exc:
            return CudaProbe(error=f"{error_name(lib, code)}; {UVM_UNREACHABLE} ({uvm}: {exc.strerror})")
        return CudaProbe(error=error_name(lib, code))
    count = ctypes.c_int(0)
    code = int(lib.cuDeviceGetCount(ctypes.byref(count)))
    if code:
        return CudaProbe(error=error_name(lib, code))
    return CudaProbe(devices=int(count.value))


def probe_with_deadline(timeout_s: float, loader: Callable[[], Any] = load_libcuda, uvm: str = UVM_DEVICE) -> CudaProbe:
    """`probe` in a forked child (nvml_deadline.answer_in_child); past the deadline it is killed and
    the answer is `timeout`. For single-threaded callers (hooks, healthcheck, resume-if-healthy)."""
    def answer() -> bytes:
        for name in HIDING:  # a job's or srun's view of the GPUs is not the node's
            os.environ.pop(name, None)
        try:
            found = vars(probe(loader, uvm))
        except BaseException as exc:  # carried to the parent and raised there: a bug, never "CUDA broken"
            found = {"bug": f"{type(exc).__name__}: {exc}"}
        return json.dumps(found).encode()

    data = answer_in_child(answer, time.monotonic() + timeout_s)
    if data is None:
        return CudaProbe(error=f"timeout: cuInit did not answer within {timeout_s:g} s")
    try:
        found = json.loads(data)
    except ValueError:  # died in the driver (a signal) before answering: CUDA cannot start here
        return CudaProbe(error="probe crashed: the child died without answering")
    if "bug" in found:
        raise RuntimeError(f"cuda probe raised {found['bug']}")
    return CudaProbe(devices=found.get("devices"), error=found.get("error"))
