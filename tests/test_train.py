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
from infermux.models import ModelSpec
from infermux.store import Store
from infermux.train import DataSpec, Grid, Knobs, Trainer, evict, make_loader, run_pass
from infermux.train.components import fit_components
from infermux.train.covering import choose_profiled, covering_order, model_cell
from infermux.train.data import ImageFiles, fs_type, open_dataset, write_synthetic
from infermux.train.power import (
    parse_nvpmodel_conf,
    parse_nvpmodel_query,
    read_power_mode,
    set_power_mode,
)
from infermux.train.predict import predict_all
from infermux.train.profile import MINIBATCH_SHARE, TrainConfig, profile_steps
from infermux.train.run import (
    SHARE_MARGIN,
    estimated_share,
    fitting_config,
    profile_fits,
    repredict,
)
from infermux.train.steady import MIN_STEADY_STEPS, profile_estimate, warmup_steps

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
    result = run_pass(trainer, loader, cpu_marks={0, 1})
    outside_ns = time.perf_counter_ns() - t0
    assert len(result.steps) == 6 and result.items == 96
    totals = result.phase_totals_ns()
    # Contiguous timestamps: the phases, startup and tail are the pass's wall time exactly ...
    assert sum(totals.values()) == result.wall_ns
    # ... and that is the wall time seen from outside, less the few calls around it (reading
    # the CPU counters, starting the loader: 9.7 ms once on the 2-core host under a full test
    # run's load).
    assert result.wall_ns <= outside_ns
    assert outside_ns - result.wall_ns < 0.05 * outside_ns + 20e6
    for step in result.steps:
        assert step.wall_ns == sum(getattr(step, f"{p}_ns") for p in
                                   ("fetch", "h2d", "forward", "backward", "optimizer"))
        assert step.load_ns > 0 and step.load_cpu_ns > 0  # timed where the items were loaded
    assert result.loss_first is not None and math.isfinite(result.loss_last or math.nan)
    assert result.cpu_s > 0
    # Time to the first minibatch: the loader's start-up and the first batch's wait.
    assert result.first_minibatch_ns == result.startup_ns + result.steps[0].fetch_ns
    assert result.startup_ns > 0 and (workers == 0 or result.first_minibatch_ns > 1e6)
    # A profile cut in two (cold, then warm) still adds up: start-up in the first part, tail
    # in the second, every nanosecond in one of them.
    head, rest = result.split(2, 0.5 * result.cpu_s)
    assert head.wall_ns + rest.wall_ns == result.wall_ns
    assert sum(head.phase_totals_ns().values()) == head.wall_ns and head.tail_ns == 0
    assert sum(rest.phase_totals_ns().values()) == rest.wall_ns and rest.startup_ns == 0
    assert [s.seq for s in rest.steps] == [0, 1, 2, 3] and head.items + rest.items == 96
    # CPU read after the marked minibatches and after the last: the steady part's own CPU,
    # without start-up, ramp or tail; the cut's parts keep theirs.
    # (The kernel counts CPU time in ticks of 10 ms: two reads a few minibatches apart may be
    # equal, never decreasing.)
    assert set(result.cpu_at) == {0, 1}
    assert 0 <= result.cpu_at[0] <= result.cpu_at[1] <= (result.cpu_steps_s or 0) <= result.cpu_s
    assert result.cpu_s > 0
    steady = result.steady_cpu_s(1)
    assert steady is not None and 0 <= steady == pytest.approx(result.cpu_steps_s
                                                                - result.cpu_at[0])
    head, rest = result.split(2, result.cpu_at[1])
    assert head.steady_cpu_s(1) == pytest.approx(result.cpu_at[1] - result.cpu_at[0])
    assert rest.steady_cpu_s(0) == pytest.approx((result.cpu_steps_s or 0) - result.cpu_at[1])


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
    # Every slowed minibatch waits 8 items × 15 ms in its fetch phase ...
    assert all(s.fetch_ns >= 8 * 15e6 for s in slow.steps)
    assert min(s.fetch_ns for s in slow.steps) > min(s.fetch_ns for s in fast.steps) + 90e6
    # ... and the wait is not in the step: the least step time (the one a busy machine
    # disturbed least) stays below the sleep.
    assert min(s.compute_ns for s in slow.steps) < 8 * 15e6


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


