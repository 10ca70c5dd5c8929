"""Which entries of a checkpoint directory make the checkpoint, and what a name in it may be.

The job-step wrapper (``slurmagent run``) gives the trainer a local directory
(``SLURMAGENT_CKPT_DIR``).  Everything a framework writes there is part of the
checkpoint, dotfiles included (DCP's ``.metadata``, zarr's ``.zarray``), except

* *temporary names*, i.e. files still being written (:func:`is_temporary_name`):
  a name ending in ``.tmp``, ``.temp``, ``.part``, ``.partial``, ``.swp``, ``~``
  or ``.__lock`` (TensorStore), containing ``.tmp.`` (``model.tmp.1234``) or
  ``.orbax-checkpoint-tmp-`` (Orbax's step directory before its rename), or
  Python's ``tempfile`` default ``tmpXXXXXXXX``.  The file joins the checkpoint
  once it is renamed to its final name;
* slurmagent's own working files: any name starting with :data:`RESERVED_PREFIX`
  (``.slurmagent-``), e.g. the restore staging directory;
* sockets, FIFOs and devices.

A symlink is never followed.  One that leads, inside the directory, to a file
or directory of the checkpoint (Lightning's ``save_last="link"``) is kept as a
link: the manifest records its target relative to the link's directory and a
restore recreates the link.  One that leads outside (or nowhere) is left out.
Every entry left out, except slurmagent's own, is reported once through the
``on_skip`` callback; nothing is dropped silently.

Names: one rule (:func:`name_problem`) decides what a manifest may hold; the
scan leaves out (and reports) what the rule refuses, and a restore refuses a
manifest breaking it, so a synced checkpoint is always restorable.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
from dataclasses import dataclass
from typing import Callable

from .errors import CheckpointError

__all__ = [
    "RESERVED_PREFIX",
    "SkipCallback",
    "LocalFile",
    "is_temporary_name",
    "is_reserved_name",
    "is_in_progress_name",
    "is_in_progress_path",
    "name_problem",
    "link_problem",
    "scan_checkpoint_dir",
    "parent_dirs",
]

RESERVED_PREFIX = ".slurmagent-"

SkipCallback = Callable[[str, str], None]  # (relpath, why)


# ------------------------------------------------------------------------ name rules

_TEMP_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".swp", "~", ".__lock")
_TEMP_INFIXES = (".tmp.", ".orbax-checkpoint-tmp-")
_MKSTEMP_RE = re.compile(r"tmp[a-z0-9_]{8}")  # tempfile's default names


def is_temporary_name(name: str) -> bool:
    """True if one path component names something still being written (see module doc)."""
    low = name.lower()
    return (
        low.endswith(_TEMP_SUFFIXES)
        or any(infix in low for infix in _TEMP_INFIXES)
        or _MKSTEMP_RE.fullmatch(name) is not None
    )


def is_reserved_name(name: str) -> bool:
    """True for slurmagent's own working files inside a checkpoint directory (never synced)."""
    return name.startswith(RESERVED_PREFIX)


def is_in_progress_name(name: str) -> bool:
    """True if one path component is left out of a checkpoint: temporary or slurmagent's own."""
    return is_temporary_name(name) or is_reserved_name(name)


def is_in_progress_path(relpath: str) -> bool:
    """True if any component of a ``/``-separated relative path is left out."""
    return any(is_in_progress_name(part) for part in relpath.split("/"))


def name_problem(relpath: object) -> str | None:
    """Why ``relpath`` cannot be a name in a checkpoint manifest, or None when it can.

    The one rule shared by sync (which leaves such a file out, with a warning)
    and restore (which refuses such a manifest).  Any byte but ``/`` and NUL is
    allowed in a component (backslashes included: on Linux they are ordinary
    characters); a name must be relative, without empty, ``.`` or ``..``
    components, and not one of slurmagent's reserved names.
    """
    if not isinstance(relpath, str) or not relpath:
        return "is not a non-empty string"
    if "\x00" in relpath or relpath.startswith("/"):
        return "is not a relative '/'-separated path"
    parts = relpath.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' component"
    if any(is_reserved_name(part) for part in parts):
        return f"uses slurmagent's reserved prefix {RESERVED_PREFIX!r}"
    try:
        os.fsencode(relpath)
    except UnicodeError:
        return "cannot be encoded as a file name"
    return None


def link_problem(relpath: str, target: object) -> str | None:
    """Why a link entry ``relpath -> target`` cannot be restored inside the directory."""
    if not isinstance(target, str) or not target or "\x00" in target or target.startswith("/"):
        return "link target is not a relative path"
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(relpath), target))
    if resolved in (".", "") or resolved == ".." or resolved.startswith("../") or resolved.startswith("/"):
        return "link target leads outside the checkpoint"
    if name_problem(resolved):
        return f"link target {resolved!r} {name_problem(resolved)}"
    return None


