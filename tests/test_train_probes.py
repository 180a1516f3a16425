"""Probes at the validated configuration's own batch: drift beside its epochs, power at its cell.

A validated epoch's drift is measured on what it was predicted from at its batch (its batch's
compute probe, else a profile of its batch), the run's reference configuration only where it
has neither; a compute probe's power sets the energy of its batch cell's configurations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from infermux.cli import main
from infermux.models import ModelSpec
from infermux.store import Store
from infermux.train import DataSpec, Grid, TrainConfig
from infermux.train.components import PROBE_POWER_MIN_S, fit_components
from infermux.train.predict import predict_all
from infermux.train.profile import measure_compute, measure_configs, prepare
from infermux.train.reference import read_speed, speed_drift
from infermux.train.run import PredictReport, drift_basis, repredict, short_epoch_line
from infermux.train.steady import epoch_body

from .conftest import ROOT
from .test_train_scoring import ITEMS, _passes, _probe

FACTORY = f"{ROOT / 'bench' / 'train_models.py'}:small_cnn"


def _predict_args(tmp_path: Path, *extra: str) -> list[str]:
    """256 items at batch 8 and 64 without workers: batch 64 (four minibatches an epoch) has
    no profile within half an epoch, so its compute is probed; every held-out configuration
    is validated."""
    return ["train-predict", "-m", FACTORY, "--input-shape", "3x16x16", "--images", "256",
            "--image-size", "16", "--disk-dir", str(tmp_path / "disk"), "--telemetry", "off",
            "--batch", "8,64", "--workers", "0", "--profile-steps", "12", "--profile-share",
            "0.5", "--whole-epochs-below", "0", "--settle", "0", "--validate", "all",
            "--json", *extra]


def test_a_validated_configuration_is_probed_for_drift_at_its_own_batch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Batch 64 is validated beside compute probes of batch 64 (kind `drift:N`, the same
    minibatches as its profile-time probe), not the batch-8 reference; the probes are counted
    in the budget as the compute probes are, the epochs name the probe that measured their
    drift, and a stored run read again gives each epoch the same drift."""
    db = tmp_path / "r.db"
    main(_predict_args(tmp_path, "--db", str(db)))
    report = json.loads(capsys.readouterr().out)
    probe = next(p for p in report["profile_passes"] if p["kind"] == "compute")
    drift = report["drift_passes"]
    assert sorted(p["kind"] for p in drift) == ["drift:0", "drift:1"]
    assert all(p["knobs"]["batch"] == 64 and p["steps"] == probe["steps"] for p in drift)
    assert {p["drift_round"] for p in drift} == {"before", "after"}
    (row,) = report["drift"]["by_config"]
    assert row["basis"] == "compute" and row["probe"] == "compute probe b64 fp32"
    assert report["drift"]["bases"] == {"compute": 1}
    validated = [r for r in report["predictions"] if r["measured_s"] is not None]
    assert len(validated) == 2  # its first and later epoch
    for r in validated:
        assert r["drift_probe"] == "compute probe b64 fp32" and r["drift"] > 0
    budget = report["budget"]
    assert budget["drift_probe_minibatches"] == 2 * probe["steps"]
    assert budget["drift_probe_epochs"] == pytest.approx(
        sum(r["share"] for r in budget["drift_probes"]))
    assert budget["total_epochs_with_drift_probes"] == pytest.approx(
        budget["total_epochs"] + budget["drift_probe_epochs"])
    assert "not in it" in budget["drift_probes_counted"]
    # The machine's own speed: read after the profiles, then after the validated configuration.
    machine = report["machine_speed"]
    assert [r["when"] for r in machine["readings"]] == ["the profiles", validated[0]["label"]]
    for reading in machine["readings"]:
        assert reading["python_loop"]["s"] > 0
        assert "device_matmul" not in reading  # a CPU run
    loop = machine["drift"]["by_reference"]["python_loop"]
    assert loop["range"][0] <= 1.0 <= loop["range"][1] and loop["noise"] >= 0
    with Store(db) as store:
        again = repredict(store, report["run_id"], method="simple")
    (stored,) = again["drift"]["per_config"]
    assert stored["probe"] == "compute probe b64 fp32"
    assert stored["drift"] == pytest.approx(validated[0]["drift"], rel=1e-9)