@pytest.mark.parametrize(("items", "batch", "workers", "fits"), [
    (20000, 16, 0, True), (20000, 64, 2, True), (24000, 32, 8, True), (24000, 64, 4, True),
    (24000, 64, 8, False), (24000, 128, 2, False)])
def test_a_profile_stays_within_its_share_of_an_epoch(items: int, batch: int, workers: int,
                                                      fits: bool) -> None:
    """The figures' grids: 60% of 10% of an epoch's minibatches at most, each half keeps a
    steady part after the loader's ramp; a configuration without room for the ramp and 8
    steady minibatches per half is not a candidate for profiling."""
    config = TrainConfig(ModelSpec(FACTORY), Grid(batch=[batch]), profile_steps=400)
    knobs = Knobs(batch=batch, workers=workers)
    cold, warm = profile_steps(config, knobs, items)
    if fits:
        assert cold + warm <= MINIBATCH_SHARE * 0.1 * math.ceil(items / batch)
        assert cold - warmup_steps(workers) == warm >= MIN_STEADY_STEPS
    assert profile_fits(knobs, items, 0.1) is fits


def test_a_profile_estimated_over_the_share_gets_fewer_minibatches_or_none() -> None:
    """Aimed at 90% of the share (an estimate errs both ways): shortened where a shorter
    profile fits, passed over (None) where even the shortest does not."""
    items = 4096
    profiled = [Knobs(batch=8, storage="tmpfs"), Knobs(batch=128, workers=4, storage="tmpfs")]
    passes = [_synthetic_pass(i, k, p, items, 12) for i, k in enumerate(profiled)
              for p in ("cold", "warm")]
    config = TrainConfig(ModelSpec(FACTORY), Grid(batch=[8]), profile_share=0.1)
    fits = Knobs(batch=32, storage="tmpfs")
    got, est = fitting_config(fits, passes, config, items)
    assert got is config and est is not None and est <= SHARE_MARGIN * 0.1
    long = Knobs(batch=8, workers=1, storage="tmpfs")  # its worker's start: ~9.6%
    assert estimated_share(long, passes, config, items) > SHARE_MARGIN * 0.1  # type: ignore[operator]
    got, est = fitting_config(long, passes, config, items)
    assert got is not None and got.profile_share < config.profile_share
    assert est is not None and est <= SHARE_MARGIN * 0.1
    assert sum(profile_steps(got, long, items)) < sum(profile_steps(config, long, items))
    got, est = fitting_config(Knobs(batch=128, workers=4, storage="tmpfs"), passes, config,
                              items)
    assert got is None and est is not None and est > 0.1


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


def _relation(knobs: Knobs, pass_name: str, contention: float = 0.0) -> dict[str, float]:
    """A known relation of the kind the simple model assumes (s).

    compute C(B) = 2 ms + 0.5 ms·B, one core busy; loader CPU ℓ = 1 ms per item (+ ρ = 2 ms read
    when cold, on disk); no workers: T = B·(ℓ + ρ) + C; w workers on 2 cores: T = max(C,
    B·(ℓ + ρ)/w, (C + B·ℓ)/2). Start-up: 1 ms without workers, 5 ms + 30 ms per worker with
    them; the first minibatch waits B·(ℓ + ρ) (+ 15 ms for the workers to start); tail 0.5 ms,
    or 2 ms + 8 ms per worker. Energy (`_energy`): a static 60 W over the wall time plus a
    dynamic 0.02 J + 0.004 J per item for each minibatch (a device waiting on its loader draws
    only the static power). `contention`: beside workers the training takes that much more CPU
    per minibatch (C·(1 + contention) in the cores term), as on a small machine.
    """
    b, w = knobs.batch, knobs.workers
    compute = 2e-3 + 0.5e-3 * b
    cpu = compute * (1 + contention) if w else compute
    ell, rho = 1e-3, (2e-3 if pass_name == "cold" and knobs.storage == "disk" else 0.0)
    step = (b * (ell + rho) + compute if w == 0
            else max(compute, b * (ell + rho) / w, (cpu + b * ell) / 2))
    return {"C": compute, "cpu": cpu, "T": step, "ell": ell, "rho": rho,
            "startup": 1e-3 if w == 0 else 5e-3 + 30e-3 * w,
            "first": b * (ell + rho) + (15e-3 if w else 0.0),
            "tail": 0.5e-3 if w == 0 else 2e-3 + 8e-3 * w}


