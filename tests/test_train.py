"""Training under measurement: phase accounting, fetch stalls, the predictor, knobs, power modes."""

from __future__ import annotations

import json
import math
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from infermux.cli import main
from infermux.errors import UsageError
from infermux.train import DataSpec, Grid, Knobs, Trainer, evict, make_loader, run_pass
from infermux.train.data import ImageFiles, fs_type, open_dataset, write_synthetic
from infermux.train.power import (
    parse_nvpmodel_conf,
    parse_nvpmodel_query,
    read_power_mode,
    set_power_mode,
)
from infermux.train.predict import choose_profiled, predict_all, profile_estimate

from .conftest import FIXTURES, ROOT, run_cli

FACTORY = f"{ROOT / 'bench' / 'train_models.py'}:small_cnn"


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4))


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic(DataSpec(count=96, size=16, classes=4), tmp_path_factory.mktemp("data"))


# -- the loop ------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_phases_add_up_to_the_measured_wall_time(images: Path, workers: int) -> None:
    dataset = ImageFiles(images, (16, 16))
    trainer = Trainer(_tiny())
    loader = make_loader(dataset, Knobs(batch=16, workers=workers))
    t0 = time.perf_counter_ns()
    result = run_pass(trainer, loader)
    outside_ns = time.perf_counter_ns() - t0
    assert len(result.steps) == 6 and result.items == 96
    totals = result.phase_totals_ns()
    # Contiguous timestamps: the phases, startup and tail are the pass's wall time exactly ...
    assert sum(totals.values()) == result.wall_ns
    # ... and that is the wall time seen from outside, less the few calls around it.
    assert result.wall_ns <= outside_ns
    assert outside_ns - result.wall_ns < 0.05 * outside_ns + 5e6
    for step in result.steps:
        assert step.wall_ns == sum(getattr(step, f"{p}_ns") for p in
                                   ("fetch", "h2d", "forward", "backward", "optimizer"))
        assert step.load_ns > 0 and step.load_cpu_ns > 0  # timed where the items were loaded
    assert result.loss_first is not None and math.isfinite(result.loss_last or math.nan)
    assert result.cpu_s > 0


class _Slow(ImageFiles):
    """Every item takes 15 ms longer to load, as from a slow medium."""

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        time.sleep(0.015)
        return super().__getitem__(index)


def test_a_slowed_loader_shows_as_fetch_stall(images: Path) -> None:
    fast = run_pass(Trainer(_tiny()), make_loader(ImageFiles(images, (16, 16)), Knobs(batch=8)),
                    max_steps=4)
    slow = run_pass(Trainer(_tiny()), make_loader(_Slow(images, (16, 16)), Knobs(batch=8)),
                    max_steps=4)
    fetch_fast = fast.phase_totals_ns()["fetch"] / len(fast.steps)
    fetch_slow = slow.phase_totals_ns()["fetch"] / len(slow.steps)
    assert fetch_slow >= 8 * 15e6  # 8 items × 15 ms, waited for in the fetch phase
    assert fetch_slow > 5 * fetch_fast
    compute_slow = sum(s.compute_ns for s in slow.steps) / len(slow.steps)
    assert compute_slow < fetch_slow  # the time went to the stall, not to the step


def test_cold_pass_evicts_the_page_cache_where_it_can(images: Path) -> None:
    info = evict(images)
    if fs_type(images) in ("tmpfs", "ramfs"):
        assert info["evicted"] is False and "memory" in info["note"]
    else:
        assert info["evicted"] is True and info["files"] == 96


# -- knobs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("knobs", "words"), [
    (Knobs(batch=0), "--batch 0"),
    (Knobs(batch=8, workers=-1), "--workers -1"),
    (Knobs(batch=8, precision="int4"), "--precision 'int4'"),
    (Knobs(batch=8, precision="fp16"), "needs a CUDA device"),
    (Knobs(batch=8, pin_memory=True), "--pin-memory true"),
    (Knobs(batch=8, persistent_workers=True), "--persistent true"),
    (Knobs(batch=8, cores=(4096,)), "core 4096"),
])
def test_bad_knobs_are_one_clear_line(knobs: Knobs, words: str) -> None:
    with pytest.raises(UsageError) as failed:
        knobs.validate("cpu")
    assert words in str(failed.value) and "\n" not in str(failed.value)


def test_grid_merges_what_cannot_differ() -> None:
    grid = Grid(batch=[8], workers=[0, 2], prefetch_factor=[2, 4], persistent_workers=[False, True])
    labels = [k.label for k in grid.configs()]
    assert labels == ["b8 w0 disk call fp32", "b8 w2 pf2 disk call fp32",
                      "b8 w2 pf2 persist disk call fp32", "b8 w2 pf4 disk call fp32",
                      "b8 w2 pf4 persist disk call fp32"]


