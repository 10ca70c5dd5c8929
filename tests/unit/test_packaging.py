"""The wheel an admin installs: built without a deprecation warning, Apache-2.0 with its LICENSE,
every package of the tree in it but the dev harness (slurmagent/devtools, `demo`: from a checkout
only), hooks/ and systemd/ inside the package (install reads them from there), and one version:
pyproject's with the commit the wheel was built from, the same in `--version`, the decision log and
build_info.

The build runs on a copy (a git checkout of its own, one commit) whose pyproject says another
version, so a second literal anywhere would show, and so would another commit."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from support import REPO, find_tool, healthy_snapshot_dict, need_tool

VERSION = "9.8.7"
GIT_ENV = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def git(src: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(src), *args], check=True, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **GIT_ENV)).stdout.strip()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(REPO / name, src / name)
    for name in ("slurmagent", "hooks", "systemd", "contrib", "ci"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pyproject = (src / "pyproject.toml").read_text()
    assert len(re.findall(r'(?m)^version = "[^"]+"', pyproject)) == 1
    (src / "pyproject.toml").write_text(re.sub(r'(?m)^version = "[^"]+"', f'version = "{VERSION}"', pyproject))
    # an older build/ of the checkout that still holds the harness: the wheel must not take it
    (src / "build/lib/slurmagent/devtools").mkdir(parents=True)
    (src / "build/lib/slurmagent/devtools/__init__.py").write_text("")
    if find_tool("git"):  # the commit tests need it (need_tool); the others run without
        git(src, "init", "-q")
        (src / ".gitignore").write_text("build/\ndist/\n")
        git(src, "add", "-A")
        git(src, "commit", "-q", "-m", "the tree under test")
    out = src / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = out.glob("slurmagent-*.whl")
    return whl, proc.stdout + proc.stderr


def test_the_wheel_builds_without_a_deprecation_warning(wheel):
    _, log = wheel
    assert not [line for line in log.splitlines() if re.search(r"deprecat", line, re.I)]


def test_the_wheel_is_apache_2_with_its_license_and_has_every_package(wheel):
    whl, _ = wheel
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        metadata = z.read(f"slurmagent-{VERSION}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert f"slurmagent-{VERSION}.dist-info/licenses/LICENSE" in names
    tree = {str(p.relative_to(REPO)) for p in (REPO / "slurmagent").rglob("*.py")
            if "__pycache__" not in p.parts and "devtools" not in p.parts}
    assert tree - names == set()  # a new package not listed in pyproject would be missing here
    assert "slurmagent/devtools/localcluster.py" not in tree and (REPO / "slurmagent/devtools/localcluster.py").exists()
    assert [n for n in names if "devtools" in n] == []  # the dev harness stays in the checkout
    for name in ("hooks/prolog", "hooks/epilog", "hooks/slurm.conf.example", "systemd/slurmagent-watch.service",
                 "logrotate/slurmagent"):
        assert f"slurmagent/data/{name}" in names
    assert not [n for n in names if n.startswith(("share/", "slurmagent-" + VERSION + ".data/"))]  # no data-files


def test_installed_wheel_version_and_install_agree(wheel, tmp_path):
    """Unpacked (what pip does for a pure wheel), away from the checkout: `--version`, a prolog's
    decision log, its build_info metric and `install` (its files from the package data) say
    pyproject's version and the commit the wheel was built from; `demo` is not there."""
    need_tool("git", install="apt-get install git", chroot_lanes_lack=True)
    whl, _ = wheel
    commit = git(whl.parents[1], "rev-parse", "--short=12", "HEAD")
    built = f"{VERSION}+g{commit}"
    site = tmp_path / "site"
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
    metadata = (site / f"slurmagent-{VERSION}.dist-info/METADATA").read_text()
    (meta_version,) = re.findall(r"(?m)^Version: (.+)$", metadata)
    env = dict(os.environ, PYTHONPATH=str(site))
    run = lambda *a, **kw: subprocess.run([sys.executable, "-m", "slurmagent.entry", *a], capture_output=True,  # noqa: E731
                                          text=True, timeout=120, cwd=tmp_path, **kw)
    shown = run("--version", env=env)
    assert shown.returncode == 0, shown.stderr
    assert meta_version == VERSION and shown.stdout == f"slurmagent, version {built}\n"
    assert (site / "slurmagent/build_commit.txt").read_text() == commit + "\n"
    helped = run("--help", env=env)
    assert helped.returncode == 0 and "install" in helped.stdout and "demo" not in helped.stdout
    demo = run("demo", "--keep", env=env)
    assert demo.returncode == 2 and demo.stdout == "" and demo.stderr == \
        "slurmagent demo: the dev harness is not in the node wheel: run it from a checkout (make demo)\n"

    (tmp_path / "snap.json").write_text(json.dumps(healthy_snapshot_dict(8)))
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n[health]\nsnapshot = "{tmp_path}/snap.json"\n'
                                     'expected_gpus = 8\n[hooks]\nsyslog = false\n')
    hook_env = dict(env, SLURMAGENT_CONFIG=str(tmp_path / "c.toml"), SLURMD_NODENAME="n1", SLURM_JOB_ID="5")
    prolog = run("prolog", env=hook_env)
    assert prolog.returncode == 0, prolog.stderr
    (record,) = [json.loads(line) for line in (tmp_path / "state/hooks.log").read_text().splitlines()]
    assert record["version"] == built and record["severity"] == "INFO"
    assert f'slurmagent_build_info{{version="{built}"}} 1' in (tmp_path / "state/slurmagent.prom").read_text()

    installed = run("install", "--root", str(tmp_path / "root"), env=env)
    assert installed.returncode == 0, installed.stderr
    unit = tmp_path / "root/usr/lib/systemd/system/slurmagent-watch.service"
    assert unit.read_text().startswith((REPO / "systemd/slurmagent-watch.service").read_text()[:40])