def _energy(wall_s: float, steps: int, batch: int) -> float:
    return 60.0 * wall_s + steps * (0.02 + 0.004 * batch)


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _synthetic_pass(config: int, knobs: Knobs, pass_name: str, items: int, steps: int, *,
                    split: bool = True, epoch: bool = False, slow: float = 1.0,
                    contention: float = 0.0, steady_cpu: bool = True) -> dict:
    """A profile half (`split`: the cold one starts the loader, the warm one continues it and
    ends it) or a whole epoch (`epoch`) following `_relation`; `slow` scales the steady time;
    `steady_cpu`: the steady minibatches' own CPU time is recorded (as a profile does)."""
    rel = _relation(knobs, pass_name, contention)
    b = knobs.batch
    starts = epoch or not split or pass_name == "cold"
    ends = epoch or not split or pass_name == "warm"
    rows = []
    for i in range(steps):
        first = starts and i == 0
        fetch = rel["first"] if first else rel["T"] * slow - rel["C"] * slow
        compute = rel["C"] * (1.0 if first else slow)
        rows.append({"seq": i, "items": b, "fetch_ns": _ns(fetch), "h2d_ns": 0,
                     "forward_ns": _ns(compute / 3), "backward_ns": _ns(compute / 2),
                     "optimizer_ns": _ns(compute / 6), "load_ns": _ns(b * (rel["ell"] + rel["rho"])),
                     "load_cpu_ns": _ns(b * rel["ell"]), "read_ns": _ns(b * rel["rho"])})
    startup = _ns(rel["startup"]) if starts else 0
    tail = _ns(rel["tail"]) if ends else 0
    wall = startup + tail + sum(r["fetch_ns"] + r["forward_ns"] + r["backward_ns"]
                                + r["optimizer_ns"] for r in rows)
    return {"config": config, "label": knobs.label, "knobs": knobs.to_dict(),
            "kind": "epoch" if epoch else "profile", "pass": pass_name, "status": "ok",
            "dataset_items": items, "steps": rows, "startup_ns": startup, "tail_ns": tail,
            "wall_ns": wall, "split": split and not epoch,
            "cpu_s": steps * (rel["cpu"] + b * rel["ell"]),
            "steady_cpu_s": ((steps - (min(steps - 1, max(1, knobs.workers)) if starts else 0))
                             * (rel["cpu"] + b * rel["ell"]) if steady_cpu else None),
            "energy_j": _energy(wall / 1e9, steps, b), "energy_source": "synthetic"}


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
    truth = {i: {p: _synthetic_pass(i, k, p, items, math.ceil(items / k.batch), epoch=True)
                 for p in ("cold", "warm")} for i, k in enumerate(configs)}
    errors, energy_errors = [], []
    for pred in predictions:
        for pass_name, epoch in (("cold", "first"), ("warm", "later")):
            true_s = truth[pred.config][pass_name]["wall_ns"] / 1e9
            got = pred.epochs[epoch]["predicted_s"]
            errors.append(abs(got - true_s) / true_s)
            true_j = truth[pred.config][pass_name]["energy_j"]
            energy_errors.append(abs(pred.epochs[epoch]["predicted_energy_j"] - true_j) / true_j)
            low, high = pred.epochs[epoch]["low_s"], pred.epochs[epoch]["high_s"]
            assert low is not None and high is not None and low <= got <= high
    assert max(errors) < 0.01, errors  # the relation is recovered, not approximated
    assert max(energy_errors) < 0.02, energy_errors  # static power × time + energy per minibatch
    assert sum(p.profiled for p in predictions) == 6
    assert info["simple_loo_mape_pct"] < 3
    # The profiled configurations' own estimate: start-up, ramp, steady minibatches, tail.
    first = profile_estimate([p for p in passes if p["config"] == profiled[0]])
    assert first is not None and first["later_energy_j"] > 0


