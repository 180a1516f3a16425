"""The predictor on networks it was not developed with: four architectures, two data set sizes.

A mobile network, an EfficientNet, a RegNet or ConvNeXt and a ViT (torchvision's, random
weights), each on a small data set (short epochs: the profile rule cannot reach every model
cell, so the run profiles thinner or measures whole epochs, and says which) and a larger one,
each run fresh: `train-predict` profiles, predicts every configuration's first and later epoch,
and validates held-out configurations (drawn at random, one model cell at a time) with the
reference configuration re-profiled between them for the machine's drift. For each run: MAPE of
time and energy (as measured and corrected for drift), how many configurations were validated of
how many held out, the profile budget, the verdict on the rule, the drift (beyond ±10% the time
MAPE corrected for it beside the raw one), and where a target is missed (10% time, 15% energy)
the term of the model that missed it (train-predict's attribution: drift, start-up, compute,
loader, contention; measured from the validated epochs' own minibatches), also for each epoch
missed by more than 10% (`targets` and `misses` in the JSON). The first network of each data set
is the reference the others' learned correction is transferred from (kept only where its
leave-one-configuration-out error beats the simple model's). Everything goes to
`OUT/train-nets.db` and `OUT/train-nets.json` (rewritten after each run, so a run cut short
keeps what it measured; its `status` says whether it was); the images to `--data-dir` (a
temporary folder by default, not OUT), every data set written and the device started before
the first run is planned (`prepared_s`). The command plans against `--budget-s`: each run gets a
share of what is left (weighted by its data set's pixels), its profiles at most half of it, and
its whole epochs and validated configurations start only where they are expected to end within
it (each against `PLAN_SHARE` of the budget, so the command ends within it); past the budget by
`GRACE_S` (or on SIGTERM) the run in progress is cut and the JSON written.

Each validated epoch's drift is measured at its own batch (its batch's compute probe or a
profile of its batch re-measured beside it; the reference configuration only where its batch
has no figure of its own), the compute probes read the device's power at their batch, and
each run says per configuration where its energy prediction's power came from
(`power_sources`) and which probe corrected which epoch (`drift_by_config`). Beside the
probes, the machine's own speed by fixed reference work (one core's Python loop and, on a GPU,
a fixed FP16 product), read after the profiles and after each validated configuration, with a
spread of a few percent: the `machine` column (each reading over the first's, the wider range
of the two) says whether the machine itself stayed within ±10% where the step probes' noise
cannot (`infermux.train.reference`).

    # GPU (one command, ≤ 7 min on an H100 host; only the image's torch, torchvision, numpy,
    # psutil and nvidia-ml-py are needed)
    python bench/train_nets.py --unit cuda:0 --out gpu-nets --budget-s 400
    # CPU (one core of a two-core machine; ≤ 10 min, fewer validated epochs than its 25 min
    # default budget)
    python bench/train_nets.py --unit cpu --out cpu-nets --budget-s 540
    python bench/train_nets.py --unit cpu --out cpu-quick --quick   # a smoke check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from infermux.errors import InfermuxError
from infermux.models import ModelSpec
from infermux.store import Store
from infermux.train import DataSpec, Grid, TrainConfig, run_train_predict
from infermux.train.profile import prepare
from train_common import print_figure, summary

HERE = Path(__file__).resolve().parent

#: Per unit: networks (`vit` is `train_models.py:vit_SIZE`), data sets (images×side), the grid.
DEFAULTS = {
    "gpu": {"models": "mobilenet_v3_large,efficientnet_b0,regnet_y_400mf,vit",
            "datasets": "6000x64,24000x96", "batch": "32,128", "workers": "2,8",
            "precision": "fp32,amp", "budget_s": 400.0},
    "cpu": {"models": "mobilenet_v3_small,efficientnet_b0,regnet_x_400mf,vit",
            "datasets": "800x32,3200x32", "batch": "16,64", "workers": "1,2",
            "precision": "fp32", "budget_s": 1500.0},
}
#: How far past `--budget-s` the run in progress may go before it is cut (its passes stay in
#: the store; the JSON says `cut`).
GRACE_S = 15.0
#: The runs are planned against this share of `--budget-s`: a run's profiles, warm-ups and
#: compute probes are bounded only by estimates made before them, and the command as a whole
#: is to end within its budget, not at it plus a grace.
PLAN_SHARE = 0.9
#: Of a run's share, at most this much for its profiles (`TrainConfig.budget_s`).
PROFILE_SHARE_OF_RUN = 0.5
#: Below this many seconds of the budget, a run is not started.
MIN_RUN_S = 20.0


class _Cut(KeyboardInterrupt):
    """The budget's grace ran out, or the process was asked to stop: write what there is."""


