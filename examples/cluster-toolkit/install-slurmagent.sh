#!/bin/bash
# Installs slurmagent on the cluster image: run as root by the startup-script runner of
# slurmagent-gpu.yaml on the Packer VM that builds the image (docs/admin/cluster-toolkit.md).
# Usage: install-slurmagent.sh /path/to/slurmagent-VERSION-py3-none-any.whl
#
# One venv per version and a `current` link switched with rename(2) (docs/admin/install.md,
# "Upgrades"): the shims and units name /opt/slurmagent/current/bin/slurmagent. The units are
# installed, not enabled: the image serves the controller, the login and the GPU nodes, so each
# role enables its own at boot (the blueprint's startup scripts). The Prolog/Epilog shims reach
# /slurm/custom_scripts/{prolog,epilog}.d/ through the blueprint's prolog_scripts/epilog_scripts.
set -euo pipefail

WHEEL=${1:?usage: $0 WHEEL}
VERSION=$(basename "$WHEEL" | cut -d- -f2)
BASE=/opt/slurmagent
BIN=$BASE/current/bin/slurmagent

# slurmagent needs Python >= 3.11: the slurm-gcp Rocky images have 3.6/3.9 as python3 and 3.11
# as a package; Debian 12 and Ubuntu 24.04 have it as python3.
python_ok() { command -v "$1" >/dev/null && "$1" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
PY=""
for candidate in python3.13 python3.12 python3.11 python3; do
    if python_ok "$candidate"; then PY=$candidate; break; fi
done
if [ -z "$PY" ]; then
    if command -v dnf >/dev/null; then
        dnf -y install python3.11 && PY=python3.11
    elif command -v apt-get >/dev/null; then
        apt-get update && apt-get -y install python3-venv && PY=python3
    fi
fi
python_ok "$PY" || { echo "install-slurmagent: no Python >= 3.11 with venv on this image" >&2; exit 1; }

"$PY" -m venv "$BASE/venvs/$VERSION"
"$BASE/venvs/$VERSION/bin/pip" install --quiet "$WHEEL"
"$BASE/venvs/$VERSION/bin/slurmagent" --version
ln -sfn "venvs/$VERSION" "$BASE/current.new"
mv -T "$BASE/current.new" "$BASE/current"

# Shims in /etc/slurmagent/hooks (HealthCheckProgram runs .../healthcheck), vendor units in
# /usr/lib/systemd/system, the config template, logrotate, /var/lib/slurmagent.
"$BIN" install --binary "$BIN"
systemctl daemon-reload || true  # no systemd manager in a chroot build: harmless
