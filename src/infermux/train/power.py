"""Power modes: read and recorded everywhere; changed only on a Jetson, and only when asked.

A Jetson's power mode is what `nvpmodel -q` prints (the mode's name on an `NV Power Mode:`
line, then its number; JetPack 4 adds an `NV Fan Mode:` line and warnings start `NVPM WARN`),
checked against `/var/lib/nvpmodel/status` (`pmode:0002`) and the modes of
`/etc/nvpmodel.conf` (`< POWER_MODEL ID=2 NAME=MODE_30W >`). Whether `jetson_clocks` pinned the
clocks is read from `jetson_clocks --show`, where it can run.

Setting a mode runs `nvpmodel -m ID` (root; stdin closed, so the reboot prompt some modes raise
is never answered: such a mode is reported as needing a reboot, and nothing is changed) and,
with `jetson_clocks`, `jetson_clocks` after it. Nothing is ever changed on another machine: on
a GPU server the GPU may be shared, and its clocks are not ours to move.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infermux.errors import RunError, UsageError
from infermux.units.jetson import read_jetson

__all__ = [
    "PowerMode",
    "parse_nvpmodel_conf",
    "parse_nvpmodel_query",
    "read_power_mode",
    "set_commands",
    "set_power_mode",
]

_TIMEOUT_S = 20.0


@dataclass
class PowerMode:
    """The platform's power mode as read (or why it could not be)."""

    platform: str  # jetson | other
    mode_id: int | None = None
    name: str | None = None
    #: Every mode the board defines: id → name (from nvpmodel.conf).
    modes: dict[int, str] = field(default_factory=dict)
    jetson_clocks: bool | None = None
    method: str = "none"
    notes: list[str] = field(default_factory=list)

    @property
    def settable(self) -> bool:
        """Only a Jetson's mode is ever changed."""
        return self.platform == "jetson"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        data = asdict(self)
        data["modes"] = {str(k): v for k, v in self.modes.items()}
        return data


def parse_nvpmodel_query(text: str) -> tuple[str | None, int | None]:
    """(name, id) from `nvpmodel -q` output; None where a part is missing."""
    name: str | None = None
    mode_id: int | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.lower().startswith("nv power mode:"):
            name = stripped.split(":", 1)[1].strip() or None
        elif name is not None and mode_id is None and stripped.isdigit():
            mode_id = int(stripped)
    return name, mode_id


def parse_nvpmodel_conf(text: str) -> dict[int, str]:
    """Id → name of every `< POWER_MODEL ID=N NAME=X >` in an nvpmodel configuration."""
    return {int(i): n for i, n in re.findall(
        r"<\s*POWER_MODEL\s+ID\s*=\s*(\d+)\s+NAME\s*=\s*([^\s>]+)", text)}


def _clocks_pinned(show: str) -> bool | None:
    """Whether `jetson_clocks --show` says the GPU runs at its maximum (MinFreq = MaxFreq)."""
    match = re.search(r"GPU MinFreq=(\d+) MaxFreq=(\d+) CurrentFreq=(\d+)", show)
    if match is None:
        return None
    return match.group(1) == match.group(2)


def read_power_mode(root: Path = Path("/"), *, run_tools: bool = True) -> PowerMode:
    """The power mode, from nvpmodel where it runs, else from its status and configuration files."""
    board = read_jetson(root)
    if board is None:
        return PowerMode("other", notes=["not a Jetson: no settable power mode (recorded as such)"])
    mode = PowerMode("jetson", method="files")
    conf = root / "etc/nvpmodel.conf"
    try:
        mode.modes = parse_nvpmodel_conf(conf.read_text())
    except OSError:
        mode.notes.append(f"{conf} is not readable: the board's modes are unknown")
    status = board.get("power_mode") or {}
    mode.mode_id, mode.name = status.get("id"), status.get("name")
    nvpmodel = shutil.which("nvpmodel") if run_tools and root == Path("/") else None
    if nvpmodel:
        try:
            proc = subprocess.run([nvpmodel, "-q"], capture_output=True, text=True,
                                  timeout=_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
            name, mode_id = parse_nvpmodel_query(proc.stdout)
            if name is not None:
                mode.name, mode.method = name, "nvpmodel -q"
                if mode_id is not None:
                    mode.mode_id = mode_id
        except (OSError, subprocess.TimeoutExpired) as exc:
            mode.notes.append(f"nvpmodel -q failed ({exc}); mode read from files")
    clocks = shutil.which("jetson_clocks") if run_tools and root == Path("/") else None
    if clocks:
        try:
            proc = subprocess.run([clocks, "--show"], capture_output=True, text=True,
                                  timeout=_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
            mode.jetson_clocks = _clocks_pinned(proc.stdout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            mode.notes.append(f"jetson_clocks --show failed ({exc})")
    if mode.mode_id is None:
        mode.notes.append("the current power mode could not be read")
    return mode


def set_commands(mode_id: int, *, jetson_clocks: bool) -> list[list[str]]:
    """The commands that set a Jetson's mode (and pin its clocks), in order."""
    commands = [["nvpmodel", "-m", str(mode_id)]]
    if jetson_clocks:
        commands.append(["jetson_clocks"])
    return commands


def set_power_mode(request: str, *, jetson_clocks: bool = False, root: Path = Path("/")
                   ) -> PowerMode:
    """Set the power mode named by `request` (an id or a name) on a Jetson; the mode after.

    Refused, with one line saying why, anywhere else, for a mode the board does not define,
    and for a mode that needs a reboot.
    """
    current = read_power_mode(root)
    if not current.settable:
        raise UsageError(f"--power-mode {request!r}: power modes are set only on a Jetson (this "
                         "machine is not one); drop --power-mode to train at the current settings")
    wanted: int | None = None
    if request.isdigit():
        wanted = int(request)
    else:
        wanted = next((i for i, n in current.modes.items() if n.lower() == request.lower()), None)
    if wanted is None or (current.modes and wanted not in current.modes):
        known = ", ".join(f"{i} ({n})" for i, n in sorted(current.modes.items())) or "unknown"
        raise UsageError(f"--power-mode {request!r} is not a mode of this board; its modes: "
                         f"{known}")
    for command in set_commands(wanted, jetson_clocks=jetson_clocks):
        if shutil.which(command[0]) is None:
            raise RunError(f"{command[0]} is not installed here: install L4T's nvpmodel or drop "
                           "--power-mode")
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RunError(f"{' '.join(command)} failed: {exc}") from exc
        output = proc.stdout + proc.stderr
        if "reboot required" in output.lower():
            raise RunError(f"power mode {wanted} needs a reboot to take effect: run `sudo "
                           f"nvpmodel -m {wanted}`, reboot, then train without --power-mode")
        if proc.returncode != 0:
            first = next((line for line in output.splitlines() if line.strip()), "no output")
            raise RunError(f"{' '.join(command)} exited {proc.returncode}: {first} (run as root)")
    after = read_power_mode(root)
    if after.mode_id != wanted:
        raise RunError(f"power mode is {after.mode_id} after `nvpmodel -m {wanted}`: the change "
                       "did not take effect")
    return after
