"""How honestly the training predictor is scored: leave-one-out, the validated subset, drift,
and predictions outside the profiled cells."""

from __future__ import annotations

import json
import math
import random
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from infermux.cli import main
from infermux.errors import UsageError
from infermux.train import Grid, Knobs
from infermux.train.attribution import epoch_parts
from infermux.train.components import fit_components
from infermux.train.covering import choose_profiled, model_cell
from infermux.train.drift import applied_drift, compute_drift_scale, drift_of, epoch_drift
from infermux.train.learned import held_out_rows, training_rows
from infermux.train.predict import Prediction, predict_all
from infermux.train.run import (
    THIN_STEADY_STEPS,
    PredictReport,
    _profile_plan,
    _stored_drift,
    validation_order,
)

from .conftest import ROOT
from .test_train import _synthetic_pass

FACTORY = f"{ROOT / 'bench' / 'train_models.py'}:small_cnn"
ITEMS = 4096


def _passes(configs: list[Knobs], indices: list[int], slow: dict[int, float] | None = None
            ) -> list[dict]:
    return [_synthetic_pass(i, configs[i], p, ITEMS, 12, slow=(slow or {}).get(i, 1.0))
            for i in indices for p in ("cold", "warm")]


def test_a_held_out_configuration_reaches_no_row_it_is_scored_against() -> None:
    """The learned correction's rows with a configuration held out are rebuilt without it.

    Its passes changed (three times as slow) leave the rows it is scored against unchanged;
    the rows as they were before (each configuration's target from the others' components,
    the held-out one's among them) change: that was the leak.
    """
    configs = Grid(batch=[8, 32, 128], workers=[0, 1, 4], storage=["tmpfs"]).configs()
    profiled = choose_profiled(configs, 6)
    held = profiled[2]
    tmpfs = {"tmpfs": True}
    clean, slowed = _passes(configs, profiled), _passes(configs, profiled, {held: 3.0})
    a = held_out_rows(clean, 2, tmpfs)(held)
    b = held_out_rows(slowed, 2, tmpfs)(held)
    assert held not in set(a[3]) and np.allclose(a[0], b[0]) and np.allclose(a[1], b[1])
    leaky_a, leaky_b = training_rows(clean, 2, tmpfs), training_rows(slowed, 2, tmpfs)
    others = leaky_a[3] != held
    assert not np.allclose(leaky_a[1][others], leaky_b[1][others])


def test_the_transfer_error_is_scored_on_configurations_left_out() -> None:
    """A transferred correction's line is fitted on the new network's profiles: scored on the
    same rows it flatters itself; each configuration scored by a line fitted without it, not."""
    pytest.importorskip("sklearn")
    configs = Grid(batch=[8, 32, 128], workers=[0, 1, 4], storage=["disk", "tmpfs"],
                   persistent_workers=[False, True]).configs()
    reference = _passes(configs, choose_profiled(configs, 6),
                        {i: 0.7 for i, k in enumerate(configs) if k.persistent_workers})
    for p in reference:
        p["config"] += 10_000
    profiled = choose_profiled(configs, 6)
    rng = random.Random(3)
    noisy = _passes(configs, profiled, {i: rng.uniform(0.7, 1.4) for i in profiled})
    _, info = predict_all(configs, noisy, items=ITEMS, all_cores=2,
                          tmpfs={"disk": False, "tmpfs": True}, method="auto",
                          reference=reference)
    transfer = info["transfer"]
    assert transfer["error_kind"] == "leave-one-configuration-out"
    assert transfer["error_pct"] > 1.2 * transfer["in_sample_error_pct"]
    assert info["loo"] == "leave-one-configuration-out"


def test_validation_is_drawn_at_random_per_cell_without_the_predictions() -> None:
    configs = Grid(batch=[16, 64], workers=[0, 1, 2], storage=["tmpfs", "disk"]).configs()
    profiled = [0, 5]
    order = validation_order(configs, profiled, seed=7)
    assert sorted(order) == [i for i in range(len(configs)) if i not in profiled]
    assert order == validation_order(configs, profiled, seed=7)
    assert order != validation_order(configs, profiled, seed=8)
    cells = {model_cell(configs[i]) for i in order}
    # The first round takes one configuration of every cell: any prefix is spread over them.
    assert {model_cell(configs[i]) for i in order[:len(cells)]} == cells


