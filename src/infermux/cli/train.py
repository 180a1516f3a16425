"""`infermux train-profile` and `infermux train-predict`: training time and energy, measured and predicted."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape

from infermux.cli._app import DbOpt, JsonOpt, _print_json, _run_with_progress, app, err, out
from infermux.cli.render import num, phase_table, predict_table

__all__ = ["train_predict", "train_profile"]


ModelOpt = Annotated[str, typer.Option("--model", "-m", help="resnet18, timm:NAME, file.py:fn")]
UnitOpt = Annotated[str, typer.Option("--unit", "-u", help="cpu or cuda:N.")]
DataOpt = Annotated[str, typer.Option("--data", help="synthetic (JPEGs written here), an ImageFolder DIR, or a .pt/.npz tensor file.")]
ImagesOpt = Annotated[int, typer.Option("--images", help="Synthetic images to write.")]
SizeOpt = Annotated[int, typer.Option("--image-size", help="Synthetic image side, pixels.")]
ClassesOpt = Annotated[int, typer.Option("--classes", help="Synthetic classes.")]
FormatOpt = Annotated[str, typer.Option("--image-format", help="jpeg or png.")]
BatchOpt = Annotated[str, typer.Option("--batch", "-b", help="Minibatch sizes, e.g. 16,64.")]
WorkersOpt = Annotated[str, typer.Option("--workers", "-w", help="Loader workers, e.g. 0,1,2.")]
PrefetchOpt = Annotated[str, typer.Option("--prefetch", help="Batches prefetched per worker, e.g. 2,4.")]
PinOpt = Annotated[str, typer.Option("--pin-memory", help="false, true or false,true (CUDA only).")]
PersistOpt = Annotated[str, typer.Option("--persistent", help="Persistent workers: false, true or both.")]
StorageOpt = Annotated[str, typer.Option("--storage", help="Where the data lives: disk, tmpfs or a folder; comma list.")]
CoresOpt = Annotated[str, typer.Option("--cores", help="Core sets, e.g. 0,0-1, or all.")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="fp32, amp, bf16, fp16 (CUDA); comma list.")]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", help="sgd or adamw.")]
LrOpt = Annotated[float | None, typer.Option("--lr", help="Learning rate (default 0.01 SGD, 1e-3 AdamW).")]
StepsOpt = Annotated[int, typer.Option("--profile-steps", help="Most minibatches profiled per configuration (cold + warm).")]
ShareOpt = Annotated[float, typer.Option("--profile-share", help="Most share of an epoch profiled per configuration.")]
BudgetOpt = Annotated[str | None, typer.Option("--budget", help="Wall-time budget for the profiles, e.g. 10m.")]
DiskOpt = Annotated[str | None, typer.Option("--disk-dir", help="Folder of --storage disk (default: the infermux cache).")]
TelemetryOpt = Annotated[str, typer.Option("--telemetry", help="Sampler period (e.g. 100ms) or off.")]
WattsOpt = Annotated[float, typer.Option("--watts-per-core", help="CPU energy model where no counter is readable: W per busy core.")]
PowerOpt = Annotated[str | None, typer.Option("--power-mode", help="Jetson only: set this nvpmodel mode (id or name) first.")]
ClocksOpt = Annotated[bool, typer.Option("--jetson-clocks", help="Jetson only: pin clocks at their maximum after --power-mode.")]
InputOpt = Annotated[str | None, typer.Option("--input-shape", help="One item, e.g. 3x64x64.")]
WeightsOpt = Annotated[str | None, typer.Option("--weights", help="State dict or checkpoint file.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of data, subsets and weights.")]
NoStoreOpt = Annotated[bool, typer.Option("--no-store", help="Do not write the results database.")]


def _config(model: str, unit: str, data: str, images: int, image_size: int, classes: int,
            image_format: str, batch: str, workers: str, prefetch: str, pin_memory: str,
            persistent: str, storage: str, cores: str, precision: str, optimizer: str,
            lr: float | None, profile_steps: int, profile_share: float, budget: str | None,
            disk_dir: str | None, telemetry: str, watts_per_core: float,
            power_mode: str | None, jetson_clocks: bool, input_shape: str | None,
            weights: str | None, seed: int) -> Any:
    from infermux._parse import parse_duration_s, parse_shape
    from infermux.cli._app import _sampler_period_s
    from infermux.errors import UsageError
    from infermux.models import ModelSpec
    from infermux.train import DataSpec, Grid, TrainConfig
    from infermux.train.knobs import parse_bools, parse_cores, parse_ints

    storages = [s.strip() for s in storage.split(",") if s.strip()]
    if not storages:
        raise UsageError("--storage is empty: e.g. --storage disk,tmpfs")
    precisions = [p.strip() for p in precision.split(",") if p.strip()]
    if not precisions:
        raise UsageError("--precision is empty: e.g. --precision fp32")
    grid = Grid(batch=parse_ints(batch, "--batch", minimum=1),
                workers=parse_ints(workers, "--workers", minimum=0),
                prefetch_factor=parse_ints(prefetch, "--prefetch", minimum=1),
                pin_memory=parse_bools(pin_memory, "--pin-memory"),
                persistent_workers=parse_bools(persistent, "--persistent"),
                storage=storages, cores=parse_cores(cores), precision=precisions)
    source = "synthetic" if data.strip() == "synthetic" else data
    return TrainConfig(
        model=ModelSpec(model, weights, parse_shape(input_shape) if input_shape else None),
        grid=grid, data=DataSpec(source, images, image_size, classes, image_format, seed),
        unit=unit, optimizer=optimizer, lr=lr, profile_steps=profile_steps,
        profile_share=profile_share,
        budget_s=parse_duration_s(budget, name="--budget") if budget else None,
        disk_dir=disk_dir,
        telemetry_interval_s=None if telemetry.strip().lower() == "off" else _sampler_period_s(telemetry),
        watts_per_core=watts_per_core, power_mode=power_mode, jetson_clocks=jetson_clocks,
        seed=seed)


def _print_best(best: dict[str, Any]) -> None:
    if "time" in best:
        t = best["time"]
        out.print(f"[bold]best for time[/]: {escape(t['label'])} — later epoch "
                  f"{num(t['epoch_s'])} s (first {num(t['first_epoch_s'])} s)")
    if "energy" in best:
        e = best["energy"]
        modelled = " (modelled)" if str(e.get("energy_source", "")).startswith("modelled") else ""
        out.print(f"[bold]best for energy[/]: {escape(e['label'])} — later epoch "
                  f"{num(e['epoch_energy_j'], 1)} J{modelled}, {num(e['epoch_s'])} s")


@app.command("train-profile")
def train_profile(
    model: ModelOpt,
    unit: UnitOpt = "cpu",
    data: DataOpt = "synthetic",
    images: ImagesOpt = 2000,
    image_size: SizeOpt = 64,
    classes: ClassesOpt = 10,
    image_format: FormatOpt = "jpeg",
    batch: BatchOpt = "32",
    workers: WorkersOpt = "0,2",
    prefetch: PrefetchOpt = "2",
    pin_memory: PinOpt = "false",
    persistent: PersistOpt = "false",
    storage: StorageOpt = "disk",
    cores: CoresOpt = "all",
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "sgd",
    lr: LrOpt = None,
    profile_steps: StepsOpt = 80,
    profile_share: ShareOpt = 0.1,
    budget: BudgetOpt = None,
    disk_dir: DiskOpt = None,
    telemetry: TelemetryOpt = "100ms",
    watts_per_core: WattsOpt = 3.5,
    power_mode: PowerOpt = None,
    jetson_clocks: ClocksOpt = False,
    input_shape: InputOpt = None,
    weights: WeightsOpt = None,
    seed: SeedOpt = 0,
    db: DbOpt = "infermux.db",
    no_store: NoStoreOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Profile training over a grid of loader and step knobs: phases, energy, best settings."""
    from infermux.train import run_train_profile

    config = _config(model, unit, data, images, image_size, classes, image_format, batch,
                     workers, prefetch, pin_memory, persistent, storage, cores, precision,
                     optimizer, lr, profile_steps, profile_share, budget, disk_dir, telemetry,
                     watts_per_core, power_mode, jetson_clocks, input_shape, weights, seed)
    report = _run_with_progress(run_train_profile, config, db=db, no_store=no_store)
    data_out = report.to_dict()
    if as_json:
        _print_json(data_out)
        return
    out.print(phase_table(data_out["passes"]))
    _print_best(report.best)
    mode = report.power
    out.print(f"[dim]power mode: {mode.name or 'none'}"
              f"{f' (id {mode.mode_id})' if mode.mode_id is not None else ''}; "
              f"{report.dataset_items} items per epoch; cold = page cache dropped first[/]")
    for note in report.notes:
        out.print(f"[dim]{escape(note)}[/]")
    if report.run_id is not None:
        out.print(f"[dim]stored as run {report.run_id} in {db}[/]")
    if report.status == "failed":
        err.print("no configuration could be measured: see the errors above")
        raise typer.Exit(1)


