"""Jetson boards: INA3221 power rails, GPU/DLA/EMC clocks, GPU and EMC load, temperatures.

Every path is relative to `root`, so a tree copied from a board parses exactly as the board's
own files. The trees in tests/fixtures/jetson_* were assembled from the public sources below,
not captured from a board (tests/fixtures/jetson_README.md). The layouts, as read by jetson-stats (rbonghi/
jetson_stats, jtop/core/{power,gpu,memory,engine}.py), zeus (zeus/device/soc/jetson.py) and
energymon (jetson/ina3221{,x}.c):

- power rails, L4T ≥ 34 (JetPack 5+, mainline `ina3221` hwmon driver):
  `sys/bus/i2c/drivers/ina3221/<bus>-<addr>/hwmon/hwmon<N>/in<ch>_label` (rail name; `NC` =
  not connected; channel 7 is "sum of shunt voltages"), `in<ch>_input` (mV),
  `curr<ch>_input` (mA), channels 1-3;
- power rails, L4T ≤ 32 (JetPack 4, L4T `ina3221x` IIO driver):
  `sys/bus/i2c/drivers/ina3221x/<bus>-<addr>/iio:device<N>/rail_name_<ch>`,
  `in_power<ch>_input` (mW), `in_voltage<ch>_input` (mV), `in_current<ch>_input` (mA),
  channels 0-2;
- GPU clock: devfreq `cur_freq` (Hz) under the GPU's device node (`17000000.ga10b` Orin JP5,
  `bus@0/17000000.gpu` Orin JP6, `17000000.gv11b` Xavier, `57000000.gpu` Nano/TX1,
  `17000000.gp10b` TX2); GPU load: `load` (per mille) of `gpu.0` or that node;
- EMC clock: `sys/kernel/debug/bpmp/debug/clk/emc/rate` (Hz, debugfs, root only) or
  `sys/kernel/debug/clk/emc/clk_rate`; EMC load from the activity monitor
  (`actmon_avg_activity/mc_all` and its debugfs variants) divided by the EMC clock in kHz, as
  jetson-stats computes it;
- DLA clocks: `sys/kernel/debug/bpmp/debug/clk/dla<N>_core/rate` (Orin) or
  `sys/kernel/debug/clk/dla<N>_core/clk_rate` (Hz, debugfs, root only);
- temperatures: `sys/class/thermal/thermal_zone*/{type,temp}` (m°C);
- power mode: `infermux.units.jetson.read_jetson` (nvpmodel status and configuration).

Rails are named by the board. The whole-module figure is the input rail where the board has
one (`VDD_IN`: Orin Nano/NX, Xavier NX, TX2, TX1; `POM_5V_IN`: Nano); otherwise (AGX Orin, AGX
Xavier) the sum of the rails, less rails another rail already contains (AGX Orin's
`VDDQ_VDD2_1V8AO` is inside `VIN_SYS_5V0`, per NVIDIA's Orin power-modelling guide).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infermux.telemetry.base import Reading, Source, SourceUnavailable
from infermux.units.jetson import read_jetson

__all__ = ["INPUT_RAILS", "JetsonSource", "Rail", "find_rails", "module_power_w"]

#: Rails that measure the whole module's input.
INPUT_RAILS = ("VDD_IN", "POM_5V_IN")
#: Rails another rail already contains (summing them would count power twice).
CONTAINED_RAILS = ("VDDQ_VDD2_1V8AO",)
#: Rails that feed the GPU (shared with other blocks where the name says so).
GPU_RAILS = ("VDD_GPU_SOC", "VDD_CPU_GPU_CV", "VDD_CPU_GPU", "GPU", "POM_5V_GPU",
             "VDD_SYS_GPU", "VDD_GPU")
_GPU_NODE = re.compile(r"(gpu|ga10b|gv11b|gp10b|gm20b)", re.IGNORECASE)
_GPU_FREQ_GLOBS = (
    "sys/devices/*/devfreq/*/cur_freq",
    "sys/devices/*/devfreq_dev/cur_freq",
    "sys/devices/platform/*/devfreq/*/cur_freq",
    "sys/devices/platform/bus@0/*/devfreq/*/cur_freq",
)
_GPU_LOAD_PATHS = (
    "sys/devices/gpu.0/load",
    "sys/devices/platform/gpu.0/load",
    "sys/devices/platform/bus@0/17000000.gpu/load",
    "sys/devices/17000000.ga10b/load",
    "sys/devices/17000000.gv11b/load",
    "sys/devices/57000000.gpu/load",
    "sys/devices/17000000.gp10b/load",
)
_EMC_RATE_PATHS = ("sys/kernel/debug/bpmp/debug/clk/emc/rate", "sys/kernel/debug/clk/emc/clk_rate")
_EMC_ACTIVITY_PATHS = (
    "sys/kernel/debug/cactmon/mc_all",
    "sys/kernel/debug/bpmp/debug/actmon/mc_all_avg_activity",
    "sys/kernel/actmon_avg_activity/mc_all",
)
_DLA_RATE_GLOBS = ("sys/kernel/debug/bpmp/debug/clk/dla[0-9]_core/rate",
                   "sys/kernel/debug/clk/dla[0-9]_core/clk_rate")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Rail:
    """One INA3221 channel: its name and the files that give its power."""

    name: str
    driver: str  # ina3221 (hwmon, JetPack 5+) | ina3221x (IIO, JetPack 4)
    power_mw: Path | None = None
    voltage_mv: Path | None = None
    current_ma: Path | None = None

    def read_w(self) -> float | None:
        """The rail's power in watts, from the power file or voltage × current."""
        if self.power_mw is not None:
            mw = _read_int(self.power_mw)
            if mw is not None:
                return mw / 1000.0
        if self.voltage_mv is not None and self.current_ma is not None:
            mv, ma = _read_int(self.voltage_mv), _read_int(self.current_ma)
            if mv is not None and ma is not None:
                return mv * ma / 1e6
        return None