def test_a_checkout_names_the_commit_it_has_checked_out(tmp_path):
    """An editable install or a checkout on PYTHONPATH: `--version` names the checkout's HEAD, read
    from git's files (a branch's ref, then packed-refs, a worktree's `.git` file), and follows it."""
    need_tool("git", install="apt-get install git", chroot_lanes_lack=True)
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "slurmagent", repo / "slurmagent", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "one")
    git(repo, "worktree", "add", "-q", "-b", "other", str(tmp_path / "wt"))
    git(tmp_path / "wt", "commit", "-q", "--allow-empty", "-m", "two")

    def shown(checkout: Path) -> str:
        out = subprocess.run([sys.executable, "-m", "slurmagent.entry", "--version"], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(checkout)))
        assert out.returncode == 0, out.stderr
        found = re.fullmatch(r"slurmagent, version \S+\+g([0-9a-f]{12})\n", out.stdout)
        assert found, out.stdout
        return found.group(1)

    one, two = git(repo, "rev-parse", "--short=12", "HEAD"), git(tmp_path / "wt", "rev-parse", "--short=12", "HEAD")
    assert one != two and shown(repo) == one and shown(tmp_path / "wt") == two
    git(repo, "pack-refs", "--all")  # the branches' refs now only in .git/packed-refs
    assert not (repo / ".git/refs/heads/other").exists()
    assert shown(repo) == one and shown(tmp_path / "wt") == two


def test_an_sdist_builds_a_wheel_that_names_no_commit_even_inside_another_checkout(wheel, tmp_path):
    """The sdist carries the build step (ci/wheel_commit.py, MANIFEST.in); unpacked, it is no
    checkout, so its wheel names no commit, not even the HEAD of a repository it was unpacked in."""
    need_tool("git", install="apt-get install git", chroot_lanes_lack=True)
    src = wheel[0].parent.parent
    built = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                            "print(b.build_sdist(sys.argv[1]))", str(tmp_path / "sdist")],
                           cwd=src, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (sdist,) = (tmp_path / "sdist").glob("slurmagent-*.tar.gz")
    outer = tmp_path / "outer"
    outer.mkdir()
    git(outer, "init", "-q")
    git(outer, "commit", "-q", "--allow-empty", "-m", "someone else's repository")
    shutil.unpack_archive(sdist, outer)
    (tree,) = outer.glob("slurmagent-*")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(tree)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = (tmp_path / "dist").glob("slurmagent-*.whl")
    with zipfile.ZipFile(whl) as z:
        assert "slurmagent/build_commit.txt" not in z.namelist()
        assert f"slurmagent-{VERSION}.dist-info/METADATA" in z.namelist()