def test_the_training_s_cpu_beside_workers_is_fitted_apart() -> None:
    """On a small machine the training takes more CPU beside its loader workers than alone.

    With a profile per (workers or not) × (smallest, largest batch) and the steady minibatches'
    own CPU recorded, the predictor fits the training's CPU apart for the two and recovers the
    relation; from the passes' CPU alone (stored without it) it pools them and misses.
    """
    grid = Grid(batch=[8, 32, 128], workers=[0, 1, 4], storage=["tmpfs"])
    configs = grid.configs()
    items = 4096
    profiled = choose_profiled(configs, 4)
    # Every line the simple model fits in the batch gets both ends of the batch range.
    assert {(configs[i].workers > 0, configs[i].batch) for i in profiled} == {
        (False, 8), (False, 128), (True, 8), (True, 128)}

    def errors(steady_cpu: bool) -> list[float]:
        passes = [_synthetic_pass(i, configs[i], p, items, 12, contention=0.6,
                                  steady_cpu=steady_cpu) for i in profiled
                  for p in ("cold", "warm")]
        predictions, _ = predict_all(configs, passes, items=items, all_cores=2,
                                     tmpfs={"tmpfs": True}, method="simple")
        out = []
        for pred in predictions:
            k = configs[pred.config]
            true_s = _synthetic_pass(pred.config, k, "warm", items, math.ceil(items / k.batch),
                                     epoch=True, contention=0.6)["wall_ns"] / 1e9
            out.append(abs(pred.epochs["later"]["predicted_s"] - true_s) / true_s)
        return out

    assert max(errors(True)) < 0.01
    assert max(errors(False)) > 0.05  # pooled, the contention is averaged away


def test_a_precision_profiled_at_one_batch_takes_another_s_growth_with_the_batch() -> None:
    """A step with a large fixed part: one batch size alone would give a line through 0.

    AMP is profiled at batch 8 and 128 (C = 2 ms + 0.5 ms·B), fp32 at 32 only, 1.5× as long;
    fp32's line takes AMP's shape at its own level, so batch 8 and 128 come out right where
    a line through the origin misses by a quarter at batch 8.
    """
    profiled = [Knobs(batch=8, precision="amp"), Knobs(batch=128, precision="amp"),
                Knobs(batch=32, precision="fp32")]
    passes = []
    for i, k in enumerate(profiled):
        for name in ("cold", "warm"):
            data = _synthetic_pass(i, k, name, 4096, 12)
            if k.precision == "fp32":
                for step in data["steps"]:
                    for phase in ("forward_ns", "backward_ns", "optimizer_ns"):
                        step[phase] = round(step[phase] * 1.5)
            passes.append(data)
    comps = fit_components(passes, all_cores=2)
    a, b = comps.compute[(2, "fp32")]
    for batch in (8, 32, 128):
        assert a + b * batch == pytest.approx(1.5 * (2e-3 + 0.5e-3 * batch), rel=0.02)
    a, b = comps.compute[(2, "amp")]
    assert a == pytest.approx(2e-3, rel=0.05) and b == pytest.approx(0.5e-3, rel=0.02)
    # The energy per minibatch (0.02 J + 0.004 J per item, `_energy`) likewise.
    assert comps.energy is not None
    a, b = comps.energy["dynamic"]["fp32"]
    for batch in (8, 128):
        assert a + b * batch == pytest.approx(0.02 + 0.004 * batch, rel=0.05)