def _model(name: str, size: int) -> str:
    return f"{HERE / 'train_models.py'}:vit_{size}" if name == "vit" else name


def prepare_all(configs: list[TrainConfig], unit: str, say: Any) -> float:
    """Write each config's data set and start the device; the seconds it took.

    `train.profile.prepare` writes a synthetic data set once (a later run finds it) and loads
    the model; a CUDA unit's context is made by a first tensor on it.
    """
    began = time.perf_counter()
    if unit.startswith("cuda"):
        import torch

        say(f"starting {unit}")
        torch.ones(1, device=unit.split("/")[0]).sum().item()
    for config in configs:
        say(f"preparing {config.data.count}x{config.data.size}: its images")
        prepare(config).close()
    return time.perf_counter() - began


def _weight(images: int, size: int) -> float:
    """A run's share of the budget: a fixed part (start-up, profiles) and one per pixel."""
    return 1.0 + images * size * size / (6000 * 64 * 64)


def run_share_s(left_s: float, runs: list[tuple[str, int, int]]) -> float:
    """The first of `runs`' share of `left_s`: half split evenly, half by its data set's pixels."""
    weights = [_weight(images, size) for _, images, size in runs]
    return left_s * (0.5 / len(runs) + 0.5 * weights[0] / sum(weights))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--unit", default="cuda:0", help="cuda:N or cpu")
    parser.add_argument("--models", default=None, help="comma list (default per unit)")
    parser.add_argument("--datasets", default=None,
                        help="images×side per data set, e.g. 6000x64,24000x96")
    parser.add_argument("--batch", default=None)
    parser.add_argument("--workers", default=None)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--cores", default=None,
                        help="CPU only: the core set to train on (default: the first usable "
                             "core; two intra-op threads on a shared two-core machine spin "
                             "while others run, up to 20× slower per minibatch)")
    parser.add_argument("--profile-share", type=float, default=0.1)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole command's time (GPU default 400, CPU 1500): each run "
                             "gets a share of what is left of 90% of it; past it by 15 s the "
                             "run in progress is cut")
    parser.add_argument("--data-dir", default=None,
                        help="where the synthetic images are written (default: a folder in "
                             "the system's temporary directory, reused between runs)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke check: one network, one small data set, 120 s")
    args = parser.parse_args()
    d = DEFAULTS["cpu" if args.unit == "cpu" else "gpu"]
    models = (args.models or d["models"]).split(",")
    datasets = [tuple(int(v) for v in s.split("x")) for s in (args.datasets
                                                              or d["datasets"]).split(",")]
    batch = [int(b) for b in (args.batch or d["batch"]).split(",")]
    workers = [int(w) for w in (args.workers or d["workers"]).split(",")]
    precision = (args.precision or d["precision"]).split(",")
    budget_s = args.budget_s or d["budget_s"]
    cores: list[tuple[int, ...] | None] = [None]
    if args.unit == "cpu":
        cores = [tuple(int(c) for c in args.cores.split(",")) if args.cores
                 else (min(os.sched_getaffinity(0)),)]
    if args.quick:
        models, datasets, budget_s = models[:1], datasets[:1], args.budget_s or 120.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir or Path(tempfile.gettempdir()) / "infermux-train-nets-data")
    runs = [(m, n, s) for n, s in datasets for m in models]
    started = time.time()
    # The first network of each data set is the transfer's reference for the others (the
    # learned correction needs scikit-learn; without it, the simple model alone).
    method = "auto" if importlib.util.find_spec("sklearn") else "simple"
    doc: dict[str, Any] = {
        "status": "running", "command": " ".join(sys.argv), "unit": args.unit,
        "budget_s": budget_s, "method": method,
        "plan": [f"{m} {n}x{s}" for m, n, s in runs], "skipped": [], "failed": {},
        "runs": {}}
    results: dict[str, dict] = doc["runs"]

    def write() -> None:
        doc["elapsed_s"] = time.time() - started
        tmp = out / "train-nets.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(out / "train-nets.json")

    def cut(signum: int, _frame: Any) -> None:
        raise _Cut(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, cut)
    signal.signal(signal.SIGALRM, cut)
    signal.alarm(int(budget_s + GRACE_S))
    references: dict[tuple[int, int], int] = {}

    def make_config(name: str, images: int, size: int, profile_budget_s: float) -> TrainConfig:
        return TrainConfig(
            ModelSpec(_model(name, size), input_shape=(3, size, size)),
            Grid(batch=batch, workers=workers, pin_memory=[args.unit.startswith("cuda")],
                 storage=["disk"], cores=cores, precision=precision),
            data=DataSpec(count=images, size=size, classes=args.classes),
            unit=args.unit, disk_dir=str(data_dir), profile_steps=400,
            profile_share=args.profile_share, budget_s=profile_budget_s)

    write()
    try:
        # Before any run is given its share: every data set's images written and the device
        # started, so that neither is charged to the first run of a data set (whose share is
        # planned for its profiles and validated epochs, and on a GPU host went to them).
        doc["prepared_s"] = prepare_all(
            [make_config(name, images, size, 1.0) for name, images, size
             in {(n, s): (m, n, s) for m, n, s in runs}.values()],
            args.unit, lambda label: print(f"[{time.time() - started:5.0f}s] {label}",
                                           flush=True))
        write()
        with Store(out / "train-nets.db") as store:
            for k, (name, images, size) in enumerate(runs):
                key = f"{name} {images}x{size}"
                left = PLAN_SHARE * budget_s - (time.time() - started)
                if left < MIN_RUN_S:
                    print(f"skipping {key}: {left:.0f} s of the budget left", flush=True)
                    doc["skipped"].append(key)
                    continue
                share_s = run_share_s(left, runs[k:])
                config = make_config(name, images, size, PROFILE_SHARE_OF_RUN * share_s)
                doc["current"] = {"run": key, "share_s": share_s}
                write()
                try:
                    report = run_train_predict(
                        config, store=store, validate=None, deadline_s=share_s,
                        method=method, reference_run=references.get((images, size))
                        if method != "simple" else None, command=" ".join(sys.argv),
                        progress=lambda label, f, key=key: print(
                            f"[{time.time() - started:5.0f}s] {key}: {label}", flush=True))
                # One network failing (a run error, the device's, a model's arithmetic) leaves
                # the others' figures.
                except (InfermuxError, RuntimeError, OSError, ArithmeticError, LookupError,
                        ValueError) as e:
                    traceback.print_exc()
                    doc["failed"][key] = f"{type(e).__name__}: {e}"
                    doc.pop("current", None)
                    write()
                    continue
                if report.run_id is not None:
                    references.setdefault((images, size), report.run_id)
                results[key] = summary(report, started, vars(args) | {
                    "model": name, "images": images, "size": size, "share_s": share_s})
                results[key]["targets"] = targets(results[key])
                doc.pop("current", None)
                print_figure(key, results[key])
                write()
        doc["status"] = "complete" if not doc["failed"] else "complete, with failures"
    except _Cut as e:
        doc["status"] = f"cut ({e}) during {doc.get('current', {}).get('run')}"
        print(f"\n{doc['status']}: {len(results)} run(s) kept", flush=True)
    finally:
        signal.alarm(0)
        write()
    print("\n" + _table(results))
    for key, fig in results.items():
        for line in fig["targets"]["said"]:
            print(f"{key}: {line}")
    print(f"wrote {out / 'train-nets.json'} ({doc['status']}) in {time.time() - started:.0f} s")
    if not doc["status"].startswith("complete"):
        sys.exit(3)