@app.command("train-predict")
def train_predict(
    model: ModelOpt,
    unit: UnitOpt = "cpu",
    data: DataOpt = "synthetic",
    images: ImagesOpt = 2000,
    image_size: SizeOpt = 64,
    classes: ClassesOpt = 10,
    image_format: FormatOpt = "jpeg",
    batch: BatchOpt = "16,64",
    workers: WorkersOpt = "0,1,2",
    prefetch: PrefetchOpt = "2",
    pin_memory: PinOpt = "false",
    persistent: PersistOpt = "false",
    storage: StorageOpt = "disk",
    cores: CoresOpt = "all",
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = "sgd",
    lr: LrOpt = None,
    profile_steps: StepsOpt = 80,
    profile_share: ShareOpt = 0.1,
    budget: BudgetOpt = None,
    disk_dir: DiskOpt = None,
    telemetry: TelemetryOpt = "100ms",
    watts_per_core: WattsOpt = 3.5,
    power_mode: PowerOpt = None,
    jetson_clocks: ClocksOpt = False,
    input_shape: InputOpt = None,
    weights: WeightsOpt = None,
    seed: SeedOpt = 0,
    profile_configs: Annotated[int | None, typer.Option("--profile-configs", help="Configurations to profile (default a third of the grid).")] = None,
    from_run: Annotated[int | None, typer.Option("--from", help="Use the profiles of this stored run instead of profiling.")] = None,
    reference: Annotated[int | None, typer.Option("--reference", help="A stored run of another network to transfer the learned model from.")] = None,
    method: Annotated[str, typer.Option("--method", help="auto, simple or learned.")] = "auto",
    validate: Annotated[str, typer.Option("--validate", help="Held-out configurations to train for two full epochs and score: a count, all, or 0.")] = "0",
    validate_budget: Annotated[str | None, typer.Option("--validate-budget", help="Validate held-out configurations (in a seeded random order, one model cell at a time) until this much time is spent, e.g. 5m.")] = None,
    whole_epochs_below: Annotated[str, typer.Option("--whole-epochs-below", help="Where no profile within the rule reaches a model cell, measure whole epochs of one of its configurations if an epoch takes at most this long (e.g. 10s; 0 = never).")] = "10s",
    deadline: Annotated[str | None, typer.Option("--deadline", help="The whole command's time, e.g. 8m: whole epochs and validated configurations start only where they are expected to end within it (profiles are bounded by --budget).")] = None,
    settle: Annotated[str, typer.Option("--settle", help="Before the first profile (the drift reference), train on one batch until its step time settles, for at most this long (e.g. 3s; 0 = not at all).")] = "3s",
    compute_probes: Annotated[bool, typer.Option("--compute-probes/--no-compute-probes", help="Measure a few minibatches (no loader workers) of each batch size no profile reached, so its compute is measured, not extrapolated from other batch sizes (counted in the profile budget).")] = True,
    db: DbOpt = "infermux.db",
    no_store: NoStoreOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Predict every configuration's epoch time and energy from short profiles of a few."""
    from infermux.errors import UsageError
    from infermux.train import run_train_predict

    config = _config(model, unit, data, images, image_size, classes, image_format, batch,
                     workers, prefetch, pin_memory, persistent, storage, cores, precision,
                     optimizer, lr, profile_steps, profile_share, budget, disk_dir, telemetry,
                     watts_per_core, power_mode, jetson_clocks, input_shape, weights, seed)
    if validate.strip() == "all":
        count: int | None = None
    else:
        try:
            count = int(validate)
        except ValueError:
            raise UsageError(f"--validate {validate!r} is not a count: give a number of held-out "
                             "configurations, all, or 0") from None
    from infermux._parse import parse_duration_s

    validate_budget_s = (parse_duration_s(validate_budget, name="--validate-budget")
                         if validate_budget else None)
    whole_epoch_s = (0.0 if whole_epochs_below.strip() == "0"
                     else parse_duration_s(whole_epochs_below, name="--whole-epochs-below"))
    deadline_s = parse_duration_s(deadline, name="--deadline") if deadline else None
    config.settle_s = (0.0 if settle.strip() == "0"
                       else parse_duration_s(settle, name="--settle"))
    report = _run_with_progress(run_train_predict, config, db=db, no_store=no_store,
                                profile_configs=profile_configs, from_run=from_run,
                                reference_run=reference, method=method, validate=count,
                                validate_budget_s=validate_budget_s, whole_epoch_s=whole_epoch_s,
                                deadline_s=deadline_s, compute_probes=compute_probes)
    data_out = report.to_dict()
    if as_json:
        _print_json(data_out)
        return
    if data_out["profile_passes"]:
        out.print(phase_table(data_out["profile_passes"]))
    out.print(predict_table(data_out))
    info, scores = data_out["model_info"], data_out["scores"]
    learned = info.get("learned") or {}
    # Every error named leave-one-out here is one: the configuration scored was left out of
    # every fitted part (`predict.predict_all`).
    out.print(f"predictor: [bold]{info['chosen']}[/] for the configurations not profiled "
              f"(leave-one-configuration-out error of the steady minibatch: simple "
              f"{num(info.get('simple_loo_mape_pct'), 1)}%"
              + (f", {'transferred' if 'transfer' in info else 'learned'} {learned['kind']} "
                 f"{num(learned.get('loo_mape_pct'), 1)}%" if learned else "") + ")")
    if scores["configurations"]:
        out.print(f"validated on {scores['configurations']} of {scores['held_out']} held-out "
                  f"configurations (drawn at random, seed {report.validation_seed}, one model "
                  f"cell at a time): MAPE time "
                  f"first epoch {num(scores['first_time_mape_pct'], 1)}%, later "
                  f"{num(scores['later_time_mape_pct'], 1)}%; energy first "
                  f"{num(scores['first_energy_mape_pct'], 1)}%, later "
                  f"{num(scores['later_energy_mape_pct'], 1)}%")
        if scores.get("first_time_mape_drift_corrected_pct") is not None and report.drift:
            d = report.drift
            out.print(f"corrected for the machine's drift (re-measured beside the validation: "
                      f"{escape(d['label'])}; {num(d['range'][0], 2)}–{num(d['range'][1], 2)}× "
                      f"the profile-time figure per minibatch): MAPE time first "
                      f"{num(scores['first_time_mape_drift_corrected_pct'], 1)}%, later "
                      f"{num(scores['later_time_mape_drift_corrected_pct'], 1)}%")
        machine = data_out["machine_speed"]["drift"]
        if machine:
            names = {"python_loop": "one core's Python loop", "device_matmul": "device FP16 product"}
            out.print("the machine's own speed beside the validation (fixed reference work, "
                      "each reading's time over the one after the profiles): " + "; ".join(
                          f"{names[k]} {num(r['range'][0], 3)}–{num(r['range'][1], 3)}× "
                          f"(repeats' spread {num(100 * r['noise'], 1)}%)"
                          for k, r in machine["by_reference"].items())
                      + (": within ±10%" if machine["within_10pct"] else ": [yellow]moved past "
                         "±10%[/]"))
        # Which term of the model missed, from the validated epochs' own minibatches.
        for epoch in ("first", "later"):
            missed = (report.attribution.get(epoch) or {}).get("verdict")
            if missed:
                out.print(f"{epoch} epochs: {escape(missed)}")
    out.print(f"[dim]profiled {len(data_out['profiled'])} of {len(data_out['predictions']) // 2} "
              f"configurations, {data_out['profiled_minibatches']} minibatches, "
              f"{num(report.profile_s, 0)} s; validation {num(report.validate_s, 0)} s[/]")
    spent = data_out["budget"]
    if spent["max_share"] is not None:
        verdict = "within" if spent["ok"] else "[yellow]beyond[/]"
        out.print(f"[dim]profile budget: largest profile {num(100 * spent['max_share'], 1)}% of "
                  f"its epoch, {spent['profiled']} of {spent['configurations']} configurations "
                  f"profiled ({spent['mode']} plan, {num(spent['total_epochs'], 2)} epochs "
                  f"profiled in all"
                  + (f", compute probes {num(spent['compute_probe_epochs'], 3)} of them"
                     if spent.get("compute_probes") else "")
                  + f", the rule allows {num(spent['total_epochs_allowed'], 2)}): "
                  f"{verdict} the rule ({spent['rule']})[/]")
    for note in report.notes:
        out.print(f"[dim]{escape(note)}[/]")
    if info.get("verdict"):
        style = ("green" if info.get("within_rule") or info.get("within_rule_cost")
                 else "bold yellow")
        out.print(f"[{style}]{escape(info['verdict'])}[/]")
    if report.run_id is not None:
        out.print(f"[dim]stored as run {report.run_id} in {db}[/]")
