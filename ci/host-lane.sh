#!/usr/bin/env bash
# The host test lane: the suite in the clone's venv against this machine's Slurm (Debian 12:
# Slurm 22.05, Python 3.11). Named after the host's Debian codename.
#
#   ci/host-lane.sh [PYTEST ARGS...]        VENV=.venv by default
#
# pytest runs through ci/run_lane.py: the suite on $LANE_WORKERS xdist workers, then the `serial`
# tests alone; it prints the skips, the 25 slowest tests, wall, CPU and peak memory.
# The last line on stdout is the lane summary (see ci/lane_summary.py), also written to
# $LANE_SUMMARY_FILE when set. Exit status: 0 only when pytest passed and ran a test.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
VENV=${VENV:-$REPO/.venv}
TEST_TIMEOUT_S=${HOST_TEST_TIMEOUT_S:-2880}  # a hang guard; the Makefile sets it (the lanes' guards add up there)
WORKERS=${LANE_WORKERS:-4}  # xdist workers, each with its own local cluster; the Makefile sets it
OUT=${LANE_OUT:-$REPO/build/lanes}

LANE=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-host}") || LANE=host
[ -x "$VENV/bin/python" ] || { echo "host-lane: no venv at $VENV (make venv)" >&2; exit 2; }
slurmctld=$(command -v slurmctld || echo /usr/sbin/slurmctld)
SLURM_V=$("$slurmctld" -V 2>/dev/null | awk '{print $2}') || true
PY_V=$("$VENV/bin/python" -c 'import platform; print(platform.python_version())')
mkdir -p "$OUT"

t0=$(date +%s)
cd "$REPO"
# The hang guard in CI only (a developer's Ctrl-C reaches pytest's process group anyway).
guard=()
[ -n "${CI:-}" ] && guard=(--guard-s "$TEST_TIMEOUT_S")
rc=0
python3 "$HERE/run_lane.py" --python "$VENV/bin/python" --workers "$WORKERS" --out "$OUT/$LANE" "${guard[@]}" \
  -- "$@" </dev/null || rc=$?

python3 "$HERE/lane_summary.py" --lane "$LANE" --versions "Slurm ${SLURM_V:-none}, Python $PY_V" \
  --pytest-rc "$rc" --seconds "$(( $(date +%s) - t0 ))" --junit "$OUT/$LANE/parallel.xml" \
  --junit "$OUT/$LANE/serial.xml" --meter "$OUT/$LANE/meter.json" \
  --ran "$*" ${LANE_SUMMARY_FILE:+--out "$LANE_SUMMARY_FILE"}