def targets(fig: dict[str, Any]) -> dict[str, Any]:
    """The run against the targets: drift within ±10%, MAPE ≤ 10% time, ≤ 15% energy.

    Where the drift is beyond ±10% the time MAPE is given as measured and corrected for it;
    where a target is missed, the term of the model that missed it (train-predict's
    attribution, from the validated epochs' own minibatches).
    """
    s, dr = fig["scores"], fig.get("drift") or {}
    rng = dr.get("range")
    # A drift counts where it stands out of the probes' own noise (`infermux.train.drift`):
    # the range of the drifts applied to the validated epochs (1 where within the noise).
    applied = dr.get("applied_range", rng)
    drift_ok = None if not applied else max(abs(r - 1) for r in applied) <= 0.1
    out: dict[str, Any] = {"drift_range": rng, "drift_applied_range": applied,
                           "drift_noise_pct": (200 * dr["noise_se_log"]
                                               if dr.get("noise_se_log") is not None else None),
                           "drift_within_10pct": drift_ok, "said": []}
    if drift_ok is False:
        out["said"].append(
            f"drift {applied[0]:.2f}-{applied[1]:.2f}x (beyond its noise) is beyond ±10%: time "
            f"MAPE first/later {_pct(s['first_time_mape_pct'])} / "
            f"{_pct(s['later_time_mape_pct'])} as measured, "
            f"{_pct(s.get('first_time_mape_drift_corrected_pct'))} / "
            f"{_pct(s.get('later_time_mape_drift_corrected_pct'))} corrected for it")
    elif rng and applied and max(abs(r - 1) for r in rng) > 0.1:
        # The drift applied to an epoch is its configuration's probes' together (their mean),
        # and only where it stands out of their noise: a single probe may read past ±10%.
        out["said"].append(
            f"probes read {rng[0]:.2f}-{rng[1]:.2f}x one by one; the drifts applied to the "
            f"validated epochs (each configuration's probes together, where out of their noise, "
            f"±{_pct(out['drift_noise_pct'])}) are {applied[0]:.2f}-{applied[1]:.2f}x, "
            "within ±10%")
    # The machine's own speed (fixed reference work, `infermux.train.reference`): whether it
    # stayed within ±10% between the profiles and the validated epochs, whatever the step
    # probes' noise let them show.
    machine = fig.get("machine_drift") or {}
    out["machine_range"] = _machine_range(machine)
    out["machine_within_10pct"] = machine.get("within_10pct")
    if machine.get("within_10pct") is False:
        out["said"].append(
            "the machine's own speed moved past ±10% beside the validation (reference work: "
            + "; ".join(f"{k} {r['range'][0]:.2f}-{r['range'][1]:.2f}x"
                        for k, r in machine["by_reference"].items()) + ")")
    for epoch in ("first", "later"):
        t, e = s[f"{epoch}_time_mape_pct"], s[f"{epoch}_energy_mape_pct"]
        out[f"{epoch}_time_ok"] = None if t is None else t <= 10.0
        out[f"{epoch}_energy_ok"] = None if e is None else e <= 15.0
        att = (fig.get("missed") or {}).get(epoch)
        if att is not None:
            out[f"{epoch}_term"] = att["term"] if att["time_missed"] else None
            out[f"{epoch}_energy_term"] = (att.get("energy_term")
                                           if att.get("energy_missed") else None)
            if att["time_missed"] or att.get("energy_missed"):
                out["said"].append(f"{epoch} epochs: {att['verdict']}")
    return out