def test_noisy_energy_reads_keep_the_line_that_predicts_the_profiles_left_out() -> None:
    """Eight sub-second energy reads with ±4% noise, AMP profiled at one batch size, as an
    H100's profiles were: the dynamic energy grows with the items (0.05 J per item in fp32,
    0.025 in AMP, a static 110 W). The line per item predicts the rows left out better and is
    kept, and an epoch at batch sizes not profiled comes out within 10% in both precisions
    (the per-minibatch line, fitted on the same reads, puts AMP at batch 16 56% high)."""
    profiled = [Knobs(batch=32, workers=2), Knobs(batch=64, workers=2),
                Knobs(batch=64, workers=4, precision="amp"),
                Knobs(batch=64, workers=8, precision="amp")]
    per_item = {"fp32": 0.05, "amp": 0.025}
    noise = iter([1.04, 0.97, 1.03, 0.96, 0.96, 1.03, 1.02, 0.98])
    passes = []
    for i, k in enumerate(profiled):
        for name in ("cold", "warm"):
            data = _synthetic_pass(i, k, name, 4096, 12)
            data["energy_j"] = (110.0 * data["wall_ns"] / 1e9
                                + 12 * k.batch * per_item[k.precision]) * next(noise)
            passes.append(data)
    comps = fit_components(passes, all_cores=2)
    assert comps.energy is not None and comps.energy["line"] == "per item"
    for precision, e in per_item.items():
        a, b = comps.energy["dynamic"][precision]
        for batch, steps in ((16, 256), (128, 32)):  # an epoch of 4,096 items in 2 s
            got = comps.energy["static_w"] * 2.0 + steps * (a + b * batch)
            assert got == pytest.approx(110.0 * 2.0 + steps * batch * e, rel=0.1), (precision,
                                                                                    batch)


def test_an_energy_line_that_falls_with_the_batch_is_not_kept() -> None:
    """Sub-second reads can make batch 128's minibatches look cheaper than batch 32's (an
    H200 run: the per-minibatch line went negative at 128 and an epoch was predicted under
    the static power). A line whose dynamic energy falls with the batch is not physical: the
    per-item line is kept, and no epoch's energy comes out under its static power × time."""
    from infermux.train.components import _energy_lstsq

    dyn = {32: 1.0, 128: 0.9}  # J per minibatch, as the noisy reads had it
    rows = [(t, 12, b, "fp32", 130.0 * t + 12 * dyn[b])
            for b, times in ((32, (0.4, 0.6, 0.9)), (128, (0.5, 0.7, 1.1))) for t in times]
    assert _energy_lstsq(rows, ["fp32"], ["fp32"], per_item=False) is None
    per_item = _energy_lstsq(rows, ["fp32"], [], per_item=True)
    assert per_item is not None and per_item[1]["fp32"][1] > 0
    profiled = [Knobs(batch=32, workers=2), Knobs(batch=128, workers=2)]
    passes = []
    for i, k in enumerate(profiled):
        for name in ("cold", "warm"):
            data = _synthetic_pass(i, k, name, 4096, 12)
            data["energy_j"] = 130.0 * data["wall_ns"] / 1e9 + 12 * dyn[k.batch]
            passes.append(data)
    comps = fit_components(passes, all_cores=2)
    assert comps.energy is not None
    a, b = comps.energy["dynamic"]["fp32"]
    assert b >= 0 and a + b * 128 >= 0
    epoch = comps.energy_for(Knobs(batch=128, workers=2), 2.0, 32)
    assert epoch is not None and epoch >= comps.energy["static_w"] * 2.0


