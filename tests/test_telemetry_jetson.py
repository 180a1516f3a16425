"""Jetson sysfs parsing on the trees under tests/fixtures/jetson_* (assembled, not captured)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infermux.telemetry import SourceUnavailable, summarize
from infermux.telemetry.base import Tick
from infermux.telemetry.jetson import JetsonSource, find_rails, module_power_w

FIXTURES = Path(__file__).parent / "fixtures"

# board → (rails in order, module power W and how it is formed, GPU clock MHz, GPU util %,
#          GPU rail, EMC clock MHz, EMC load %, DLA clocks MHz, power mode)
BOARDS = {
    "jetson_agx_orin_jp5": dict(
        rails=["VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"],
        module=(19936 * 1105 + 19952 * 306 + 4968 * 1031) / 1e6,
        formed="VDD_GPU_SOC+VDD_CPU_CV+VIN_SYS_5V0",
        gpu_mhz=1300.5, gpu_util=98.7, gpu_rail_w=19936 * 1105 / 1e6,
        emc_mhz=3199.0, emc_load=41.0, dla={0: 1600.0, 1: 1600.0},
        mode={"id": 0, "name": "MAXN"}, gpu_temp=46.875),
    "jetson_orin_nano_jp6": dict(
        rails=["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"],
        module=5048 * 1344 / 1e6, formed="VDD_IN",
        gpu_mhz=408.0, gpu_util=51.2, gpu_rail_w=5032 * 420 / 1e6,
        emc_mhz=None, emc_load=None, dla={},
        mode={"id": 1, "name": "7W"}, gpu_temp=50.25),
    "jetson_agx_xavier_jp4": dict(
        rails=["GPU", "CPU", "SOC", "CV", "VDDRQ", "SYS5V"],
        module=(9318 + 1087 + 2492 + 155 + 1553 + 2231) / 1000,
        formed="GPU+CPU+SOC+CV+VDDRQ+SYS5V",
        gpu_mhz=1377.0, gpu_util=99.5, gpu_rail_w=9.318,
        emc_mhz=2133.0, emc_load=28.0, dla={0: 1395.2, 1: 1395.2},
        mode={"id": 3, "name": "MODE_30W_ALL"}, gpu_temp=40.5),
    "jetson_nano_jp4": dict(
        rails=["POM_5V_IN", "POM_5V_GPU", "POM_5V_CPU"],
        module=4.732, formed="POM_5V_IN",
        gpu_mhz=921.6, gpu_util=99.8, gpu_rail_w=1.56,
        emc_mhz=None, emc_load=None, dla={},
        mode={"id": 0, "name": "MAXN"}, gpu_temp=37.0),
}


@pytest.mark.parametrize("board", sorted(BOARDS))
def test_rails_and_module_power(board):
    want = BOARDS[board]
    rails = find_rails(FIXTURES / board)
    assert [r.name for r in rails] == want["rails"]
    rails_w = {r.name: r.read_w() for r in rails}
    total, formed = module_power_w(rails_w)
    assert total == pytest.approx(want["module"])
    assert formed == want["formed"]


@pytest.mark.parametrize("board", sorted(BOARDS))
def test_source_reads_board_gpu_dla(board):
    want = BOARDS[board]
    source = JetsonSource(FIXTURES / board)
    readings = {r.device: r for r in source.read()}
    assert source.power_mode == want["mode"]
    assert readings["board"].power_w == pytest.approx(want["module"])
    gpu = readings["cuda:0"]
    assert gpu.clock_mhz == pytest.approx(want["gpu_mhz"])
    assert gpu.util_pct == pytest.approx(want["gpu_util"])
    assert gpu.power_w == pytest.approx(want["gpu_rail_w"])
    assert gpu.temp_c == pytest.approx(want["gpu_temp"])
    board_extra = readings["board"].extra
    if want["emc_mhz"] is None:
        assert "emc_clock_mhz" not in board_extra
        assert any("debugfs" in n for n in source.notes)
    else:
        assert board_extra["emc_clock_mhz"] == pytest.approx(want["emc_mhz"])
        assert board_extra["emc_load_pct"] == pytest.approx(want["emc_load"])
    dla = {int(d.split(":")[1]): r.clock_mhz for d, r in readings.items() if d.startswith("dla:")}
    assert dla == pytest.approx(want["dla"])
    described = source.describe()
    assert described["energy"] == "rails-integrated"
    assert described["power_mode"] == want["mode"]


def test_a_window_of_jetson_readings_integrates_the_module_rail():
    source = JetsonSource(FIXTURES / "jetson_orin_nano_jp6")
    ticks = [Tick(i, i * 100_000_000, source.read()) for i in range(11)]  # 1 s at 10 Hz
    summary = summarize(ticks, 0, 1_000_000_000, ["cuda:0/fp16"])
    assert summary.energy_devices == ["board"]
    assert summary.energy_j == pytest.approx(5048 * 1344 / 1e6)  # constant power × 1 s
    assert summary.energy_source == "jetson-power-integrated(board)"


def test_not_a_jetson(tmp_path):
    with pytest.raises(SourceUnavailable, match="not a Jetson"):
        JetsonSource(tmp_path)


def test_a_board_without_rails_says_so(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text("# R32 (release), REVISION: 7.4, GCID: 1\n")
    source = JetsonSource(tmp_path)
    assert any("no INA3221 rails" in n for n in source.notes)
    readings = {r.device: r for r in source.read()}
    assert readings["board"].power_w is None
