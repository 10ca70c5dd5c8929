"""What a checkpoint file's bytes are: content ids and CRC32C, computed in one read.

A file's content id is ``blake3:<hex>`` (BLAKE3 of its bytes, as ``b3sum``
prints it).  Manifests written before BLAKE3 name contents ``sha256:<hex>``;
they stay readable and restorable, and a file that still matches such an entry
keeps it (no re-upload after an upgrade).  Every file's CRC32C (what Cloud
Storage checks) is computed in the same read, so a file is read once per sync
at most; :func:`crc32c_combine` lets parallel ranged transfers check a whole
file from the CRCs of its parts. CRC32C is google_crc32c's, as on every other storage path:
its C extension, or the package's own pure-Python fallback where the extension is missing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import stat
from dataclasses import dataclass
from .errors import LocalChangedError
from .scan import LocalFile

__all__ = [
    "CONTENT_ALGOS",
    "EMPTY_CRC32C",
    "HASH_BUFFER",
    "FileDigest",
    "blake3_hex",
    "crc32c_b64",
    "crc32c_combine",
    "crc32c_int",
    "hash_file",
    "is_content_id",
    "is_crc32c_b64",
    "is_hex_digest",
    "open_nofollow",
]

HASH_BUFFER = 8 * 1024 * 1024  # read size of the hashing pass of a large file
CONTENT_ALGOS = ("blake3", "sha256")  # the content ids a manifest may name, newest first
_HEX64_RE = re.compile(r"[0-9a-f]{64}")


def is_hex_digest(v: object) -> bool:
    """64 lowercase hex digits: a BLAKE3 or SHA-256 as manifests and the hash cache hold them."""
    return isinstance(v, str) and _HEX64_RE.fullmatch(v) is not None


def is_content_id(v: object) -> bool:
    """``blake3:<hex>`` or ``sha256:<hex>``."""
    if not isinstance(v, str):
        return False
    algo, _, hexd = v.partition(":")
    return algo in CONTENT_ALGOS and is_hex_digest(hexd)


def is_crc32c_b64(v: object) -> bool:
    """Base64 of 4 bytes: a CRC32C as Cloud Storage reports it."""
    if not isinstance(v, str):
        return False
    try:
        return len(base64.b64decode(v, validate=True)) == 4
    except (binascii.Error, ValueError):
        return False


# ------------------------------------------------------------------------- CRC32C


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's crc32_combine method).

    Lets parallel ranged transfers verify a whole file from the CRCs of its parts.
    """
    if len2 <= 0:
        return crc1
    odd = [0x82F63B78] + [1 << n for n in range(31)]  # operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def crc32c_b64(value: int) -> str:
    """Cloud Storage's form of a CRC32C: base64 of the 4 big-endian bytes."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def crc32c_int(b64: str) -> int:
    return int.from_bytes(base64.b64decode(b64), "big")


EMPTY_CRC32C = "AAAAAA=="


# ------------------------------------------------------------------ one read, all digests


@dataclass(frozen=True, slots=True)
class FileDigest:
    """What a file's bytes are: content id(s), CRC32C (base64, as GCS reports it) and size."""

    crc32c: str
    size: int
    blake3: str | None = None  # lowercase hex
    sha256: str | None = None  # lowercase hex; only when a legacy manifest entry needed it

    @property
    def content_id(self) -> str:
        """``blake3:<hex>``, or ``sha256:<hex>`` for a digest from a legacy cache entry."""
        if self.blake3:
            return f"blake3:{self.blake3}"
        return f"sha256:{self.sha256}"

    def entry(self, content_id: str | None = None) -> dict:
        """The manifest entry for this content under ``content_id`` (default :attr:`content_id`)."""
        algo, _, hexd = (content_id or self.content_id).partition(":")
        return {algo: hexd, "size": self.size, "crc32c": self.crc32c}


def blake3_hex(data: bytes) -> str:
    import blake3

    return blake3.blake3(data).hexdigest()


def _blake3(threads: int = 1):
    import blake3

    if threads > 1:
        return blake3.blake3(max_threads=threads)
    return blake3.blake3()


def open_nofollow(path: str) -> int:
    """Open a checkpoint file for reading without following a symlink in its last component.

    Raises :class:`LocalChangedError` if it is no longer a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LocalChangedError(f"checkpoint file {path} is no longer a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _changed(path: str) -> LocalChangedError:
    return LocalChangedError(
        f"checkpoint file {path} changed while it was being read "
        "(write it under a temporary name, then rename); sync again later"
    )


def hash_file(
    path: str,
    *,
    want_sha256: bool = False,
    expect: LocalFile | None = None,
    keep_bytes: int = 0,
    threads: int = 1,
) -> tuple[FileDigest, os.stat_result, bytes | None]:
    """Read ``path`` once: BLAKE3 + CRC32C (+ SHA-256 when ``want_sha256``).

    Returns the digest, the stat taken before reading, and the bytes themselves
    when the file is at most ``keep_bytes`` long (so a small file is uploaded
    from memory, read once).  ``expect``: the scan's view of the file; a
    different inode/size/mtime is a :class:`LocalChangedError`, as is a change
    during the read.  ``threads`` > 1 hashes chunks of a large file in parallel.
    Raises ``FileNotFoundError`` if it vanished, ``PermissionError``/``OSError``
    if it cannot be read; a symlink is never followed.
    """
    import google_crc32c  # the storage path's only: kept off the hooks' start-up

    crc = google_crc32c.Checksum()
    fd = open_nofollow(path)
    try:
        before = os.fstat(fd)
        if expect is not None and (
            before.st_ino != expect.ino or before.st_size != expect.size or before.st_mtime_ns != expect.mtime_ns
        ):
            raise _changed(path)
        size = before.st_size
        b3 = _blake3(threads if size >= 4 * HASH_BUFFER else 1)
        sha = hashlib.sha256() if want_sha256 else None
        kept: bytes | None = None
        if size <= keep_bytes:
            chunks = []
            read_size = 0
            while True:
                chunk = os.read(fd, size - read_size + 1)
                if not chunk:
                    break
                chunks.append(chunk)
                read_size += len(chunk)
                if read_size > size:
                    raise _changed(path)
            kept = b"".join(chunks)
            for hasher in (b3, crc, sha):
                if hasher is not None and kept:
                    hasher.update(kept)
        else:
            read_size = 0
            while True:
                chunk = os.read(fd, HASH_BUFFER)
                if not chunk:
                    break
                for hasher in (b3, crc, sha):
                    if hasher is not None:
                        hasher.update(chunk)
                read_size += len(chunk)
                if read_size > size:
                    raise _changed(path)
                del chunk
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if read_size != size or after.st_size != size or after.st_mtime_ns != before.st_mtime_ns:
        raise _changed(path)
    digest = FileDigest(
        crc32c=base64.b64encode(crc.digest()).decode("ascii"),
        size=size,
        blake3=b3.hexdigest(),
        sha256=sha.hexdigest() if sha is not None else None,
    )
    return digest, before, kept