# ------------------------------------------------------------------------- scanning


@dataclass(frozen=True, slots=True)
class LocalFile:
    """One entry of the checkpoint directory: a regular file, or a kept symlink (``link``)."""

    relpath: str  # "/"-separated, relative to the checkpoint dir
    path: str  # absolute path
    size: int
    mtime_ns: int
    ino: int = 0
    link: str | None = None  # a kept symlink: its target, relative to the link's directory

    @property
    def is_link(self) -> bool:
        return self.link is not None


def scan_checkpoint_dir(ckpt_dir: str | os.PathLike, on_skip: SkipCallback | None = None) -> list[LocalFile]:
    """Regular files and kept symlinks of the checkpoint, sorted by relpath (see module doc).

    ``on_skip(relpath, why)`` hears about every entry left out except
    slurmagent's own.  A missing directory is an empty checkpoint.  Nothing is
    followed through a symlink.
    """
    root = os.path.abspath(os.fspath(ckpt_dir))
    real_root = os.path.realpath(root)
    out: list[LocalFile] = []
    links: list[tuple[str, str, os.stat_result]] = []  # (rel, abs path, lstat)

    def skip(rel: str, why: str) -> None:
        if on_skip is not None:
            on_skip(rel, why)

    def walk(dirpath: str, relprefix: str) -> None:
        try:
            with os.scandir(dirpath) as it:
                entries = sorted(it, key=lambda e: e.name)
        except FileNotFoundError:
            return
        except NotADirectoryError:
            return
        except OSError as exc:
            if relprefix:
                skip(relprefix, f"unreadable directory ({exc.strerror or exc})")
                return
            raise CheckpointError(f"cannot read checkpoint directory {root}: {exc.strerror or exc}") from None
        for entry in entries:
            rel = f"{relprefix}{entry.name}"
            if is_reserved_name(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # vanished since the listing
            except OSError as exc:
                skip(rel, f"unreadable ({exc.strerror or exc})")
                continue
            if stat.S_ISDIR(st.st_mode):
                if is_temporary_name(entry.name):
                    skip(rel + "/", "a temporary name (still being written); it joins once renamed")
                else:
                    walk(entry.path, rel + "/")
                continue
            if is_temporary_name(entry.name):
                skip(rel, "a temporary name (still being written); it joins once renamed")
                continue
            problem = name_problem(rel)
            if problem:
                skip(rel, f"name {problem}")
                continue
            if stat.S_ISLNK(st.st_mode):
                links.append((rel, entry.path, st))
            elif stat.S_ISREG(st.st_mode):
                out.append(LocalFile(rel, entry.path, st.st_size, st.st_mtime_ns, st.st_ino))
            else:
                skip(rel, "not a regular file (socket, FIFO or device)")

    walk(root, "")
    kept_dirs = {d for f in out for d in parent_dirs(f.relpath)}
    kept_files = {f.relpath for f in out}
    for rel, path, st in links:
        target, why = _inside_target(real_root, path)
        if target is None:
            skip(rel, why)
            continue
        if target not in kept_files and target not in kept_dirs:
            skip(rel, f"a symlink to {target!r}, which is not part of the checkpoint")
            continue
        link_text = posixpath.relpath(target, posixpath.dirname(rel) or ".")
        out.append(LocalFile(rel, path, 0, st.st_mtime_ns, st.st_ino, link=link_text))
    out.sort(key=lambda f: f.relpath)
    return out


def parent_dirs(relpath: str) -> list[str]:
    """The directories on the way to ``relpath``: "a/b/c" -> ["a", "a/b"]."""
    parts = relpath.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _inside_target(real_root: str, link_path: str) -> tuple[str | None, str]:
    """(the relpath a symlink finally leads to, "") when that is inside ``real_root``; else (None, why).

    Only link texts are read (``realpath``), never the target's content.
    """
    try:
        resolved = os.path.realpath(link_path, strict=True)
    except (OSError, RuntimeError):
        return None, "a symlink leading nowhere (dangling or a loop)"
    base = real_root.rstrip("/") + "/"
    if not resolved.startswith(base):
        return None, "a symlink leading outside the checkpoint directory (not followed)"
    rel = resolved[len(base) :]
    if is_in_progress_path(rel) or name_problem(rel):
        return None, f"a symlink to {rel!r}, which is not part of the checkpoint"
    return rel, ""
