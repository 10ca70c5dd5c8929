#!/usr/bin/env bash
# The host test lane: the suite in the clone's venv against this machine's Slurm (Debian 12:
# Slurm 22.05, Python 3.11). Named after the host's Debian codename.
#
#   ci/host-lane.sh [PYTEST ARGS...]        VENV=.venv by default
#
# The last line on stdout is the lane summary (see ci/lane_summary.py), also written to
# $LANE_SUMMARY_FILE when set. Exit status: 0 only when pytest passed and ran a test.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
VENV=${VENV:-$REPO/.venv}
TEST_TIMEOUT_S=${HOST_TEST_TIMEOUT_S:-2880}  # a hang guard; the Makefile sets it (the lanes' guards add up there)
OUT=${LANE_OUT:-$REPO/build/lanes}

LANE=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-host}") || LANE=host
[ -x "$VENV/bin/python" ] || { echo "host-lane: no venv at $VENV (make venv)" >&2; exit 2; }
slurmctld=$(command -v slurmctld || echo /usr/sbin/slurmctld)
SLURM_V=$("$slurmctld" -V 2>/dev/null | awk '{print $2}') || true
PY_V=$("$VENV/bin/python" -c 'import platform; print(platform.python_version())')
mkdir -p "$OUT"
rm -f "$OUT/$LANE-junit.xml"

t0=$(date +%s)
cd "$REPO"
# A deadline in CI only: `timeout` leaves the terminal's process group, so Ctrl-C would miss it.
deadline=()
[ -n "${CI:-}" ] && deadline=(timeout --kill-after=30 "$TEST_TIMEOUT_S")
rc=0
"${deadline[@]}" "$VENV/bin/python" -m pytest -q -p no:cacheprovider --junitxml="$OUT/$LANE-junit.xml" "$@" \
  </dev/null || rc=$?

python3 "$HERE/lane_summary.py" --lane "$LANE" --versions "Slurm ${SLURM_V:-none}, Python $PY_V" \
  --pytest-rc "$rc" --seconds "$(( $(date +%s) - t0 ))" --junit "$OUT/$LANE-junit.xml" \
  --ran "$*" ${LANE_SUMMARY_FILE:+--out "$LANE_SUMMARY_FILE"}