def _machine_range(machine: dict[str, Any]) -> list[float] | None:
    """The widest range over the machine's reference works' readings (over the first's)."""
    ranges = [r["range"] for r in (machine.get("by_reference") or {}).values()]
    return [min(r[0] for r in ranges), max(r[1] for r in ranges)] if ranges else None


def _pct(v: float | None) -> str:
    return f"{v:.1f}%" if v is not None else "-"


def _table(results: dict[str, dict]) -> str:
    """One line per run: MAPE (time three ways, energy), the subset, the drift, the plan.

    Time as measured, corrected for drift, and over the configurations of profiled cells only;
    a drift beyond ±10% and out of the probes' noise is marked `!`, and the row's verdict then
    rests on the corrected column.
    """

    def pct(v: float | None) -> str:
        return f"{v:5.1f}" if v is not None else "    -"

    lines = [f"{'run':<34} {'time 1st/later %':>17} {'corrected %':>13} {'in cells %':>13} "
             f"{'energy %':>13} {'valid.':>7} {'drift':>12} {'probes':>8} {'machine':>10} plan"]
    for key, fig in results.items():
        s, dr = fig["scores"], fig.get("drift") or {}
        rng = dr.get("range")
        applied = dr.get("applied_range", rng)
        # `!`: beyond ±10% and out of the probes' noise (the drift corrected for).
        moved = bool(applied) and max(abs(r - 1) for r in applied) > 0.1
        drift = f"{rng[0]:.2f}-{rng[1]:.2f}{'!' if moved else ' '}" if rng else "-"
        m = _machine_range(fig.get("machine_drift") or {})
        machine = f"{m[0]:.2f}-{m[1]:.2f}" if m else "-"
        lines.append(
            f"{key:<34} {pct(s['first_time_mape_pct'])} / {pct(s['later_time_mape_pct'])} "
            f"{pct(s.get('first_time_mape_drift_corrected_pct'))} / "
            f"{pct(s.get('later_time_mape_drift_corrected_pct'))} "
            f"{pct(s.get('first_time_mape_in_cells_pct'))} / "
            f"{pct(s.get('later_time_mape_in_cells_pct'))} "
            f"{pct(s['first_energy_mape_pct'])} / {pct(s['later_energy_mape_pct'])} "
            f"{s['configurations']:>3}/{s.get('held_out', '?'):<3} "
            f"{drift:>12} {_bases(dr):>8} {machine:>10} {fig.get('profile_mode')}")
    return "\n".join(lines)


def _bases(drift: dict[str, Any]) -> str:
    """The validated epochs' drift probes: c compute probe, p profile of the batch, r reference."""
    bases = drift.get("bases") or {}
    return " ".join(f"{k[0]}{v}" for k, v in bases.items()) or "-"


if __name__ == "__main__":
    main()
