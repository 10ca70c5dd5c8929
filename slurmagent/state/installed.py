"""The install manifest: every file `slurmagent install` wrote under a root, with the sha256 of
what it wrote, and the directories it created. The ONE reader and writer of
`<root>/var/lib/slurmagent/installed.json`.

A re-run compares a file with its recorded digest: the same means nobody touched it (install
may replace it); different means an admin edited it (install keeps it). `install --uninstall`
removes what the manifest lists, an edited file excepted. Paths are relative to the root, so a
staging tree (`--root`, an image) keeps its manifest valid once it is `/`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .fsutil import atomic_write_text

MANIFEST = "var/lib/slurmagent/installed.json"


@dataclass
class Manifest:
    root: Path
    files: dict[str, str] = field(default_factory=dict)  # path relative to root -> sha256 written
    dirs: list[str] = field(default_factory=list)  # directories install created, relative to root

    @property
    def path(self) -> Path:
        return self.root / MANIFEST

    def rel(self, path: Path) -> str:
        """`path` relative to the root; an absolute path where it lies outside it."""
        try:
            return str(Path(path).relative_to(self.root))
        except ValueError:
            return str(path)

    def abs(self, rel: str) -> Path:
        return self.root / rel

    def written(self, path: Path) -> str | None:
        """The digest install last wrote to `path`, or None (not ours, or from before the manifest)."""
        return self.files.get(self.rel(path))

    def record(self, path: Path, text: str) -> None:
        self.files[self.rel(path)] = digest(text.encode())

    def forget(self, path: Path) -> None:
        self.files.pop(self.rel(path), None)

    def created(self, path: Path) -> None:
        if self.rel(path) not in self.dirs:
            self.dirs.append(self.rel(path))

    def save(self, version: str) -> None:
        doc = {"schema": 1, "written_by": version, "files": dict(sorted(self.files.items())), "dirs": self.dirs}
        atomic_write_text(self.path, json.dumps(doc, indent=1) + "\n", 0o644)


def load(root: Path) -> Manifest:
    """The manifest under `root`; an empty one when there is none (a first install, or one that
    predates the manifest: every existing file that differs then counts as edited)."""
    try:
        doc = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        return Manifest(root)
    except (OSError, ValueError) as exc:
        raise ValueError(f"unreadable install manifest {root / MANIFEST}: {exc}") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    dirs = doc.get("dirs", []) if isinstance(doc, dict) else None
    if not isinstance(files, dict) or not isinstance(dirs, list):
        raise ValueError(f"unreadable install manifest {root / MANIFEST}: not a slurmagent manifest")
    return Manifest(root, {str(k): str(v) for k, v in files.items()}, [str(d) for d in dirs])


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_of(path: Path) -> str | None:
    """sha256 of the file at `path`, None when there is none."""
    try:
        return digest(path.read_bytes())
    except (FileNotFoundError, IsADirectoryError):
        return None
