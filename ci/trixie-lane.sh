#!/usr/bin/env bash
# The Debian 13 (trixie) lane: Slurm 24.11, Python 3.13, in a cached debootstrap chroot:
# ci/debian-lane.sh with SUITE=trixie (read it for the cache, the mounts and the summary line).
#
#   ci/trixie-lane.sh [PYTEST ARGS...]      as root; default: the whole suite
#   ci/trixie-lane.sh --run CMD [ARGS...]   CMD in the chroot instead (in /src, venv on PATH)
SUITE=trixie exec "$(dirname "${BASH_SOURCE[0]}")/debian-lane.sh" "$@"
