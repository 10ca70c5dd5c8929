#!/usr/bin/env bash
# The Debian testing (forky) lane: Slurm 26.05, Python 3.14, in a cached debootstrap chroot:
# ci/debian-lane.sh with SUITE=forky (read it for the cache, the mounts and the summary line).
#
#   ci/forky-lane.sh [PYTEST ARGS...]      as root; default: the whole suite
#   ci/forky-lane.sh --run CMD [ARGS...]   CMD in the chroot instead (in /src, venv on PATH)
SUITE=forky exec "$(dirname "${BASH_SOURCE[0]}")/debian-lane.sh" "$@"
