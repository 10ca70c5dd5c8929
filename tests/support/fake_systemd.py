"""A fake `systemctl` (a script put first on PATH) and a fake `scontrol` for `doctor`.

`FakeSystemd(dir).set(unit, **props)` gives `systemctl show UNIT --property=...` its answer
(key=value lines, like systemd's); `down()` makes every call fail as systemctl does where systemd
does not run. `fake_scontrol(path, show_config)` answers `scontrol show config` (None: fails as
when slurmctld is down).
"""

from __future__ import annotations

from pathlib import Path

HEALTHY = {
    "slurmagent-watch.service": dict(LoadState="loaded", UnitFileState="enabled", ActiveState="active",
                                     SubState="running", Result="success", ExecMainStatus="0"),
    "slurmagent-expiry.timer": dict(LoadState="loaded", UnitFileState="enabled", ActiveState="active",
                                    SubState="waiting", Result="success"),
    "slurmagent-expiry.service": dict(LoadState="loaded", UnitFileState="static", ActiveState="inactive",
                                      SubState="dead", Result="success", ExecMainStatus="0",
                                      ExecMainExitTimestamp="Sun 2026-12-06 13:00:00 UTC"),
}


class FakeSystemd:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        script = self.dir / "systemctl"
        script.write_text(
            "#!/bin/sh\n"
            f'd="{self.dir}"\n'
            'if [ -e "$d/down" ]; then echo "System has not been booted with systemd as init system (PID 1). '
            "Can't operate.\" >&2; echo 'Failed to connect to bus: Host is down' >&2; exit 1; fi\n"
            '[ "$1" = show ] || exit 1\n'
            'if [ -f "$d/$2.props" ]; then cat "$d/$2.props"; else printf "LoadState=not-found\\n'
            'UnitFileState=\\nActiveState=inactive\\n"; fi\n')
        script.chmod(0o755)
        for unit, props in HEALTHY.items():
            self.set(unit, **props)

    def set(self, unit: str, **props: str) -> None:
        (self.dir / f"{unit}.props").write_text("".join(f"{k}={v}\n" for k, v in props.items()))

    def update(self, unit: str, **props: str) -> None:
        self.set(unit, **{**HEALTHY.get(unit, {}), **props})

    def remove(self, unit: str) -> None:
        (self.dir / f"{unit}.props").unlink()

    def down(self) -> None:
        (self.dir / "down").touch()


def fake_scontrol(path: Path, show_config: str | None) -> Path:
    """`scontrol show config` answering `show_config`, or failing as Slurm does with slurmctld down."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if show_config is None:
        body = ("echo 'slurm_load_ctl_conf error: Unable to contact slurm controller (connect failure)' >&2\n"
                "exit 1\n")
    else:
        body = f"cat <<'EOF'\n{show_config}\nEOF\n"
    path.write_text(f'#!/bin/sh\n[ "$1 $2" = "show config" ] || exit 1\n{body}')
    path.chmod(0o755)
    return path


SHOW_CONFIG_2411 = ("Configuration data as of 2026-12-06T13:00:00\nSlurmctldHost           = ctl(127.0.0.1)\n"
                    "SlurmctldPort           = 6817\nSLURM_VERSION           = 24.11.1\n")