def test_a_rare_stall_in_a_short_profile_does_not_move_the_compute_line() -> None:
    """One steady minibatch of twenty stalls for 20× its compute (a host hiccup): the line
    fitted from the profiles stays on the relation; the plain mean would about double it."""
    profiled = [Knobs(batch=8), Knobs(batch=128)]
    passes = []
    for i, k in enumerate(profiled):
        for name in ("cold", "warm"):
            data = _synthetic_pass(i, k, name, 4096, 20)
            data["steps"][10]["backward_ns"] += round(20 * (2e-3 + 0.5e-3 * k.batch) * 1e9)
            passes.append(data)
    a, b = fit_components(passes, all_cores=2).compute[(2, "fp32")]
    for batch in (8, 128):
        assert a + b * batch == pytest.approx(2e-3 + 0.5e-3 * batch, rel=0.02)


def test_a_cell_whose_candidate_is_passed_over_gets_another_of_its_configurations() -> None:
    from infermux.train.run import cell_first

    grid = Grid(batch=[16, 64], workers=[0, 2], storage=["tmpfs", "disk"],
                cores=[(0,), (0, 1)])
    configs = grid.configs()
    order = covering_order(configs, 8)
    passed, rest = order[0], order[1:]
    twin = next(j for j in rest if model_cell(configs[j]) == model_cell(configs[passed]))
    again = cell_first(configs, rest, passed)
    # The passed-over configuration's cell-mate goes next; the others keep their order.
    assert again[0] == twin and sorted(again) == sorted(rest)
    assert [j for j in again if j != twin] == [j for j in rest if j != twin]


def test_the_start_up_term_is_recovered_where_it_dominates() -> None:
    """Short epochs with many workers: start-up is most of the epoch, and still predicted."""
    grid = Grid(batch=[32, 64], workers=[0, 2, 4, 8], storage=["tmpfs"])
    configs = grid.configs()
    items = 512  # 4-16 minibatches: 8 workers take a third of the epoch to start
    profiled = [i for i, k in enumerate(configs)
                if (k.workers, k.batch) in ((0, 32), (2, 64), (8, 32))]
    passes = [_synthetic_pass(i, configs[i], p, items, 10) for i in profiled
              for p in ("cold", "warm")]
    predictions, _ = predict_all(configs, passes, items=items, all_cores=2,
                                 tmpfs={"tmpfs": True}, method="simple")
    for pred in predictions:
        knobs = configs[pred.config]
        truth = _synthetic_pass(pred.config, knobs, "warm", items,
                                math.ceil(items / knobs.batch), epoch=True)["wall_ns"] / 1e9
        start = _relation(knobs, "warm")["startup"]
        assert abs(pred.epochs["later"]["predicted_s"] - truth) / truth < 0.01, knobs.label
        if knobs.workers == 8:
            assert start > 0.3 * truth  # the term the old per-minibatch model could not see