def find_rails(root: Path = Path("/")) -> list[Rail]:
    """Every connected INA3221 rail on the board, in the order of the sensors and channels."""
    rails: list[Rail] = []
    seen: set[str] = set()
    for hwmon in sorted(root.glob("sys/bus/i2c/drivers/ina3221/*/hwmon/hwmon*")):
        for label in sorted(hwmon.glob("in*_label")):
            name = label.read_text().strip()
            channel = label.name[2:].split("_")[0]
            if not channel.isdigit() or name == "NC" or name.startswith("sum of") or name in seen:
                continue
            seen.add(name)
            rails.append(Rail(name, "ina3221", None, hwmon / f"in{channel}_input",
                              hwmon / f"curr{channel}_input"))
    for device in sorted(root.glob("sys/bus/i2c/drivers/ina3221x/*/iio:device*")):
        for label in sorted(device.glob("rail_name_*")):
            name = label.read_text().strip()
            channel = label.name.rpartition("_")[2]
            if not channel.isdigit() or name in seen:
                continue
            seen.add(name)
            power = device / f"in_power{channel}_input"
            rails.append(Rail(name, "ina3221x", power if power.exists() else None,
                              device / f"in_voltage{channel}_input",
                              device / f"in_current{channel}_input"))
    return rails


def module_power_w(rails_w: dict[str, float]) -> tuple[float | None, str]:
    """The whole module's power and how it was formed (the input rail, or a sum of rails)."""
    for name in INPUT_RAILS:
        if name in rails_w:
            return rails_w[name], name
    parts = {k: v for k, v in rails_w.items() if k not in CONTAINED_RAILS}
    if not parts:
        return None, "none"
    return sum(parts.values()), "+".join(parts)


def _gpu_freq_path(root: Path) -> Path | None:
    for pattern in _GPU_FREQ_GLOBS:
        for path in sorted(root.glob(pattern)):
            if _GPU_NODE.search(path.parent.name) or _GPU_NODE.search(path.parent.parent.name):
                return path
    return None


def _first(root: Path, candidates: tuple[str, ...]) -> Path | None:
    return next((root / c for c in candidates if (root / c).is_file()), None)