def test_the_reference_is_probed_only_where_the_batch_has_no_figure_of_its_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without compute probes batch 64 has no figure of its own: the batch-8 reference is
    re-profiled beside it (kind `probe:N`), and the epochs say so."""
    main(_predict_args(tmp_path, "--no-store", "--no-compute-probes"))
    report = json.loads(capsys.readouterr().out)
    assert {p["kind"] for p in report["drift_passes"]} == {"probe:0", "probe:1"}
    assert all(p["knobs"]["batch"] == 8 for p in report["drift_passes"])
    (row,) = report["drift"]["by_config"]
    assert row["basis"] == "reference" and row["probe"].startswith("reference b8")


def test_drift_basis_prefers_the_validated_batch_s_own_figure(tmp_path: Path) -> None:
    """Real passes of a tiny CNN: a compute probe of batch 64, profiles of batch 8 (the
    reference, no workers) and of batch 16 (one worker). Each configuration's drift is
    measured on its batch's probe, else on a profile of its batch (the nearest in workers),
    and on the reference only for batch 32, which has neither."""
    config = TrainConfig(ModelSpec(FACTORY, input_shape=(3, 16, 16)),
                         Grid(batch=[8, 16, 32, 64], workers=[0, 1], storage=["disk"]),
                         data=DataSpec(count=256, size=16, classes=4),
                         disk_dir=str(tmp_path / "disk"), telemetry_interval_s=None,
                         profile_steps=12, profile_share=0.3, settle_s=0.0)
    configs = config.grid.configs()
    index = {(k.batch, k.workers): i for i, k in enumerate(configs)}
    setup = prepare(config)
    try:
        profiled = [index[(8, 0)], index[(16, 1)]]
        passes, _ = measure_configs(setup, [configs[i] for i in profiled], indices=profiled)
        passes.append(measure_compute(setup, configs[index[(64, 0)]], index[(64, 0)], 2))
    finally:
        setup.close()
    report = PredictReport(None, {}, configs, profiled, [], {}, passes, [], 256)
    ref = index[(8, 0)]

    def basis(batch: int, workers: int) -> tuple[str, str]:
        got = drift_basis(report, index[(batch, workers)], ref)
        assert got is not None
        return got["kind"], got["label"]

    assert basis(64, 1) == ("compute", "compute probe b64 fp32")
    assert basis(16, 0) == ("profile", f"profile of {configs[index[(16, 1)]].label} "
                                       "(its batch)")
    assert basis(8, 1) == ("profile", f"profile of {configs[ref].label} (its batch)")
    assert basis(32, 0)[0] == "reference"
    assert drift_basis(report, index[(32, 1)], None) is None


def test_a_compute_probe_s_power_sets_its_batch_cell_s_energy() -> None:
    """Profiles at batch 8 only, their energy a static 60 W and a dynamic energy per
    minibatch: batch 128's energy is the line's, extrapolated. A compute probe of batch 128
    that read 180 W over half a second sets its cell's dynamic energy, (P − P0) × its compute
    per minibatch, and the configurations of that cell say their power came from it; one read
    over too short a window is not used."""
    configs = Grid(batch=[8, 128], workers=[0, 2], storage=["tmpfs"]).configs()
    index = {(k.workers, k.batch): i for i, k in enumerate(configs)}
    profiled = [index[(0, 8)], index[(2, 8)]]
    passes = _passes(configs, profiled)
    for p in passes:
        p["energy_source"] = "nvml"
    compute_s = 0.03
    probe = _probe(configs[index[(0, 128)]], compute_s) | {"power_w": 180.0, "power_s": 0.5}
    kw = {"items": ITEMS, "all_cores": 2, "tmpfs": {"tmpfs": True}, "method": "simple"}
    _, without = predict_all(configs, passes, **kw, probes=[_probe(configs[index[(0, 128)]],
                                                                   compute_s)])
    big = [configs[index[(w, 128)]].label for w in (0, 2)]
    assert all("extrapolated to batch 128" in without["power_sources"][label]
               for label in big)
    predictions, info = predict_all(configs, passes, **kw, probes=[probe])
    comps = fit_components(passes, 2, [probe])
    assert comps.energy is not None
    static = comps.energy["static_w"]
    assert static == pytest.approx(60.0, rel=1e-3)
    power, c = comps.probe_power[(2, "fp32", 128)]
    assert power == 180.0 and c == pytest.approx(compute_s, rel=0.01)
    for w in (0, 2):
        pred = predictions[index[(w, 128)]]
        assert pred.power_source is not None
        assert pred.power_source.startswith("compute probe at b128 fp32 (180 W)")
        assert info["power_sources"][pred.knobs.label] == pred.power_source
        for fig in pred.epochs.values():
            t = fig["predicted_s"]
            assert t is not None
            steps = epoch_body(ITEMS, 128, 0)
            assert fig["predicted_energy_j"] == pytest.approx(
                static * t + steps * (power - static) * c, rel=1e-9)
    # Batch 8 keeps the line fitted at its own batch.
    assert "extrapolated" not in info["power_sources"][configs[index[(2, 8)]].label]
    short = probe | {"power_s": PROBE_POWER_MIN_S / 2}
    _, info = predict_all(configs, passes, **kw, probes=[short])
    assert "extrapolated to batch 128" in info["power_sources"][big[0]]


def test_a_real_compute_probe_s_power_feeds_its_cell_without_a_counter(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With no power counter (telemetry off) a compute probe's power is the stated CPU model's,
    as the profiles' is: batch 64's epochs take it, and say so."""
    main(_predict_args(tmp_path, "--no-store", "--validate", "0"))
    report = json.loads(capsys.readouterr().out)
    probe = next(p for p in report["profile_passes"] if p["kind"] == "compute")
    assert probe["energy_source"].startswith("modelled") and probe["power_w"] > 0
    rows = [r for r in report["predictions"] if r["knobs"]["batch"] == 64]
    assert rows
    for r in rows:
        assert r["power_source"].startswith("compute probe at b64 fp32")
        assert r["predicted_energy_j"] == pytest.approx(probe["power_w"] * r["predicted_s"],
                                                        rel=1e-9)


