"""Jetson boards: the board model, L4T release, power mode and DLA cores, read from files.

Every path is taken relative to `root`, so a tree copied from a board parses exactly as the
board's own files do. The trees in tests/fixtures (units_orin, units_nano) were assembled from
public documentation of L4T's files, not captured from a board.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["read_jetson"]

#: Where L4T kernels put the DLA nodes: `platform/host1x` (older 5.x), `platform/13e40000.host1x`
#: (Orin, L4T 35), `platform/bus@0/13e00000.host1x` (L4T 36), `13e10000.host1x` (Xavier, L4T 32).
_DLA_GLOBS = (
    "sys/devices/platform/*host1x/*nvdla*",
    "sys/devices/platform/bus@0/*host1x/*nvdla*",
    "sys/devices/*host1x/*nvdla*",
)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").replace("\x00", "").strip()
    except OSError:
        return ""


def read_jetson(root: Path = Path("/")) -> dict[str, Any] | None:
    """The board's facts, or None on a machine that is not a Jetson."""
    release = _read(root / "etc/nv_tegra_release")
    model = _read(root / "proc/device-tree/model")
    compatible = _read(root / "proc/device-tree/compatible")
    if not release and "tegra" not in compatible and "jetson" not in model.lower():
        return None
    l4t = ""
    match = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", release)
    if match:
        l4t = f"{match.group(1)}.{match.group(2)}"
    dla_names: set[str] = set()
    for pattern in _DLA_GLOBS:
        for path in root.glob(pattern):
            found = re.search(r"nvdla(\d)", path.name)
            if found:
                dla_names.add(found.group(1))
    nvpmodel = _read(root / "etc/nvpmodel.conf")
    mode_id = _read(root / "var/lib/nvpmodel/status")
    mode_match = re.search(r"pmode:(\d+)", mode_id)
    power_mode: dict[str, Any] = {}
    if mode_match:
        power_mode["id"] = int(mode_match.group(1))
        name = re.search(
            rf"<\s*POWER_MODEL\s+ID\s*=\s*{power_mode['id']}\s+NAME\s*=\s*([^\s>]+)", nvpmodel
        )
        if name:
            power_mode["name"] = name.group(1)
    return {
        "model": model or "unknown Jetson",
        "l4t": l4t,
        "dla_cores": sorted(int(n) for n in dla_names),
        "power_mode": power_mode,
    }