@pytest.mark.parametrize(("args", "words"), [
    (["--workers", "-1"], "--workers -1 must be at least 0"),
    (["--batch", "8,x"], "--batch 'x' is not an integer"),
    (["--pin-memory", "true"], "--pin-memory true needs a CUDA device"),
    (["--cores", "0-"], "--cores '0-' is not a core set"),
    (["--storage", "/etc/hostname"], "is a file"),
    (["--image-format", "gif"], "--image-format 'gif'"),
    (["--unit", "dla:0"], "--unit 'dla:0'"),
])
def test_cli_bad_knobs_exit_2_with_one_line(args: list[str], words: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as failed:
        main(["train-profile", "-m", FACTORY, "--images", "8", "--disk-dir", str(tmp_path),
              "--db", str(tmp_path / "r.db"), *args])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert failed.value.code == 2, stderr
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert words in lines[0]


def test_a_bad_knob_as_a_user_sees_it(tmp_path: Path) -> None:
    proc = run_cli("train-predict", "-m", FACTORY, "--workers", "0,x", "--db",
                   str(tmp_path / "r.db"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("error: --workers 'x' is not an integer: pass integers ≥ 0, "
                                   "e.g. --workers 0,1")


# -- the predictor -------------------------------------------------------------------------------


def _synthetic_pass(config: int, knobs: Knobs, pass_name: str, items: int, steps: int
                    ) -> dict:
    """A pass whose minibatches follow a known relation (what the simple model assumes).

    compute C(B) = 2 ms + 0.5 ms·B, one core busy; loader CPU ℓ = 1 ms per item (+ ρ = 2 ms read
    when cold, on disk); none: T = B·(ℓ + ρ) + C; w workers on 2 cores: T = max(C, B·(ℓ + ρ)/w,
    (C + B·ℓ)/2). Power 10 W + 5 W per core.
    """
    b, w = knobs.batch, knobs.workers
    compute = 2e-3 + 0.5e-3 * b
    ell, rho = 1e-3, (2e-3 if pass_name == "cold" and knobs.storage == "disk" else 0.0)
    step = (b * (ell + rho) + compute if w == 0
            else max(compute, b * (ell + rho) / w, (compute + b * ell) / 2))
    fetch = step - compute
    rows = [{"seq": i, "items": b, "fetch_ns": int(fetch * 1e9), "h2d_ns": 0,
             "forward_ns": int(compute / 3 * 1e9), "backward_ns": int(compute / 2 * 1e9),
             "optimizer_ns": int(compute / 6 * 1e9), "load_ns": int(b * (ell + rho) * 1e9),
             "load_cpu_ns": int(b * ell * 1e9), "read_ns": int(b * rho * 1e9)}
            for i in range(steps)]
    wall = sum(r["fetch_ns"] + r["forward_ns"] + r["backward_ns"] + r["optimizer_ns"]
               for r in rows)
    power = 10.0 + 5.0 * len(knobs.cores or (0, 1))
    return {"config": config, "label": knobs.label, "knobs": knobs.to_dict(),
            "kind": "profile", "pass": pass_name, "status": "ok", "dataset_items": items,
            "steps": rows, "startup_ns": 0, "tail_ns": 0, "wall_ns": wall,
            "cpu_s": steps * (compute + b * ell), "energy_j": power * wall / 1e9,
            "energy_source": "synthetic"}


def test_the_predictor_recovers_a_known_relation() -> None:
    grid = Grid(batch=[8, 32, 128], workers=[0, 1, 4], storage=["disk", "tmpfs"])
    configs = grid.configs()
    items = 4096
    profiled = choose_profiled(configs, math.ceil(len(configs) / 3))
    assert len(profiled) == 6
    passes = [_synthetic_pass(i, configs[i], p, items, 12) for i in profiled
              for p in ("cold", "warm")]
    predictions, info = predict_all(configs, passes, items=items, all_cores=2,
                                    tmpfs={"disk": False, "tmpfs": True}, method="simple")
    truth = {i: {p: _synthetic_pass(i, k, p, items, math.ceil(items / k.batch))
                 for p in ("cold", "warm")} for i, k in enumerate(configs)}
    errors = []
    for pred in predictions:
        for pass_name, epoch in (("cold", "first"), ("warm", "later")):
            true_s = truth[pred.config][pass_name]["wall_ns"] / 1e9
            got = pred.epochs[epoch]["predicted_s"]
            errors.append(abs(got - true_s) / true_s)
            low, high = pred.epochs[epoch]["low_s"], pred.epochs[epoch]["high_s"]
            assert low is not None and high is not None and low <= got <= high
    assert max(errors) < 0.03, errors  # the relation is recovered, not approximated
    assert sum(p.profiled for p in predictions) == 6
    assert info["simple_loo_mape_pct"] < 3
    # The profiled configurations' own estimate: minibatches × the minibatches of an epoch.
    first = profile_estimate([p for p in passes if p["config"] == profiled[0]])
    assert first is not None and first["later_energy_j"] > 0


def test_the_learned_model_corrects_what_the_simple_model_misses() -> None:
    pytest.importorskip("sklearn")
    grid = Grid(batch=[8, 32, 128], workers=[0, 1, 4], storage=["disk", "tmpfs"],
                persistent_workers=[False, True])
    configs = grid.configs()
    items = 4096

    def passes_for(indices: list[int], steps: int) -> list[dict]:
        out = []
        for i in indices:
            for p in ("cold", "warm"):
                data = _synthetic_pass(i, configs[i], p, items, steps)
                if configs[i].persistent_workers:  # a 30% effect the simple model cannot see
                    for row in data["steps"]:
                        for key in ("fetch_ns", "forward_ns", "backward_ns", "optimizer_ns"):
                            row[key] = int(row[key] * 0.7)
                    data["wall_ns"] = int(data["wall_ns"] * 0.7)
                out.append(data)
        return out

    profiled = choose_profiled(configs, 10)
    predictions, info = predict_all(configs, passes_for(profiled, 12), items=items,
                                    all_cores=2, tmpfs={"disk": False, "tmpfs": True},
                                    method="learned")
    assert info["chosen"] == "learned"
    truth = {i: passes_for([i], math.ceil(items / k.batch)) for i, k in enumerate(configs)}
    errors = [abs(p.epochs["later"]["predicted_s"] - truth[p.config][1]["wall_ns"] / 1e9)
              / (truth[p.config][1]["wall_ns"] / 1e9) for p in predictions if not p.profiled]
    assert sum(errors) / len(errors) < 0.12, errors


# -- power modes ----------------------------------------------------------------------------------

#: `nvpmodel -q` as printed on an AGX Orin (JetPack 5), an AGX Xavier (JetPack 4: the fan mode
#: first) and a Nano (a warning first), and `jetson_clocks --show`'s GPU line.
NVPMODEL_Q_ORIN = "NV Power Mode: MODE_30W\n2\n"
NVPMODEL_Q_XAVIER = "NV Fan Mode:quiet\nNV Power Mode: MODE_30W_ALL\n3\n"
NVPMODEL_Q_NANO = "NVPM WARN: fan mode is not set!\nNV Power Mode: MAXN\n0\n"


@pytest.mark.parametrize(("text", "expected"), [
    (NVPMODEL_Q_ORIN, ("MODE_30W", 2)),
    (NVPMODEL_Q_XAVIER, ("MODE_30W_ALL", 3)),
    (NVPMODEL_Q_NANO, ("MAXN", 0)),
    ("nvpmodel: command not found\n", (None, None)),
])
def test_nvpmodel_query_is_parsed(text: str, expected: tuple) -> None:
    assert parse_nvpmodel_query(text) == expected


def test_power_mode_is_read_from_a_jetson_tree() -> None:
    root = FIXTURES / "jetson_agx_orin_jp5"
    modes = parse_nvpmodel_conf((root / "etc/nvpmodel.conf").read_text())
    assert modes == {0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_50W"}
    mode = read_power_mode(root, run_tools=False)
    assert mode.platform == "jetson" and mode.settable
    assert mode.modes == modes and mode.mode_id in modes and mode.name == modes[mode.mode_id]


def test_power_mode_is_recorded_here_and_never_set_off_a_jetson(tmp_path: Path) -> None:
    mode = read_power_mode(tmp_path)  # an empty root: not a Jetson
    assert mode.platform == "other" and not mode.settable
    with pytest.raises(UsageError, match="only on a Jetson"):
        set_power_mode("0", root=tmp_path)


# -- end to end ---------------------------------------------------------------------------------


def test_train_profile_and_predict_from_the_cli(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "r.db"
    common = ["-m", FACTORY, "--input-shape", "3x16x16", "--images", "96", "--image-size", "16",
              "--disk-dir", str(tmp_path / "disk"), "--db", str(db), "--telemetry", "50ms",
              "--batch", "8,16", "--workers", "0,1", "--profile-share", "1"]
    main(["train-profile", *common, "--profile-steps", "8", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert len(report["configs"]) == 4 and len(report["passes"]) == 8
    assert {p["pass"] for p in report["passes"]} == {"cold", "warm"}
    assert all(p["status"] == "ok" for p in report["passes"])
    assert report["best"]["time"]["label"] in {c["label"] for c in report["configs"]}
    assert report["passes"][0]["energy_source"]  # a counter, or the labelled CPU model
    with sqlite3.connect(db) as con:
        kind = con.execute("SELECT kind, status FROM runs WHERE id = ?",
                           (report["run_id"],)).fetchone()
        steps = con.execute("SELECT COUNT(*) FROM train_steps WHERE run_id = ?",
                            (report["run_id"],)).fetchone()[0]
    assert kind == ("train", "complete")
    assert steps == sum(p["steps"] for p in report["passes"])
    main(["train-predict", *common, "--profile-steps", "6", "--validate", "all"])
    table = capsys.readouterr().out
    assert "Predicted epochs" in table and "validated on 2 held-out" in table
    assert "Where the time goes" in table
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT COUNT(*), COUNT(measured_s) FROM train_predictions").fetchone()
    assert rows == (8, 4)  # 4 configurations × first/later; the 2 held out were measured


def test_open_dataset_needs_an_image_shaped_model(images: Path) -> None:
    with pytest.raises(UsageError, match="3×H×W"):
        open_dataset(images, (10,))