def test_short_epochs_are_said_once_which_rule_could_not_hold_and_why() -> None:
    """6,000 items: an epoch is 47 minibatches at batch 128, 188 at 32; the thinnest profile
    (a ramp minibatch per worker and 3 steady a half) needs 8 with 2 workers, 14 with 8, where
    the rule leaves 2 and 11: six of the eight configurations, said in one line."""
    configs = Grid(batch=[32, 128], workers=[2, 8], precision=["fp32", "amp"]).configs("cuda:0")
    line = short_epoch_line(configs, 6000, 0.1)
    assert line is not None and "\n" not in line
    assert line.startswith("the profile rule (≤ 10% of an epoch) cannot hold for 6 of 8 "
                           "configurations")
    assert "47–188 minibatches an epoch at batch 32,128" in line
    assert "needs 8–14 where the rule leaves 2–11" in line
    assert short_epoch_line(configs, 200_000, 0.1) is None


class _SlowItems:
    """Items that take `delay_s` each to load (a probe's first batch, decoded in the process)."""

    def __init__(self, count: int, delay_s: float) -> None:
        self.count, self.delay_s = count, delay_s

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[object, int]:
        import time

        import torch

        time.sleep(self.delay_s)
        return torch.zeros(3, 4, 4), index


def _probe_steps(max_steps_time: float | None, times: int = 3) -> tuple[int, float, float]:
    """A probe's minibatches, wall time and mean repeat: a first batch loading 0.2 s, then
    10 ms a minibatch."""
    import time

    import torch

    from infermux.train.profile import _Repeated

    loader = torch.utils.data.DataLoader(_SlowItems(4, 0.05), batch_size=4)
    began = time.perf_counter()
    stamps = []
    for _ in _Repeated(loader, times, min_s=30.0, max_times=60,
                       max_steps_time=max_steps_time):
        time.sleep(0.01)
        stamps.append(time.perf_counter())
    repeat = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return len(stamps), stamps[-1] - began, repeat


def test_a_probe_s_power_read_stops_at_its_share_of_the_rule_counted_in_time() -> None:
    """A power read would run the probe to its count (60 minibatches, 30 s not reached); held
    to 30 of its own minibatches in time, the first batch's 0.2 s of loading counts (about 20
    of them at 10 ms), so it stops after about ten, at 30 minibatches' time, where a count of
    30 would have run half as long again. The first `times` minibatches run whatever the
    share."""
    unbounded, _, _ = _probe_steps(None)
    assert unbounded == 60
    steps, wall, repeat = _probe_steps(30.0)
    assert 4 <= steps < 25
    assert wall <= 30 * repeat * 1.15 + 0.02
    assert _probe_steps(1.0, times=3)[0] == 3


def test_the_machine_s_drift_is_each_reading_over_the_first_with_its_spread() -> None:
    """`speed_drift`: per reference, the range of each reading's time over the first's, the
    largest spread among its repeats, and whether every ratio stayed within ±10%."""
    def reading(loop_s: float, product_s: float, spread: float = 0.01) -> dict[str, Any]:
        return {"when": "x", "python_loop": {"s": loop_s, "spread": spread},
                "device_matmul": {"s": product_s, "spread": 0.002}}

    assert speed_drift([reading(0.05, 0.004)]) is None  # one reading: nothing to compare
    held = speed_drift([reading(0.05, 0.004), reading(0.052, 0.0038, 0.03),
                        reading(0.049, 0.0041)])
    assert held is not None and held["within_10pct"] and held["readings"] == 3
    loop = held["by_reference"]["python_loop"]
    assert loop["range"] == pytest.approx([0.98, 1.04]) and loop["noise"] == 0.03
    assert held["by_reference"]["device_matmul"]["range"] == pytest.approx([0.95, 1.025])
    moved = speed_drift([reading(0.05, 0.004), reading(0.05, 0.0046)])
    assert moved is not None and not moved["within_10pct"]  # the device 1.15x slower


def test_a_reading_of_the_reference_work_times_each_part_on_this_machine() -> None:
    got = read_speed("cpu", "the profiles")
    assert got["when"] == "the profiles" and set(got) == {"when", "python_loop"}  # no GPU
    assert got["python_loop"]["s"] > 0 and got["python_loop"]["spread"] >= 0


def test_a_gpu_reading_times_the_device_s_fixed_product() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    got = read_speed("cuda:0", "the profiles")
    assert got["device_matmul"]["s"] > 0 and got["python_loop"]["s"] > 0
