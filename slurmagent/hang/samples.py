"""Stack samples of a job's ranks through one silence: does any rank still move?

Past half the short limit of a silence (policy/stall.py), the hang watch reads every rank's
Python stack a few times (`py-spy dump --nonblocking`: the rank is never stopped to be read,
so sampling never makes the evidence it reads); the other nodes' ranks through their agents
(`node-agent samples`). `policy/stall.stacks_verdict` compares each rank's main thread
across the samples: one that changed is running; every rank unchanged for the stretch is
stuck (a collective, a barrier, a sleep). Samples are taken in a thread: the wrapper's main
loop (signals, the child) never waits on py-spy or an agent round.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Callable

from ..policy.stall import stacks_verdict

_THREAD = re.compile(r'^Thread (?:0x)?[0-9a-fA-F]+ \([^)]*\): "(?P<name>[^"]*)"')
_FRAME = re.compile(r"^ {4}(?P<frame>\S.*\(.*:\d+\))$")


def main_frames(dump: str) -> str | None:
    """The main thread's frames ("func (file:line)" lines, innermost first) in a `py-spy dump`
    text; the first thread's where none is named MainThread; None when the text holds no stack
    (py-spy missing, denied, the process gone)."""
    threads: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        head = _THREAD.match(line)
        if head:
            threads.append((head["name"], []))
        elif threads and (frame := _FRAME.match(line)):
            threads[-1][1].append(frame["frame"])
    if not threads:
        return None
    frames = next((f for name, f in threads if name == "MainThread"), threads[0][1])
    return "\n".join(frames)


class StackSamples:
    """The samples of the current silence. `take()` reads every rank's stack now: {rank: main
    frames or None}. `every_s` apart, at most one sample in flight."""

    def __init__(self, take: Callable[[], dict[int, str | None]], clock: Callable[[], float] = time.monotonic):
        self.take, self.clock = take, clock
        self.samples: list[dict[int, str | None]] = []
        self._lock = threading.Lock()
        self._running = False
        self._generation = 0
        self._next = 0.0

    def reset(self) -> None:
        """Progress: a new silence starts; a sample in flight from the old one is dropped."""
        with self._lock:
            self.samples, self._generation, self._next = [], self._generation + 1, 0.0

    def maybe(self, every_s: float) -> None:
        """Start a sample in a thread when one is due and none is in flight."""
        now = self.clock()
        with self._lock:
            if self._running or now < self._next:
                return
            self._running, self._next, generation = True, now + every_s, self._generation
        threading.Thread(target=self._one, args=(generation,), name="hang-stack-sample", daemon=True).start()

    def _one(self, generation: int) -> None:
        try:
            got = self.take()
        except Exception:  # noqa: BLE001 - a failed sample is a sample with no stacks, never the wrapper's end
            got = {}
        with self._lock:
            self._running = False
            if generation == self._generation:
                self.samples.append(dict(got))

    def verdict(self, ranks: set[int], needed: int) -> tuple[str, str]:
        with self._lock:
            samples = list(self.samples)
        return stacks_verdict(samples, ranks, needed)