class JetsonSource(Source):
    """A Jetson board read from sysfs (NVML does not exist on Jetson)."""

    name = "jetson"

    def __init__(self, root: Path = Path("/")) -> None:
        super().__init__()
        self.root = root
        self.board = read_jetson(root)
        if self.board is None:
            raise SourceUnavailable("jetson: not a Jetson board (no /etc/nv_tegra_release)")
        self.rails = find_rails(root)
        if not self.rails:
            self.notes.append(
                "jetson: no INA3221 rails under /sys/bus/i2c/drivers/ina3221{,x} (Nano 2GB and "
                "some carrier boards have none): power and energy are not measured")
        self.gpu_freq = _gpu_freq_path(root)
        self.gpu_load = _first(root, _GPU_LOAD_PATHS)
        self.emc_rate = _first(root, _EMC_RATE_PATHS)
        self.emc_activity = _first(root, _EMC_ACTIVITY_PATHS)
        self.dla_rates: dict[int, Path] = {}
        for pattern in _DLA_RATE_GLOBS:
            for path in sorted(root.glob(pattern)):
                index = int(re.search(r"dla(\d)", path.parent.name).group(1))  # type: ignore[union-attr]
                self.dla_rates.setdefault(index, path)
        if self.emc_rate is None or not self.dla_rates:
            self.notes.append(
                "jetson: EMC and DLA clocks live in debugfs (/sys/kernel/debug), readable by "
                "root only: run as root to record them")
        self.zones: dict[str, Path] = {}
        for zone in sorted(root.glob("sys/class/thermal/thermal_zone*")):
            try:
                kind = (zone / "type").read_text().strip()
            except OSError:
                continue
            self.zones.setdefault(kind, zone / "temp")
        self.power_mode = dict(self.board.get("power_mode") or {})

    @property
    def devices(self) -> list[str]:
        """`board` (rails, EMC, temperatures), `cuda:0` (the integrated GPU), `dla:N`."""
        return ["board", "cuda:0", *[f"dla:{i}" for i in sorted(self.dla_rates)]]

    def describe(self) -> dict[str, Any]:
        """Board model, power mode, rails and which files answer."""
        data = super().describe()
        data.update({
            "model": self.board["model"] if self.board else "",
            "l4t": self.board.get("l4t", "") if self.board else "",
            "power_mode": self.power_mode,
            "rails": [{"name": r.name, "driver": r.driver} for r in self.rails],
            "gpu_freq": str(self.gpu_freq.relative_to(self.root)) if self.gpu_freq else None,
            "gpu_load": str(self.gpu_load.relative_to(self.root)) if self.gpu_load else None,
            "energy": "rails-integrated" if self.rails else "none",
        })
        return data

    def _temp(self, *prefixes: str) -> float | None:
        for kind, path in self.zones.items():
            if kind.lower().startswith(prefixes):
                value = _read_int(path)
                if value is not None:
                    return value / 1000.0
        return None

    def read(self) -> list[Reading]:
        """Board, GPU and DLA readings."""
        rails_w = {r.name: w for r in self.rails if (w := r.read_w()) is not None}
        total_w, _ = module_power_w(rails_w)
        board = Reading(source=self.name, device="board", power_w=total_w, rails_w=rails_w,
                        temp_c=self._temp("tj", "thermal-fan-est", "soc"))
        emc_hz = _read_int(self.emc_rate) if self.emc_rate else None
        if emc_hz:
            board.extra["emc_clock_mhz"] = emc_hz / 1e6
            activity = _read_int(self.emc_activity) if self.emc_activity else None
            if activity is not None:
                board.extra["emc_load_pct"] = activity / (emc_hz / 1000.0)
        if self.power_mode.get("id") is not None:
            board.extra["nvpmodel_id"] = float(self.power_mode["id"])
        gpu = Reading(source=self.name, device="cuda:0", temp_c=self._temp("gpu"))
        gpu_rail = next((n for n in GPU_RAILS if n in rails_w), None)
        if gpu_rail is not None:
            gpu.power_w = rails_w[gpu_rail]
        if self.gpu_freq is not None and (hz := _read_int(self.gpu_freq)) is not None:
            gpu.clock_mhz = hz / 1e6
        if self.gpu_load is not None and (load := _read_int(self.gpu_load)) is not None:
            gpu.util_pct = load / 10.0
        readings = [board, gpu]
        for index, path in sorted(self.dla_rates.items()):
            hz = _read_int(path)
            readings.append(Reading(source=self.name, device=f"dla:{index}",
                                    clock_mhz=hz / 1e6 if hz is not None else None))
        return readings
