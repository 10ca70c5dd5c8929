#!/usr/bin/env bash
# A Debian chroot test lane: Slurm and Python from one Debian suite's own packages, in a chroot
# built with debootstrap and cached between runs, on a Debian 12 host. SUITE picks the release:
#   trixie  Debian 13: Slurm 24.11, Python 3.13   (ci/trixie-lane.sh)
#   forky   Debian testing: Slurm 26.05, Python 3.14   (ci/forky-lane.sh; testing, not sid,
#           which breaks more often)
#
#   SUITE=forky ci/debian-lane.sh [PYTEST ARGS...]      as root; default: the whole suite
#   SUITE=forky ci/debian-lane.sh --run CMD [ARGS...]   CMD in the chroot instead (in /src, venv on PATH)
#
# Why a chroot and not a container: CI machines are bare Debian VMs as root, without a
# container runtime; debootstrap + chroot needs only Debian's packages.
#
# Cache (outside the clone, reused by every clone on the machine):
#   $SLURMAGENT_CI_CACHE/<suite>-<key>/  the chroot; <key> hashes the package list, suite,
#                                        mirror and build_chroot below: a change rebuilds it
#   $SLURMAGENT_CI_CACHE/pip/            pip's cache, bind-mounted into the chroot
# The venv lives inside the chroot (/opt/slurmagent-venv, reachable by `nobody`), reinstalled
# when pyproject.toml, hooks/ or systemd/ change. Only `.[test]` is installed, never torch or
# lightning: the local torch build is for Python 3.11 only, so torch tests skip here (and
# the lane fails if either is importable, so that stays true).
#
# Everything runs in a private mount namespace, so no mount can outlive the run or reach
# the host's /dev or /sys; the EXIT trap also kills what still runs inside the chroot and
# unmounts in reverse order, and says so if anything is left.
#
# The last line on stdout is the lane summary, e.g.
#   lane forky: Slurm 26.05.5, Python 3.14.7: 1394 passed in 300 s -- ok
# It is also written to $LANE_SUMMARY_FILE when that is set. Exit status: 0 only when
# pytest passed and ran at least one test.
set -euo pipefail

case "${SUITE:-}" in
  ""|*[!a-z]*) echo "debian-lane: set SUITE to a Debian codename (trixie, forky), not '${SUITE:-}'" >&2; exit 2;;
esac
export SUITE
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${SLURMAGENT_CI_CACHE:-/var/cache/slurmagent-ci}
PACKAGES=(slurmctld slurmd slurm-client munge python3 python3-venv procps util-linux
          ca-certificates)  # not logrotate: its cron-daemon-common pulls in systemd, which debootstrap cannot order
VENV=/opt/slurmagent-venv
BUILD_TIMEOUT_S=${LANE_BUILD_TIMEOUT_S:-1200}
# A hang guard for a whole suite; the Makefile sets each lane's (their sum stays inside CI's 90
# minutes: see there).
TEST_TIMEOUT_S=${LANE_TEST_TIMEOUT_S:-1800}
WORKERS=${LANE_WORKERS:-4}  # xdist workers, each with its own local cluster (ci/run_lane.py)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)

say() { printf '%s-lane: %s\n' "$SUITE" "$*" >&2; }
die() { say "$*"; exit 2; }

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, mounts)"

# Re-enter in a private mount namespace: mounts made below vanish with it.
if [ -z "${SLURMAGENT_CI_MOUNT_NS:-}" ]; then
  command -v unshare >/dev/null || die "unshare missing (apt-get install util-linux)"
  SLURMAGENT_CI_MOUNT_NS=1 exec unshare --mount --propagation private "$0" "$@"
fi

command -v debootstrap >/dev/null || die "debootstrap missing (apt-get install debootstrap)"

build_chroot() {  # $1: target dir (empty or absent)
  # A suite newer than the host's debootstrap (Debian 12's knows trixie, not forky) is
  # bootstrapped with the script every current suite links to.
  local script=/usr/share/debootstrap/scripts/$SUITE
  [ -e "$script" ] || script=/usr/share/debootstrap/scripts/sid
  debootstrap --variant=minbase --include="$(IFS=,; echo "${PACKAGES[*]}")" \
    "$SUITE" "$1" "$MIRROR" "$script"
  # Daemons are started by the tests, never by package scripts.
  printf '#!/bin/sh\nexit 101\n' >"$1/usr/sbin/policy-rc.d"
  chmod 755 "$1/usr/sbin/policy-rc.d"
  rm -rf "$1/var/cache/apt/archives/"*.deb
  chroot "$1" /usr/bin/python3 -m venv "$VENV"
  chmod 755 "$1/opt" "$1$VENV"
}

