"""The goodput ledger's objects: `<prefix>/ledger/<job>-<attempt>.json` beside the checkpoint,
so a record survives the node that wrote it. Written by the wrapper (`run/ledger.py`), read
by `slurmagent report`; the records' meaning is `core/goodput.py`'s. Every request has a deadline.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ...core.goodput import LEDGER_DIR, record_name
from ..errors import CheckpointError
from .bucket import BucketObjects
from .transfer import Aborted, Deadline, is_not_found, one_line

MAX_RECORD_BYTES = 64 * 1024  # a record is ~1 KiB; anything far larger is not ours
READERS = 16  # records read side by side


class LedgerBucket:
    """The ledger under one remote prefix: the job's own (writing) or a parent of many (reading)."""

    def __init__(self, remote_url: str, *, client: Any = None, timeout_s: float = 10.0) -> None:
        self.objects = BucketObjects(remote_url, client=client, timeout_s=timeout_s, pool_size=READERS)
        self.url = self.objects.url

    def record_url(self, job: str, attempt: int) -> str:
        return f"gs://{self.objects.bucket_name}/{self.objects.key(f'{LEDGER_DIR}/{record_name(job, attempt)}')}"

    def write(self, job: str, attempt: int, record: dict, *, deadline_s: float) -> None:
        """Write (or replace) one attempt's record; StorageUnavailableError/Aborted past the deadline."""
        name = self.objects.key(f"{LEDGER_DIR}/{record_name(job, attempt)}")
        data = json.dumps(record, sort_keys=True).encode()

        def once(timeout: float) -> None:
            self.objects.bucket.blob(name).upload_from_string(data, content_type="application/json",
                                                              timeout=timeout, retry=None)
        self._call(once, Deadline(deadline_s), f"writing {name}")

    def _call(self, fn, dl: Deadline, what: str):
        try:
            return self.objects.call(fn, dl, what)
        except Aborted:
            raise CheckpointError(f"{what} on {self.url}: out of time ({dl.total:g} s)") from None

    def _list(self, prefix: str, dl: Deadline, delimiter: str | None) -> tuple[list[str], list[str]]:
        def once(timeout: float) -> tuple[list[str], list[str]]:
            it = self.objects.client.list_blobs(self.objects.bucket_name, prefix=prefix, delimiter=delimiter,
                                                fields="items(name),prefixes,nextPageToken", timeout=timeout,
                                                retry=None)
            names = [b.name for b in it]
            return names, sorted(getattr(it, "prefixes", ()) or ())
        return self._call(once, dl, f"listing {prefix or 'the bucket'}")

    def read_all(self, *, deadline_s: float = 120.0, progress: Callable[[int, int], None] | None = None
                 ) -> tuple[list[dict], list[str]]:
        """Every record under the prefix: its own `ledger/` and each child prefix's (`<prefix>/<job>/ledger/`,
        the default per-job checkpoint prefix). Returns (records, one line per unreadable object); each
        record gains `prefix`, the checkpoint prefix it sits under. `progress(done, total)` after each read."""
        dl = Deadline(deadline_s)
        root = self.objects.key("")
        _, children = self._list(root, dl, "/")
        dirs = [root + LEDGER_DIR + "/"] + [c + LEDGER_DIR + "/" for c in children if c != root + LEDGER_DIR + "/"]
        errors: list[str] = []

        def names_in(d: str) -> list[str] | None:  # None: out of time
            if dl.remaining() <= 0:
                return None
            try:
                return self._list(d, dl, "/")[0]
            except CheckpointError:
                if dl.remaining() < 1.0:  # the deadline, however the call said it
                    return None
                raise

        todo: list[tuple[str, str]] = []  # (object name, the checkpoint prefix it sits under)
        with ThreadPoolExecutor(READERS, thread_name_prefix="ledger-list") as pool:
            listed = list(pool.map(names_in, dirs))
        late = sum(n is None for n in listed)
        if late:
            errors.append(f"out of time listing the ledgers ({dl.total:g} s): {late} of {len(dirs)} job prefix(es) "
                          "not read; the report is partial")
        for d, names in zip(dirs, listed):
            todo += [(n, f"gs://{self.objects.bucket_name}/{d[:-len(LEDGER_DIR) - 2]}") for n in names or ()
                     if n.endswith(".json")]
        return self._read_many(todo, dl, errors, progress)

    def _read_many(self, todo: list[tuple[str, str]], dl: Deadline, errors: list[str],
                   progress: Callable[[int, int], None] | None = None) -> tuple[list[dict], list[str]]:
        """The records of `todo`, READERS at a time; past the deadline, what was read and a note."""
        records: list[dict] = []
        left = len(todo)

        def one(item: tuple[str, str]) -> tuple[dict | None, str]:
            if dl.remaining() <= 0:
                return None, "late"
            try:
                rec, err = self._read(item[0], dl)
            except CheckpointError as exc:
                rec, err = None, str(exc)
            if err and dl.remaining() < 1.0:  # cut by the deadline: not read, not a bad record
                return None, "late"
            return rec, err

        with ThreadPoolExecutor(READERS, thread_name_prefix="ledger-read") as pool:
            for (name, prefix), (rec, err) in zip(todo, pool.map(one, todo)):
                left -= 1
                if progress is not None:
                    progress(len(todo) - left, len(todo))
                if err == "late":
                    late = left + 1
                    errors.append(f"out of time reading the ledger ({dl.total:g} s): {late} of {len(todo)} "
                                  "record(s) not read; the report is partial")
                    pool.shutdown(wait=False, cancel_futures=True)
                    break
                if rec is not None:
                    rec["prefix"] = prefix
                    records.append(rec)
                elif err:
                    errors.append(err)
        return records, errors

    def _read(self, name: str, dl: Deadline) -> tuple[dict | None, str]:
        def once(timeout: float) -> bytes:
            return self.objects.bucket.blob(name).download_as_bytes(timeout=timeout, retry=None,
                                                                    end=MAX_RECORD_BYTES - 1)
        try:
            data = self._call(once, dl, f"reading {name}")
        except Exception as exc:  # noqa: BLE001 - one unreadable record is one line, not the report
            if is_not_found(exc):
                return None, ""  # deleted between the listing and the read
            if isinstance(exc, CheckpointError) and "out of time" in str(exc):
                raise
            return None, f"gs://{self.objects.bucket_name}/{name}: {one_line(exc)}"
        try:
            rec = json.loads(data)
        except (ValueError, RecursionError):
            return None, f"gs://{self.objects.bucket_name}/{name}: not JSON"
        if not isinstance(rec, dict):
            return None, f"gs://{self.objects.bucket_name}/{name}: not a JSON object"
        return rec, ""