def test_the_learned_model_corrects_what_the_simple_model_misses() -> None:
    pytest.importorskip("sklearn")
    grid = Grid(batch=[8, 32, 128], workers=[0, 1, 4], storage=["disk", "tmpfs"],
                persistent_workers=[False, True])
    configs = grid.configs()
    items = 4096

    def passes_for(indices: list[int], steps: int, epoch: bool = False) -> list[dict]:
        # Persistent workers: a 30% faster steady minibatch the simple model cannot see.
        return [_synthetic_pass(i, configs[i], p, items, steps, epoch=epoch,
                                slow=0.7 if configs[i].persistent_workers else 1.0)
                for i in indices for p in ("cold", "warm")]

    profiled = choose_profiled(configs, 10)
    predictions, info = predict_all(configs, passes_for(profiled, 12), items=items,
                                    all_cores=2, tmpfs={"disk": False, "tmpfs": True},
                                    method="learned")
    assert info["chosen"] == "learned"
    truth = {i: passes_for([i], math.ceil(items / k.batch), epoch=True)
             for i, k in enumerate(configs)}
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
    # One loader per profile: the cold half starts it, the warm half continues and stops it.
    for cold, warm in zip(report["passes"][::2], report["passes"][1::2], strict=True):
        assert cold["split"] and warm["split"] and warm["startup_ns"] == 0
        assert cold["tail_ns"] == 0 and (cold["steps"], warm["steps"]) == (4, 3)  # ramp 1 + 3, 3
    with sqlite3.connect(db) as con:
        kind = con.execute("SELECT kind, status FROM runs WHERE id = ?",
                           (report["run_id"],)).fetchone()
        steps = con.execute("SELECT COUNT(*) FROM train_steps WHERE run_id = ?",
                            (report["run_id"],)).fetchone()[0]
    assert kind == ("train", "complete")
    assert steps == sum(p["steps"] for p in report["passes"])
    main(["train-predict", *common, "--profile-steps", "6", "--validate", "all",
          "--whole-epochs-below", "0"])
    table = capsys.readouterr().out
    assert "Predicted epochs" in table and "validated on 2 of 2 held-out" in table
    assert "leave-one-configuration-out error" in table
    assert "Where the time goes" in table
    assert "profile budget: largest profile" in table  # checked against the rule, and said
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT COUNT(*), COUNT(measured_s) FROM train_predictions").fetchone()
    assert rows == (8, 4)  # 4 configurations × first/later; the 2 held out were measured
    # Offline, from the stored profiles and epochs: the same predictions and scores.
    with Store(db) as store:
        again = repredict(store, 2)
        stored = {(r[0], r[1]): r[2] for r in store.connection.execute(
            "SELECT label, epoch, predicted_s FROM train_predictions WHERE run_id = 2")}
    assert again["scores"]["configurations"] == 2
    # Before each validated configuration and after it, what it was predicted from at its own
    # batch was measured again: the two held out are of batch 16, which no profile reached
    # (96 items: a thin profile of each batch-8 configuration), so its compute probe (kind
    # `drift:N`, never fitted on: the re-prediction below matches the stored one); the probe
    # after the first is the second's before. The machine's drift beside each epoch, measured.
    with sqlite3.connect(db) as con:
        probes = con.execute("SELECT label, kind, pass FROM train_passes WHERE run_id = 2 AND "
                             "kind LIKE 'drift:%' ORDER BY rowid").fetchall()
        compute = con.execute("SELECT label FROM train_passes WHERE run_id = 2 AND "
                              "kind = 'compute'").fetchall()
    assert [k for _, k, _ in probes] == ["drift:0", "drift:1", "drift:3"]
    assert {label for label, _, _ in probes} == {label for (label,) in compute}
    assert again["drift"]["label"] == "compute probe b16 fp32"
    assert again["drift"]["before_ms"] > 0 and again["drift"]["ratio"] == pytest.approx(
        again["drift"]["after_ms"] / again["drift"]["before_ms"])
    assert len(again["drift"]["probes"]) == 3
    # Every validated epoch carries the drift beside it, and the scores say what it moved.
    measured = [r for r in again["predictions"] if r["measured_s"]]
    assert measured and all(r["drift"] and r["drift"] > 0 for r in measured)
    # With its noise (from the reference's own minibatches), and whether it stood out of it.
    assert all(r["drift_se"] > 0 and isinstance(r["drift_resolved"], bool) for r in measured)
    assert again["scores"]["later_time_mape_drift_corrected_pct"] is not None
    # Offline too, each validated epoch's error cut into the model's terms, adding up to it.
    rows = again["attribution"]["epochs"]
    assert sorted((r["label"], r["epoch"]) for r in rows) == sorted(
        (r["label"], r["epoch"]) for r in measured)
    for r in rows:
        assert sum(r["parts_s"].values()) == pytest.approx(r["measured_s"] - r["predicted_s"],
                                                           abs=1e-3)
        # The drift part is the drift applied (1 where within its noise): predicted × (it − 1).
        assert r["drift"] and r["parts_s"]["drift"] == pytest.approx(
            r["predicted_s"] * (r["drift"] - 1), abs=1e-5)
    for row in again["predictions"]:
        assert row["predicted_s"] == pytest.approx(stored[(row["label"], row["epoch"])],
                                                   rel=1e-9)


def test_open_dataset_needs_an_image_shaped_model(images: Path) -> None:
    with pytest.raises(UsageError, match="3×H×W"):
        open_dataset(images, (10,))