chroot_key() {
  { printf '%s\n' "$SUITE" "$MIRROR" "${PACKAGES[@]}" "$VENV"; declare -f build_chroot; } |
    sha256sum | cut -c1-16
}

# Paths mounted in this namespace under $1, deepest first.
mounts_under() {
  awk -v p="$1" '$5 == p || index($5, p "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r
}

remove_tree() {  # never through a mount point
  [ -z "$(mounts_under "$1")" ] || die "refusing to delete $1: something is mounted under it"
  rm -rf --one-file-system "$1"
}

chroot_works() {
  [ -f "$1/.slurmagent-ci-complete" ] &&
    chroot "$1" /usr/sbin/slurmctld -V >/dev/null 2>&1 &&
    chroot "$1" /usr/sbin/munged -V >/dev/null 2>&1 &&
    chroot "$1" "$VENV/bin/python" -c 'import venv' >/dev/null 2>&1
}

ROOT=""
cleanup() {
  local rc=$? pid left
  trap - EXIT INT TERM
  if [ -n "$ROOT" ]; then
    # Anything still running inside the chroot (a daemon a failed test left) holds mounts.
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
      [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$ROOT" ] && kill -KILL "$pid" 2>/dev/null || true
    done
    for m in $(mounts_under "$ROOT"); do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
    left=$(mounts_under "$ROOT")
    if [ -n "$left" ]; then
      say "still mounted (private namespace, gone when it exits): $left"
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$CACHE/pip"
exec 9>"$CACHE/$SUITE.lock"
if ! flock -n 9; then
  say "waiting for another run of this lane on this machine"
  flock 9
fi

KEY=$(chroot_key)
CHROOT="$CACHE/$SUITE-$KEY"
for old in "$CACHE/$SUITE"-*; do  # other keys (and half-built temporaries) are stale
  [ -e "$old" ] && [ "$old" != "$CHROOT" ] && { say "removing stale $old"; remove_tree "$old"; }
done

t0=$(date +%s)
if chroot_works "$CHROOT"; then
  say "cached chroot $CHROOT"
else
  [ -e "$CHROOT" ] && { say "chroot $CHROOT is incomplete or broken: rebuilding"; remove_tree "$CHROOT"; }
  tmp="$CHROOT.tmp"
  say "building $SUITE chroot (debootstrap from $MIRROR; a few minutes)"
  if ! timeout "$BUILD_TIMEOUT_S" bash -c "$(declare -p SUITE MIRROR PACKAGES VENV); $(declare -f build_chroot); build_chroot '$tmp'" \
       >"$CACHE/build-$SUITE.log" 2>&1; then
    tail -n 30 "$CACHE/build-$SUITE.log" >&2
    for m in $(mounts_under "$tmp"); do umount -l "$m" || true; done
    die "debootstrap failed (log: $CACHE/build-$SUITE.log)"
  fi
  touch "$tmp/.slurmagent-ci-complete"
  mv "$tmp" "$CHROOT"
  chroot_works "$CHROOT" || die "fresh chroot $CHROOT does not work (log: $CACHE/build-$SUITE.log)"
  say "built in $(( $(date +%s) - t0 )) s"
fi
ROOT=$CHROOT

# Mounts (private to this namespace), as a booted system would have them. First the chroot onto
# itself: its / must be a mount point, as on a booted system, or `unshare -m --propagation
# private` in it (the node-local slurmd of the multi-node tests) fails with EINVAL.
mount --bind "$ROOT" "$ROOT"
mount -t proc proc "$ROOT/proc"
mount --rbind /sys "$ROOT/sys"; mount --make-rslave "$ROOT/sys"
mount --rbind /dev "$ROOT/dev"; mount --make-rslave "$ROOT/dev"
mount -t tmpfs -o mode=755 tmpfs "$ROOT/run"
mount -t tmpfs -o mode=1777 tmpfs "$ROOT/tmp"
mkdir -p "$ROOT/root/.cache/pip"
mount --bind "$CACHE/pip" "$ROOT/root/.cache/pip"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
cp /etc/hosts "$ROOT/etc/hosts"
# pip trusts what the host trusts (a TLS-inspecting proxy's CA included), else the chroot's own.
CA=/etc/ssl/certs/ca-certificates.crt
[ -f "$CA" ] || CA=$ROOT/etc/ssl/certs/ca-certificates.crt
cp "$CA" "$ROOT/usr/local/share/slurmagent-host-ca.crt"

# The clone: tracked and untracked-but-not-ignored files, copied (not bind-mounted) so the
# chroot's egg-info and caches never land in the clone and `nobody` can read it.
remove_tree "$ROOT/src"
mkdir -m 755 "$ROOT/src"
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$REPO" ls-files -z --cached --others --exclude-standard |
    tar -C "$REPO" --null --no-recursion --ignore-failed-read -T - -cf - 2>/dev/null |
    tar -xf - -C "$ROOT/src"
else
  tar -C "$REPO" --exclude=./.venv --exclude=./.git --exclude=./build -cf - . | tar -xf - -C "$ROOT/src"
fi
chmod -R a+rX "$ROOT/src"
rm -rf "$ROOT/lane"; mkdir -m 755 "$ROOT/lane"

in_chroot() {
  chroot "$ROOT" /usr/bin/env -i \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    CI=true PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/usr/local/share/slurmagent-host-ca.crt \
    SSL_CERT_FILE=/usr/local/share/slurmagent-host-ca.crt PIP_DEFAULT_TIMEOUT=60 "$@"
}

# The editable install points at /src, so code changes need nothing; dependencies, entry
# points and installed data files (hooks/, systemd/) do.
want=$(cd "$ROOT/src" && find pyproject.toml hooks systemd -type f 2>/dev/null | LC_ALL=C sort |
       xargs sha256sum | sha256sum | cut -c1-16)
if [ "$(cat "$ROOT$VENV/.installed" 2>/dev/null)" != "$want" ]; then
  say "pip install -e .[test] into $VENV"
  t1=$(date +%s)
  in_chroot /bin/sh -c "cd /src && $VENV/bin/python -m pip install -q -e '.[test]'"
  echo "$want" >"$ROOT$VENV/.installed"
  say "venv ready in $(( $(date +%s) - t1 )) s"
fi
if ! in_chroot "$VENV/bin/python" -c \
     'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ("torch", "lightning")))'; then
  die "torch or lightning is installed in the $SUITE venv; this lane must stay without them"
fi

SLURM_V=$(in_chroot /usr/sbin/slurmctld -V | awk '{print $2}')
PY_V=$(in_chroot "$VENV/bin/python" -c 'import platform; print(platform.python_version())')
if [ "${1:-}" = "--run" ]; then  # a command instead of pytest: ci/forky-lane.sh --run bash -c '...'
  shift
  say "Slurm $SLURM_V, Python $PY_V; running $*"
  in_chroot /bin/sh -c 'cd /src && PATH="$0/bin:$PATH" exec "$@"' "$VENV" "$@"
  exit
fi
say "Slurm $SLURM_V, Python $PY_V; pytest ${*:-(whole suite)} on $WORKERS workers"

t2=$(date +%s)
# In the background, so a TERM to this script runs the trap at once (bash defers traps until a
# foreground child exits); the trap kills what runs in the chroot. ci/run_lane.py runs the
# parallel part and then the serial one, under the lane's hang guard.
in_chroot /bin/sh -c 'cd /src && exec /usr/bin/python3 ci/run_lane.py "$@"' run_lane \
  --python "$VENV/bin/python" --workers "$WORKERS" --out /lane --guard-s "$TEST_TIMEOUT_S" -- "$@" </dev/null &
rc=0
wait $! || rc=$?
secs=$(( $(date +%s) - t2 ))

python3 "$HERE/lane_summary.py" --lane "$SUITE" --versions "Slurm $SLURM_V, Python $PY_V" \
  --pytest-rc "$rc" --seconds "$secs" --junit "$ROOT/lane/parallel.xml" --junit "$ROOT/lane/serial.xml" \
  --meter "$ROOT/lane/meter.json" --ran "$*" ${LANE_SUMMARY_FILE:+--out "$LANE_SUMMARY_FILE"}