def test_a_cell_no_profile_reached_is_extrapolated_with_a_wider_bound() -> None:
    configs = Grid(batch=[8, 32, 128], workers=[0, 1, 4], storage=["tmpfs"]).configs()
    index = {(k.workers, k.batch): i for i, k in enumerate(configs)}
    # Without workers only batch 8 is profiled: batch 32 and 128 there are outside every
    # profiled cell; with workers 8 and 128 are, so 32 between them is interpolated.
    profiled = [index[(0, 8)], index[(1, 8)], index[(4, 128)]]
    predictions, info = predict_all(configs, _passes(configs, profiled), items=ITEMS,
                                    all_cores=2, tmpfs={"tmpfs": True}, method="simple")
    outside = {configs[i].label for i in (index[(0, 32)], index[(0, 128)])}
    assert set(info["extrapolation"]["configurations"]) == outside
    assert info["extrapolation"]["source"].startswith("leave-one-cell-out")

    def width(p: Prediction) -> float:
        e = p.epochs["later"]
        return (e["high_s"] or 0.0) / (e["low_s"] or 1.0)

    by = {p.knobs.label: p for p in predictions}
    inside = by[configs[index[(1, 32)]].label]
    assert not inside.extrapolated and all(by[label].extrapolated for label in outside)
    assert all(width(by[label]) > width(inside) for label in outside)
    assert all(r["extrapolated"] for label in outside for r in by[label].rows())


def test_thin_profiles_where_the_rule_cannot_reach_every_cell() -> None:
    """Batch 128 on 24,000 items: 188 minibatches an epoch, too few for a ramp and 8 steady
    minibatches a half within 10%; thin profiles (3 a half, the rule's cost spread over one
    configuration per cell) reach its cells."""
    configs = Grid(batch=[32, 128], workers=[2, 8], precision=["fp32", "amp"]).configs("cuda:0")
    mode, pool, count, each, notes = _profile_plan(configs, 24000, 0.1, 3)
    assert mode == "thin" and count == 4 and each == pytest.approx(0.1 * 3 / 4)
    assert {model_cell(configs[i]) for i in pool} == {model_cell(k) for k in configs}
    assert any("thin profiles" in n for n in notes) and THIN_STEADY_STEPS == 3
    # With data enough for every cell within the rule, the rule's plan.
    mode, _, count, each, _ = _profile_plan(configs, 200_000, 0.1, 4)
    assert (mode, count, each) == ("rule", 4, 0.1)


def test_drift_probes_correct_each_validated_epoch() -> None:
    """The reference re-profiled before the first validated configuration and after each:
    the machine slowed by half after the first; each epoch takes the probes around it."""
    configs = Grid(batch=[8, 32], workers=[0, 1], storage=["tmpfs"]).configs()
    profile = _passes(configs, [0])
    probes = []
    for n, slow in enumerate((1.0, 1.5, 1.5)):
        for p in _passes(configs, [0], {0: slow}):
            probes.append(p | {"kind": f"probe:{n}"})
    epochs = [_synthetic_pass(i, configs[i], p, ITEMS, 20, epoch=True)
              for i in (2, 3) for p in ("cold", "warm")]
    drift = _stored_drift(profile + probes + epochs, profile, epochs)
    assert drift is not None and drift["probes"] == pytest.approx([1.0, 1.5, 1.5])
    assert drift["by_config"][2]["drift"] == pytest.approx(math.sqrt(1.5))
    assert drift["by_config"][3]["drift"] == pytest.approx(1.5)
    # Minibatches all alike: no noise, every move resolved and corrected for.
    assert drift["by_config"][2]["drift_resolved"] and drift["by_config"][3]["drift_resolved"]
    assert drift["applied_range"] == pytest.approx([math.sqrt(1.5), 1.5])
    # Scored: a prediction that was right for the machine as profiled is 0% off corrected.
    preds = []
    for i, ratio in ((2, math.sqrt(1.5)), (3, 1.5)):
        pred = Prediction(i, configs[i], False, "simple",
                          {e: {"predicted_s": 10.0, "low_s": 9.0, "high_s": 11.0,
                               "predicted_energy_j": None}
                           for e in ("first", "later")})
        pred.measured = {e: {"s": 10.0 * ratio, "energy_j": None, "drift": ratio}
                         for e in ("first", "later")}
        preds.append(pred)
    report = PredictReport(None, {}, configs, [0], [Prediction(0, configs[0], True, "profile",
                                                              {}), *preds], {}, [], [], ITEMS,
                           held_out=3)
    scores = report.scores()
    assert scores["later_time_mape_pct"] > 20
    assert scores["later_time_mape_drift_corrected_pct"] == pytest.approx(0.0, abs=1e-9)
    assert scores["configurations"] == 2 and scores["held_out"] == 3
    preds[0].extrapolated = True  # scored apart as well as in the whole
    scores = report.scores()
    assert scores["later_time_mape_in_cells_pct"] == pytest.approx(100 / 3)  # 10 s for 15 s
    assert scores["extrapolated"] == 1


