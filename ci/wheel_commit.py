"""The build step that stamps a wheel with the commit it was built from (pyproject's
`[tool.setuptools.cmdclass]`): `build_py` also writes `slurmagent/build_commit.txt` into the build
tree (never into the checkout), so two wheels of one version tell apart (`slurmagent --version`:
`0.1.0+g<commit>`; state/build reads it back). No git, or not a checkout (an sdist): no file, and
the version stays pyproject's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from setuptools.command.build_py import build_py

COMMIT_FILE = "build_commit.txt"  # state/build.COMMIT_FILE
GIT_TIMEOUT_S = 30


def checkout_commit(source: Path) -> str | None:
    """`<12 hex digits>` of HEAD, `.dirty` after it when tracked files differ from it; None when
    `source` is not a checkout's top (an sdist unpacked inside another repository names no commit
    of that repository; a checkout owned by another user is still read: `safe.directory`)."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-c", f"safe.directory={source}", "-C", str(source), *args],
                                  capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != source.resolve():
        return None
    head = git("rev-parse", "--short=12", "HEAD")
    if not head:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head + (".dirty" if dirty else "")


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        # pyproject leaves the dev harness out, but an older build/ of this checkout may still hold it
        shutil.rmtree(Path(self.build_lib) / "slurmagent" / "devtools", ignore_errors=True)
        if self.editable_mode:  # an editable install reads the checkout's HEAD itself (state/build)
            return
        commit = checkout_commit(Path(__file__).resolve().parents[1])  # the checkout this file is in
        if commit:
            target = Path(self.build_lib) / "slurmagent" / COMMIT_FILE
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(commit + "\n", encoding="utf-8")