def test_short_epochs_are_measured_whole_and_the_verdict_says_the_rule_did_not_hold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """96 items of batch 8 and 16: no profile of a ramp and 3 steady minibatches a half fits
    in 10% of such an epoch; the epochs cost well under a second, so one configuration is
    profiled (outside the rule) and the other cell's epochs are measured whole."""
    db = tmp_path / "r.db"
    main(["train-predict", "-m", FACTORY, "--input-shape", "3x16x16", "--images", "96",
          "--image-size", "16", "--disk-dir", str(tmp_path / "disk"), "--db", str(db),
          "--telemetry", "off", "--batch", "8,16", "--workers", "0", "--profile-steps", "6",
          # Well above such an epoch even on a loaded machine (its profile's start-up, slowed
          # there, once predicted it over the default 10 s).
          "--whole-epochs-below", "2m", "--validate", "0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["profile_mode"].endswith("+whole")
    kinds = {p["kind"] for p in report["profile_passes"]}
    assert "whole" in kinds
    assert report["budget"]["ok"] is False
    assert report["model_info"]["within_rule"] is False
    assert "beyond the rule" in report["model_info"]["verdict"]
    assert not report["model_info"]["extrapolation"]["configurations"]
    with sqlite3.connect(db) as con:
        stored = con.execute("SELECT COUNT(*) FROM train_passes WHERE kind = 'whole'").fetchone()
    assert stored[0] == 2  # its first and later epoch


def _epoch(configs: list[Knobs], i: int, slow: float = 1.0, startup_s: float = 0.0) -> dict:
    """A whole epoch of configuration `i` following the known relation, `slow` × its steady
    minibatches, `startup_s` more start-up."""
    data = _synthetic_pass(i, configs[i], "warm", ITEMS, math.ceil(ITEMS / configs[i].batch),
                           epoch=True, slow=slow)
    extra = int(startup_s * 1e9)
    return data | {"startup_ns": data["startup_ns"] + extra, "wall_ns": data["wall_ns"] + extra}


def test_a_missed_epoch_names_the_term_of_the_model_that_missed() -> None:
    """The error of a validated epoch is cut into the model's terms, which add up to it: a
    slower start names start-up, slower minibatches without workers the compute or loader,
    with workers bound by the cores contention, and a machine that slowed as a whole drift."""
    configs = Grid(batch=[8, 32, 128], workers=[0, 1, 4], storage=["tmpfs"]).configs()
    profiled = choose_profiled(configs, 6)
    comps = fit_components(_passes(configs, profiled), 2)
    serial = configs.index(Knobs(32, 0, 2, False, False, "tmpfs", None, "fp32"))
    shared = next(i for i, k in enumerate(configs) if k.batch == 128 and k.workers == 4)

    def parts(i: int, predicted_s: float | None = None, drift: float | None = None,
              **kw: float) -> dict:
        exact = epoch_parts(comps, _epoch(configs, i), 1.0, ITEMS)
        assert exact is not None
        got = epoch_parts(comps, _epoch(configs, i, **kw),
                          predicted_s or exact["simple_predicted_s"], ITEMS, drift)
        assert got is not None
        # The parts add up to the error, whatever the epoch.
        assert sum(got["parts_s"].values()) == pytest.approx(
            got["measured_s"] - got["predicted_s"], abs=1e-4)
        return got

    on_time = parts(serial)
    assert abs(on_time["error_pct"]) < 2 and on_time["model_bottleneck"] is None
    late_start = parts(serial, startup_s=2.0)
    assert late_start["term"] == "start-up"
    assert late_start["parts_s"]["start-up"] == pytest.approx(2.0, abs=0.1)
    slow = parts(serial, slow=1.5)
    assert slow["term"] in ("compute", "loader") and slow["parts_s"][slow["term"]] > 0
    assert "contention" not in slow["parts_s"]
    contended = parts(shared, slow=1.5)
    assert contended["model_bottleneck"] == "cores" and contended["term"] == "contention"
    # The reference configuration ran 1.5× as long beside it: the machine, not the model.
    predicted = parts(serial)["simple_predicted_s"]
    drifted = parts(serial, predicted_s=predicted, drift=1.5, slow=1.5)
    assert drifted["term"] == "drift"
    assert abs(drifted["parts_s"]["drift"]) > 5 * max(
        abs(v) for k, v in drifted["parts_s"].items() if k not in ("drift", "start-up"))


def test_train_predict_json_says_which_term_missed(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A validated run's JSON holds every validated epoch's error by term (adding up to it)
    and, per epoch kind, the MAPE, each term's share of it and the term named."""
    main(["train-predict", "-m", FACTORY, "--input-shape", "3x16x16", "--images", "256",
          "--image-size", "16", "--disk-dir", str(tmp_path / "disk"), "--no-store",
          "--telemetry", "off", "--batch", "8,32", "--workers", "0", "--profile-steps", "12",
          "--profile-share", "0.5", "--validate", "1", "--whole-epochs-below", "0s", "--json"])
    # Whole epochs off: this grid's epochs are so short that both configurations would be
    # measured whole, leaving none held out to validate.
    report = json.loads(capsys.readouterr().out)
    att = report["attribution"]
    assert len(att["epochs"]) == 2  # one configuration validated: its first and later epoch
    for row in att["epochs"]:
        assert set(row["parts_s"]) == {"drift", "start-up", "compute", "loader", "correction"}
        assert sum(row["parts_s"].values()) == pytest.approx(
            row["measured_s"] - row["predicted_s"], abs=1e-3)
        assert row["term"] in row["parts_s"]
    for epoch in ("first", "later"):
        summary = att[epoch]
        assert summary["time_mape_pct"] == pytest.approx(
            report["scores"][f"{epoch}_time_mape_pct"], rel=1e-6)
        assert summary["term"] == max(summary["terms_abs_pct"],
                                      key=summary["terms_abs_pct"].get)
        assert summary["time_missed"] == (summary["time_mape_pct"] > 10)
        missed = summary["time_missed"] or summary.get("energy_missed", False)
        assert (summary["verdict"] == "within the targets") != missed
        assert ("time MAPE" in summary["verdict"]) == summary["time_missed"]
        # Energy is scored where the host measures it (a CI host may, this one may not).
        assert ("energy MAPE" in summary["verdict"]) == summary.get("energy_missed", False)


def test_a_deadline_validates_only_what_is_expected_to_end_within_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A deadline already spent by the profiles leaves no validated configuration, the first
    one included (its cost is its predicted epochs); the note says how many were validated."""
    main(["train-predict", "-m", FACTORY, "--input-shape", "3x16x16", "--images", "96",
          "--image-size", "16", "--disk-dir", str(tmp_path / "disk"), "--no-store",
          "--telemetry", "off", "--batch", "8,16", "--workers", "0", "--profile-steps", "6",
          "--validate", "all", "--deadline", "0.01s", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["scores"]["configurations"] == 0 and report["validation_passes"] == []
    assert report["scores"]["held_out"] >= 1
    assert any(n.startswith("validated 0 of") for n in report["notes"])
    assert report["attribution"] == {}


def _probe(knobs: Knobs, compute_s: float, steps: int = 3) -> dict:
    """A compute probe's data (`profile.measure_compute`): no workers, every minibatch steady."""
    rows = [{"seq": i, "items": knobs.batch, "fetch_ns": 1000, "h2d_ns": 0,
             "forward_ns": int(compute_s * 1e9 / 3), "backward_ns": int(compute_s * 1e9 / 2),
             "optimizer_ns": int(compute_s * 1e9 / 6), "load_ns": 1000, "load_cpu_ns": 1000,
             "read_ns": 0} for i in range(steps)]
    probe = Knobs(knobs.batch, 0, 2, knobs.pin_memory, False, knobs.storage, knobs.cores,
                  knobs.precision)
    return {"config": -1, "label": probe.label, "knobs": probe.to_dict(), "kind": "compute",
            "pass": "warm", "status": "ok", "dataset_items": ITEMS, "steps": rows,
            "startup_ns": 0, "tail_ns": 0, "wall_ns": sum(
                r["fetch_ns"] + r["forward_ns"] + r["backward_ns"] + r["optimizer_ns"]
                for r in rows), "split": False, "cpu_s": None, "steady_cpu_s": None,
            "energy_j": None, "energy_source": "none"}


def test_a_compute_probe_measures_a_batch_size_no_profile_reached() -> None:
    """Profiles at batch 8 only: without a probe, batch 128's compute is a line through the
    origin (16× batch 8's) and its configurations are extrapolated; a probe measuring it at
    3× batch 8's (a device that runs a larger batch faster per image) sets the compute term
    there and the configurations count as covered (no wider bound)."""
    configs = Grid(batch=[8, 128], workers=[0, 2], storage=["tmpfs"]).configs()
    index = {(k.workers, k.batch): i for i, k in enumerate(configs)}
    profiled = [index[(0, 8)], index[(2, 8)]]
    passes = _passes(configs, profiled)
    at8 = fit_components(passes, 2).figures(configs[index[(0, 8)]], "warm")["compute"]
    _, info = predict_all(configs, passes, items=ITEMS, all_cores=2, tmpfs={"tmpfs": True},
                          method="simple")
    big = {configs[index[(0, 128)]].label, configs[index[(2, 128)]].label}
    assert set(info["extrapolation"]["configurations"]) == big
    probes = [_probe(configs[index[(0, 128)]], 3 * at8)]
    comps = fit_components(passes, 2, probes)
    got = comps.figures(configs[index[(0, 128)]], "warm")["compute"]
    assert got == pytest.approx(3 * at8, rel=0.02)
    predictions, info = predict_all(configs, passes, items=ITEMS, all_cores=2,
                                    tmpfs={"tmpfs": True}, method="simple", probes=probes)
    assert info["extrapolation"]["configurations"] == []
    assert info["compute_probes"] == ["b128 fp32"]
    assert not any(p.extrapolated for p in predictions)
    # The probe is no configuration's profile: nothing is predicted from it as its own.
    assert {p.config for p in predictions if p.profiled} == set(profiled)


def test_train_predict_probes_the_compute_of_batch_sizes_no_profile_reached(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """256 items at batch 64: four minibatches an epoch, no profile with a ramp and 3 steady
    minibatches a half fits in half of it; with whole epochs off, a compute probe of batch 64
    is measured (stored as kind `compute`),
    its cell is not extrapolated, and the budget counts the probe against the rule's cost."""
    db = tmp_path / "r.db"
    main(["train-predict", "-m", FACTORY, "--input-shape", "3x16x16", "--images", "256",
          "--image-size", "16", "--disk-dir", str(tmp_path / "disk"), "--db", str(db),
          "--telemetry", "off", "--batch", "8,64", "--workers", "0", "--profile-steps", "12",
          "--profile-share", "0.5", "--whole-epochs-below", "0", "--validate", "0", "--json"])
    report = json.loads(capsys.readouterr().out)
    probes = [p for p in report["profile_passes"] if p["kind"] == "compute"]
    assert len(probes) == 1 and probes[0]["knobs"]["batch"] == 64
    # Two minibatches: three would be over half (the share) of the epoch's four.
    assert probes[0]["status"] == "ok" and probes[0]["steps"] == 2
    assert report["model_info"]["compute_probes"] == ["b64 fp32"]
    assert report["model_info"]["extrapolation"]["configurations"] == []
    budget = report["budget"]
    assert len(budget["compute_probes"]) == 1
    assert budget["compute_probe_epochs"] == pytest.approx(budget["compute_probes"][0]["share"])
    assert budget["total_epochs"] == pytest.approx(
        sum(r["share"] for r in budget["per_config"]) + budget["compute_probe_epochs"])
    with sqlite3.connect(db) as con:
        stored = con.execute("SELECT COUNT(*) FROM train_passes WHERE kind = 'compute'"
                             ).fetchone()
    assert stored[0] == 1


def test_settling_runs_once_before_the_first_profile_and_says_what_it_saw(
        tmp_path: Path) -> None:
    """`settle` trains one batch in blocks until a block's mean step time is within 5% of the
    one before (or its time is spent), once per run, and records it; 0 s turns it off."""
    from dataclasses import replace

    from infermux.models import ModelSpec
    from infermux.train import DataSpec, TrainConfig
    from infermux.train.profile import SETTLE_BLOCK, prepare, settle

    config = TrainConfig(ModelSpec(FACTORY, input_shape=(3, 16, 16)),
                         Grid(batch=[8], workers=[0], storage=["disk"]),
                         data=DataSpec(count=32, size=16, classes=4),
                         disk_dir=str(tmp_path / "disk"), telemetry_interval_s=None,
                         settle_s=1.0)
    setup = prepare(config)
    knobs = config.grid.configs()[0]
    got = settle(setup, knobs)
    assert got["minibatches"] >= 2 * SETTLE_BLOCK or got["s"] >= 1.0
    assert got["minibatches"] % SETTLE_BLOCK == 0 and got["label"] == knobs.label
    assert got["first_block_ms"] > 0 and got["last_block_ms"] > 0
    # Not settled only where the time ran out.
    assert got["settled"] or got["s"] >= 1.0
    assert any(n.startswith("settling:") for n in setup.notes)
    # Once per run, shared by a copy of the setup (as profiles of fewer minibatches use).
    assert settle(replace(setup, config=replace(config, profile_share=0.05)), knobs) is got
    assert sum(n.startswith("settling:") for n in setup.notes) == 1
    off = prepare(replace(config, settle_s=0.0))
    assert settle(off, knobs) == {} and not off.settled
    with pytest.raises(UsageError, match="--settle"):
        replace(config, settle_s=-1.0).validate()


def test_thin_profiles_leave_room_for_the_compute_probes_they_need() -> None:
    """Batch 128 on 6,000 items (47 minibatches) is beyond any thin profile: its compute is
    probed, and the thin profiles leave a quarter of the rule's cost for the probes where they
    still reach as many cells; where the thinner profiles would reach fewer, they do not."""
    from infermux.train.run import PROBE_RESERVE

    configs = Grid(batch=[32, 128], workers=[2], precision=["fp32", "amp"]).configs("cuda:0")
    mode, pool, count, each, notes = _profile_plan(configs, 6000, 0.1, 2)
    assert count == 2
    assert mode == "thin" and each == pytest.approx(0.1 * (1 - PROBE_RESERVE))
    assert {configs[i].batch for i in pool} == {32}
    assert "compute probes of 2 batch size(s)" in notes[-1]
    wide = Grid(batch=[32, 128], workers=[2, 8], precision=["fp32", "amp"]).configs("cuda:0")
    mode, _, _, each, notes = _profile_plan(wide, 6000, 0.1, 3)
    assert mode == "thin" and each == pytest.approx(0.1 * 3 / 4)
    assert "compute probes" not in notes[-1]


def _recorded_pass(kind: str, pass_name: str, walls_ms: list[float]) -> dict:
    """A pass of the drift reference (b16, one loader worker, a split profile) from its
    minibatches' recorded times (ms): the cold half's first minibatch is its ramp."""
    knobs = Knobs(batch=16, workers=1)
    steps = [{"seq": i, "items": 16, "fetch_ns": 5_000_000, "h2d_ns": 0,
              "forward_ns": round(w * 1e6) - 5_000_000, "backward_ns": 0, "optimizer_ns": 0,
              "load_ns": 0, "load_cpu_ns": 0, "read_ns": 0} for i, w in enumerate(walls_ms)]
    return {"config": 0, "label": knobs.label, "knobs": knobs.to_dict(), "kind": kind,
            "pass": pass_name, "status": "ok", "dataset_items": 800, "steps": steps,
            "split": True, "wall_ns": round(sum(walls_ms) * 1e6)}


# Recorded on the 2-core CPU (regnet_x_400mf, 800 images): the reference's profile and its
# probe after the first validated configuration, ms per minibatch. Quiet: nothing else ran.
QUIET = ([350.8, 200.4, 174.7, 153.6], [141.5, 154.3, 148.6],
         [356.4, 207.0, 189.6, 182.1], [186.9, 169.7, 175.5])
# The same network and plan while other processes held 1.4–1.8 of the two cores.
LOADED = ([2407.6, 1381.2, 992.7, 602.8], [567.4, 534.4, 2260.7],
          [1308.5, 801.5, 608.1, 472.2], [774.3, 849.7, 708.0])


def _drift(recorded: tuple[list[float], ...]) -> dict | None:
    cold, warm, p_cold, p_warm = recorded
    before = [_recorded_pass("profile", "cold", cold), _recorded_pass("profile", "warm", warm)]
    after = [_recorded_pass("probe:1", "cold", p_cold), _recorded_pass("probe:1", "warm", p_warm)]
    return drift_of(before[0]["label"], before, after)


def test_a_drift_within_its_own_noise_is_not_corrected_for() -> None:
    """On the quiet CPU the probe read 1.14× with minibatches within a few % of each other:
    resolved, corrected for. Loaded, the same reading method gave 0.66× from minibatches
    spread 0.5–2.4 s: within its noise (the corrected MAPE had got worse), scored × 1."""
    quiet, loaded = _drift(QUIET), _drift(LOADED)
    assert quiet is not None and loaded is not None
    assert quiet["ratio"] == pytest.approx(1.14, abs=0.01) and quiet["cv"] < 0.1
    assert loaded["ratio"] == pytest.approx(0.66, abs=0.01) and loaded["cv"] > 0.4
    assert loaded["se_log"] > 4 * quiet["se_log"]
    # The steady window is the predictor's: the cold half's first minibatch is its ramp.
    assert quiet["before_steps"] == quiet["after_steps"] == 6
    q, lo = epoch_drift([quiet]), epoch_drift([loaded])
    assert q is not None and q["drift_resolved"] and applied_drift(q) == pytest.approx(
        quiet["ratio"])
    assert lo is not None and not lo["drift_resolved"] and applied_drift(lo) == 1.0
    assert lo["drift"] == pytest.approx(loaded["ratio"])  # still reported as measured
    # Two probes around an epoch: their geometric mean; the profile's noise counted once.
    both = epoch_drift([quiet, quiet])
    assert both is not None and both["drift"] == pytest.approx(quiet["ratio"])
    assert quiet["before_rel_se"] < both["drift_se"] < quiet["se_log"]
    # Stored before the noise was measured: corrected as then; nothing measured: None.
    assert applied_drift({"drift": 1.3}) == 1.3 and applied_drift({"s": 1.0}) is None


def test_scores_and_attribution_scale_only_by_a_resolved_drift() -> None:
    """The corrected MAPE and the drift term of the attribution use the drift applied (1
    where within the noise), while the row still says the drift measured."""
    configs = Grid(batch=[8, 32], workers=[0, 1], storage=["tmpfs"]).configs()
    preds = []
    for i, resolved in ((2, True), (3, False)):
        pred = Prediction(i, configs[i], False, "simple",
                          {e: {"predicted_s": 10.0, "low_s": 9.0, "high_s": 11.0,
                               "predicted_energy_j": None} for e in ("first", "later")})
        pred.measured = {e: {"s": 12.0, "energy_j": None, "drift": 1.2, "drift_se": 0.05,
                             "drift_resolved": resolved} for e in ("first", "later")}
        preds.append(pred)
    report = PredictReport(None, {}, configs, [0], [Prediction(0, configs[0], True, "profile",
                                                              {}), *preds], {}, [], [], ITEMS,
                           held_out=3)
    scores = report.scores()
    # 10 s predicted, 12 s measured: 16.7% off; corrected, only the resolved one is right.
    assert scores["later_time_mape_pct"] == pytest.approx(100 / 6)
    assert scores["later_time_mape_drift_corrected_pct"] == pytest.approx(100 / 12)
    rows = {r["config"]: r for r in preds[1].rows() + preds[0].rows()}
    assert rows[3]["drift"] == 1.2 and rows[3]["drift_resolved"] is False
    # The attribution's drift part: predicted × (applied − 1).
    comps = fit_components(_passes(configs, [0, 1, 2, 3]), 2)
    epoch = _synthetic_pass(3, configs[3], "warm", ITEMS, 20, epoch=True)
    unresolved = epoch_parts(comps, epoch, 10.0, ITEMS, applied_drift(preds[1].measured["later"]))
    resolved = epoch_parts(comps, epoch, 10.0, ITEMS, applied_drift(preds[0].measured["later"]))
    assert unresolved is not None and unresolved["parts_s"]["drift"] == 0.0
    assert resolved is not None and resolved["parts_s"]["drift"] == pytest.approx(2.0)


def test_a_transfer_is_compared_with_the_simple_model_only_from_four_profiled_configurations(
) -> None:
    """Both networks run persistent-worker configurations at 0.7× what the simple model sees,
    and the reference's correction has learned it. Over two profiled configurations the
    transfer's leave-one-out error beats the simple model's, by two held-out rows: not enough
    to choose on (on fresh runs of unseen networks such wins were worse on the validated
    epochs), so the simple model predicts and the run says why. Over six the transfer wins
    its comparison and is kept."""
    pytest.importorskip("sklearn")
    configs = Grid(batch=[8, 32, 128], workers=[0, 1, 4], storage=["disk", "tmpfs"],
                   persistent_workers=[False, True]).configs()
    slow = {i: 0.7 for i, k in enumerate(configs) if k.persistent_workers}
    reference = _passes(configs, choose_profiled(configs, 6), slow)
    for p in reference:
        p["config"] += 10_000

    def info_for(profiled: int) -> dict:
        passes = _passes(configs, choose_profiled(configs, profiled), slow)
        return predict_all(configs, passes, items=ITEMS, all_cores=2,
                           tmpfs={"disk": False, "tmpfs": True}, method="auto",
                           reference=reference)[1]

    two = info_for(2)
    assert two["transfer"]["error_pct"] < 0.8 * two["simple_loo_mape_pct"]  # it "won"
    assert two["chosen"] == "simple"
    assert "2 profiled configuration(s) to compare on, fewer than the 4" in (
        two["transfer"]["not_used"])
    six = info_for(6)
    assert six["chosen"] == "transfer" and "not_used" not in six["transfer"]


def test_a_device_drift_moves_an_epoch_through_its_compute_term_only() -> None:
    """On a GPU host a compute probe read 1.17-1.38x while the loader-bound epochs beside it
    ran as predicted (regnet_y_400mf at b128 with two workers): the drift was the device's,
    and the epoch's steady minibatch is the largest of its terms. Scaled through the fitted
    model: an epoch its loader bounds does not move; one its compute bounds moves by the
    compute's share; without workers the compute adds to the loader's time."""
    items = 4096
    profiled = [Knobs(batch=8, workers=1), Knobs(batch=128, workers=4), Knobs(batch=32, workers=0)]
    passes = [_synthetic_pass(i, k, p, items, 12) for i, k in enumerate(profiled)
              for p in ("cold", "warm")]
    comps = fit_components(passes, all_cores=2)
    drift = 1.3
    for knobs in (Knobs(batch=8, workers=1), Knobs(batch=128, workers=4),
                  Knobs(batch=32, workers=0)):
        model = comps.predict(knobs, "warm", items)
        scale = compute_drift_scale(model, drift, knobs.workers)
        body = (model["epoch_s"] - model["start_s"]) / model["T"]
        compute = model["term_compute"]
        if knobs.workers:
            others = max(model["term_loader"], model["term_cores"])
            step = max(compute * drift, others)
        else:
            step = model["T"] + compute * (drift - 1)
        assert scale == pytest.approx((model["start_s"] + body * step) / model["epoch_s"])
        assert 1.0 <= scale <= drift
        if knobs.workers and others >= compute * drift:  # bound by the loader or the cores
            assert scale == pytest.approx(1.0)
    # A bound the compute does not reach, and one it holds alone (a model's terms as given).
    loader_bound = {"epoch_s": 10.0, "start_s": 1.0, "T": 0.09, "term_compute": 0.05,
                    "term_loader": 0.09, "term_cores": 0.02}
    assert compute_drift_scale(loader_bound, 1.3, 2) == pytest.approx(1.0)
    compute_bound = dict(loader_bound, T=0.09, term_compute=0.09, term_loader=0.05)
    assert compute_drift_scale(compute_bound, 1.3, 2) == pytest.approx((1.0 + 9.0 * 1.3) / 10.0)
    # A validated configuration's epochs get it from the model fitted as the predictor fits
    # it (what a GPU run does with its compute probe's drift); an epoch without a drift, none.
    from infermux.train.run import _components, _device_drift

    fitted = _components(passes)
    assert fitted is not None
    knobs = Knobs(batch=128, workers=4)
    measured: dict[str, dict] = {"first": {"s": 1.0, "drift": drift}, "later": {"s": 1.0}}
    _device_drift(fitted, knobs, measured, items)
    assert measured["first"]["drift_epoch"] == pytest.approx(compute_drift_scale(
        fitted.predict(knobs, "cold", items), drift, knobs.workers))
    assert "drift_epoch" not in measured["later"]
    # The reference at another batch read the drift of a launch-bound step: reported, not
    # applied to a GPU configuration's epochs; a stored run's label names that reference.
    from infermux.train.run import _not_across_batches, _reference_of

    beside = {"first": {"s": 1.0, "drift": 1.23, "drift_resolved": True}, "later": {"s": 1.0}}
    _not_across_batches(beside)
    assert applied_drift(beside["first"]) == 1.0 and beside["first"]["drift"] == 1.23
    assert "drift_epoch" not in beside["later"]
    ref = Knobs(batch=32, workers=2)
    index = {ref.label: 0, knobs.label: 1}
    assert _reference_of(f"reference {ref.label} (no figure at its batch)", index) == 0
    assert _reference_of("compute probe b128 fp32", index) is None
    assert _reference_of("reference b999 w1 (no figure at its batch)", index) is None
    # What the scores apply: the epoch's own scale where given, the drift where not, and 1
    # where the drift is within its noise.
    assert applied_drift({"drift": 1.3, "drift_resolved": True, "drift_epoch": 1.0}) == 1.0
    assert applied_drift({"drift": 1.3, "drift_resolved": False, "drift_epoch": 1.2}) == 1.0
    assert applied_drift({"drift": 1.3, "drift_resolved": True}) == 1.3
