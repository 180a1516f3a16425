"""The characterization study: accuracy, determinism and rebuild variance of engines and precisions.

For every (unit, engine, precision) — int8 added where an engine offers it on a CPU — the model is
built N times, each build in a fresh process with a fresh cache folder, and the same labelled
inputs run through each build:
- accuracy (first build): top-1/top-5 against the labels, top-1 agreement with the fp32
  reference, logit errors (`metrics.accuracy_figures`), with 95% intervals;
- determinism across builds: distinct output sets, largest difference, top-1 flips, and each
  build's median batch latency (their spread is a result);
- within each build: the inputs run twice, and items alone against inside batches of other sizes;
- causes: each variance found is measured again with one knob pinned at a time
  (`knobs.KNOBS`); the report says which knob removes it and its throughput cost.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infermux.characterize import records
from infermux.characterize.data import Dataset, load_data
from infermux.characterize.int8 import INT8_ENGINES
from infermux.characterize.knobs import Knob, applicable_knobs, environment_for, split_settings
from infermux.characterize.metrics import Spread, accuracy_figures, spread
from infermux.errors import UsageError
from infermux.models import LoadedModel, ModelSpec, load_model
from infermux.progress import ProgressFn
from infermux.store import Store, recording
from infermux.units import Unit

__all__ = [
    "VARIANCE_KINDS",
    "Cause",
    "CharacterizeConfig",
    "CharacterizeReport",
    "Study",
    "Variant",
    "VariantResult",
    "plan_variants",
    "reference_outputs",
    "run_characterize",
    "run_study",
]

#: The variances looked for: between builds, between two runs of one build, with the batch size.
VARIANCE_KINDS = ("rebuild", "run-to-run", "batch-size")


@dataclass
class CharacterizeConfig:
    """What to characterize and how (the CLI's options; `configs` adds named option sets)."""

    model: ModelSpec
    units: str = "cpu"
    engine: str = "auto"
    builds: int = 5
    #: An image folder, a .npz/.pt tensor file, or None / "digits" for the built-in digits.
    data: str | None = None
    items: int | None = None
    calibration_items: int = 128
    batch: int = 32
    #: Batch sizes an item is also run in (besides alone and `batch`), within each build.
    batch_sizes: tuple[int, ...] = (8,)
    #: Run items alone and in other batch sizes within each build (each size is a build of its
    #: own runner: with torch.compile, a compilation); False checks run-to-run only.
    batch_dependence: bool = True
    int8: bool = True
    causes: bool = True
    share_cache: bool = False
    #: Engine options (`-o`), plain or `ENGINE.key`; settings keys (`knobs.SETTINGS`) included.
    options: dict[str, Any] = field(default_factory=dict)
    #: Named option sets, each characterized as its own baseline (default: one, `options`).
    configs: dict[str, dict[str, Any]] | None = None
    warmup_runs: int = 3
    latency_runs: int = 20
    latency_s: float = 0.5
    #: Modules or .py files every build imports first (engines they register become usable).
    imports: tuple[str, ...] = ()
    build_timeout_s: float = 1800.0
    seed: int = 0

    def validate(self) -> None:
        """Reject impossible values with one line naming the value and the fix."""
        if self.builds < 1:
            raise UsageError(f"--builds {self.builds}: at least 1 build is needed (2 or more to "
                             "see rebuild variance), e.g. --builds 5")
        if self.batch < 1:
            raise UsageError(f"--batch {self.batch} must be at least 1, e.g. --batch 32")
        bad = [b for b in self.batch_sizes if b < 1]
        if bad:
            raise UsageError(f"--batch-sizes {bad[0]} must be at least 1, e.g. --batch-sizes 1,8")
        if self.latency_runs < 1:
            raise UsageError(f"--latency-runs {self.latency_runs} must be at least 1")
        if self.configs is not None and not self.configs:
            raise UsageError("configs is empty: give at least one named option set")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (stored with the run)."""
        data = asdict(self)
        data["model"] = asdict(self.model)
        return data


@dataclass
class Variant:
    """One (unit, engine, precision) under one named option set."""

    unit: Unit
    engine: str
    precision: str  # fp32 | tf32 | fp16 | bf16 | int8 | auto (the runtime picks; see computed)
    config: str
    options: dict[str, Any]
    settings: dict[str, Any]

    @property
    def label(self) -> str:
        """`cpu onnxruntime int8`, with the option set's name when it is not `default`."""
        text = f"{self.unit.id} {self.engine} {self.precision}"
        return text if self.config == "default" else f"{text} [{self.config}]"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"unit": self.unit.id, "engine": self.engine, "precision": self.precision,
                "config": self.config, "options": self.options, "settings": self.settings}


@dataclass
class Study:
    """N builds of one variant with the same options (the baseline, or one knob pinned)."""

    knob: str | None
    builds: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[np.ndarray] = field(default_factory=list, repr=False)
    #: The study this one is (the same builds), when it was measured for another variant first.
    same_as: str | None = None

    @property
    def ok(self) -> list[dict[str, Any]]:
        """The builds that ran."""
        return [b for b in self.builds if b.get("status") == "ok"]

    def rebuild(self) -> Spread | None:
        """Spread of the outputs across builds (None with fewer than two builds that ran)."""
        return spread(self.outputs) if len(self.outputs) >= 2 else None

    def run_to_run(self) -> dict[str, Any] | None:
        """The worst build's repeat of the same inputs: distinct sets, difference, flips."""
        found = [b["run_to_run"] for b in self.ok if b.get("run_to_run")]
        if not found:
            return None
        return {"builds_varying": sum(1 for r in found if r["distinct"] > 1),
                "builds": len(found),
                "max_abs_diff": max(r["max_abs_diff"] for r in found),
                "top1_flips": max(r["top1_flips"] for r in found)}

    def batch_dependence(self) -> list[dict[str, Any]]:
        """Per batch size: items there against alone, worst over builds."""
        sizes: dict[int, list[dict[str, Any]]] = {}
        for b in self.ok:
            for entry in b.get("batch_dependence") or []:
                sizes.setdefault(int(entry["batch"]), []).append(entry)
        return [{"batch": size, "items": entries[0]["items"],
                 "builds_varying": sum(1 for e in entries if e["distinct"] > 1),
                 "max_abs_diff": max(e["max_abs_diff"] for e in entries),
                 "top1_flips": max(e["top1_flips"] for e in entries)}
                for size, entries in sorted(sizes.items())]

    def variance(self) -> list[str]:
        """The kinds of variance found (`VARIANCE_KINDS`)."""
        found = []
        rebuild = self.rebuild()
        if rebuild is not None and rebuild.varies:
            found.append("rebuild")
        r2r = self.run_to_run()
        if r2r and r2r["builds_varying"]:
            found.append("run-to-run")
        if any(e["builds_varying"] for e in self.batch_dependence()):
            found.append("batch-size")
        return found

    def latency(self) -> dict[str, Any] | None:
        """Each build's median batch latency, their median, range and spread."""
        medians = [b["latency"]["median_ms"] for b in self.ok if b.get("latency")]
        if not medians:
            return None
        mid = statistics.median(medians)
        return {"per_build_ms": medians, "median_ms": mid, "min_ms": min(medians),
                "max_ms": max(medians),
                "spread": (max(medians) - min(medians)) / mid if mid > 0 else math.nan,
                "items_per_s": self.ok[0]["batch"] / (mid / 1e3) if mid > 0 else None}

    def determinism(self) -> dict[str, Any]:
        """The study's figures, JSON-ready."""
        rebuild = self.rebuild()
        return {"builds": len(self.builds), "builds_ok": len(self.ok),
                "rebuild": rebuild.to_dict() if rebuild else None,
                "run_to_run": self.run_to_run(), "batch_dependence": self.batch_dependence(),
                "latency": self.latency(), "variance": self.variance()}


@dataclass
class Cause:
    """A knob pinned against the variances of a variant: what it removed and what it cost."""

    knob: Knob
    study: Study
    #: Per variance kind found in the baseline: True (gone), False (still there), None (unseen:
    #: rebuild variance needs two builds that ran).
    removes: dict[str, bool | None]
    throughput_ratio: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        lat = self.study.latency()
        return {"knob": self.knob.name, "title": self.knob.title, "options": self.knob.options,
                "settings": self.knob.settings, "shared_cache": self.knob.shared_cache,
                "builds": len(self.study.builds), "removes": self.removes,
                "same_as": self.study.same_as,
                "variance_left": self.study.variance(),
                "items_per_s": lat["items_per_s"] if lat else None,
                "throughput_ratio": self.throughput_ratio,
                "determinism": self.study.determinism(),
                "errors": [b.get("error") for b in self.study.builds if b.get("status") != "ok"]}


@dataclass
class VariantResult:
    """Everything measured for one variant."""

    variant: Variant
    baseline: Study
    accuracy: dict[str, Any] | None = None
    computed_precision: str | None = None
    causes: list[Cause] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        """`ok` when at least one build ran, else `error`."""
        return "ok" if self.baseline.ok else "error"

    @property
    def error(self) -> str | None:
        """The first build error, if any build failed."""
        errors = [b.get("error") for b in self.baseline.builds if b.get("status") != "ok"]
        return errors[0] if errors else None

    def removed_by(self) -> dict[str, list[str]]:
        """Per variance kind found: the knobs that removed it."""
        return {kind: [c.knob.name for c in self.causes if c.removes.get(kind)]
                for kind in self.baseline.variance()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (build outputs stay out; latency samples stay in)."""
        return {**self.variant.to_dict(), "status": self.status, "error": self.error,
                "computed_precision": self.computed_precision, "accuracy": self.accuracy,
                "determinism": self.baseline.determinism(),
                "builds": [_build_summary(i, b) for i, b in enumerate(self.baseline.builds)],
                "causes": [c.to_dict() for c in self.causes], "removed_by": self.removed_by(),
                "notes": self.notes}


def _build_summary(index: int, build: dict[str, Any]) -> dict[str, Any]:
    lat = build.get("latency") or {}
    return {"build": index, "status": build.get("status"), "error": build.get("error"),
            "build_s": build.get("build_s"), "latency_median_ms": lat.get("median_ms"),
            "items_per_s": lat.get("items_per_s"), "latency_runs": lat.get("runs"),
            "latency_samples_ns": lat.get("samples_ns"),
            "reported_precision": build.get("reported_precision")}


@dataclass
class CharacterizeReport:
    """The study's result; `to_dict()` is what `--json` prints."""

    run_id: int | None
    model: LoadedModel
    data: Dataset
    reference: str
    config: CharacterizeConfig
    variants: list[VariantResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    status: str = "running"
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return records.finite({"run_id": self.run_id, "status": self.status,
                        "model": self.model.describe(), "data": self.data.describe(),
                        "reference": self.reference, "config": self.config.to_dict(),
                        "variants": [v.to_dict() for v in self.variants], "notes": self.notes,
                        "elapsed_s": self.elapsed_s})


# -- planning ------------------------------------------------------------------------------------


def _precision_of(unit: Unit, engine: str, options: dict[str, Any]) -> str:
    if unit.kind == "openvino":
        return {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "u8": "int8"}.get(
            str(options.get("precision")), "auto")
    return unit.mode


def plan_variants(config: CharacterizeConfig, units: list[Unit], model: LoadedModel
                  ) -> list[Variant]:
    """Every (unit, engine, precision, option set) the study builds, in order."""
    from infermux.engines.select import engine_options, engines_for

    pairs = engines_for(config.engine, units, model)
    sets = config.configs or {"default": config.options}
    variants: list[Variant] = []
    for name, options in sets.items():
        for unit, engine in pairs:
            engine_opts, settings = split_settings(engine_options(engine, options))
            variants.append(Variant(unit, engine, _precision_of(unit, engine, engine_opts), name,
                                    engine_opts, settings))
            if (config.int8 and engine in INT8_ENGINES and unit.kind in ("cpu", "openvino")
                    and model.source != "onnx"):
                variants.append(Variant(unit, engine, "int8", name, engine_opts, settings))
    return variants


# -- the fp32 reference --------------------------------------------------------------------------


def reference_outputs(model: LoadedModel, x: np.ndarray, batch: int = 32) -> tuple[np.ndarray, str]:
    """The fp32 reference's first output for every item: torch on the CPU (ONNX Runtime for ONNX)."""
    parts: list[np.ndarray] = []
    if model.module is not None:
        import torch
        from torch.utils._pytree import tree_flatten

        with torch.inference_mode():
            for start in range(0, len(x), batch):
                leaves, _ = tree_flatten(model.module(torch.from_numpy(
                    np.ascontiguousarray(x[start:start + batch], dtype=np.float32))))
                first = next(t for t in leaves if isinstance(t, torch.Tensor))
                parts.append(first.float().numpy().reshape(first.shape[0], -1))
        return np.concatenate(parts), "torch-fp32-cpu"
    import onnxruntime as ort

    session = ort.InferenceSession(str(model.onnx_path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for start in range(0, len(x), batch):
        chunk = np.ascontiguousarray(x[start:start + batch], dtype=np.float32)
        logits = np.asarray(session.run(None, {name: chunk})[0], dtype=np.float32)
        parts.append(logits.reshape(len(chunk), -1))
    return np.concatenate(parts), "onnxruntime-fp32-cpu"


# -- builds ----------------------------------------------------------------------------------------


@dataclass
class _Workspace:
    """Files every build of a run reads, where builds write, and the studies made so far."""

    root: Path
    inputs: Path
    calibration: Path
    model: dict[str, Any]
    config: CharacterizeConfig
    #: Studies by what they built (unit, engine, precision, options, settings, shared cache):
    #: a knob pinned may make one variant another option set's baseline, measured once.
    studies: dict[str, tuple[str, Study]] = field(default_factory=dict)
    #: Keys of the baselines still to come: a knob study that is one gets all their builds.
    planned: set[str] = field(default_factory=set)


def _study_key(variant: Variant, options: dict[str, Any], settings: dict[str, Any],
               shared_cache: bool) -> str:
    return json.dumps([variant.unit.id, variant.engine, variant.precision, options, settings,
                       shared_cache], sort_keys=True, default=str)


def _child_env(cache: Path | None, build: int, settings: dict[str, Any], timeout_s: float
               ) -> dict[str, str]:
    import infermux

    env = dict(os.environ)
    src = str(Path(infermux.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    env["INFERMUX_BUILD_INDEX"] = str(build)
    env["PYTHONUNBUFFERED"] = "1"
    # The build's own watchdog, a little before the parent's: it prints where it hung.
    env["INFERMUX_BUILD_TIMEOUT_S"] = str(max(1.0, timeout_s - 5))
    if cache is not None:
        env["INFERMUX_CACHE_DIR"] = str(cache)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
        env["TRITON_CACHE_DIR"] = str(cache / "triton")
    env.update(environment_for(settings))
    return env


def _run_child(ws: _Workspace, variant: Variant, options: dict[str, Any],
               settings: dict[str, Any], build: int, out_dir: Path, cache: Path | None
               ) -> tuple[dict[str, Any], np.ndarray | None]:
    config = ws.config
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": ws.model, "unit": variant.unit.to_dict(), "engine": variant.engine,
        "precision": variant.precision, "options": options, "settings": settings,
        "batch": config.batch, "batch_sizes": sorted({1, config.batch, *config.batch_sizes}),
        "batch_dependence": config.batch_dependence,
        "inputs": str(ws.inputs), "calibration": str(ws.calibration),
        "latency": {"warmup_runs": config.warmup_runs, "min_runs": config.latency_runs,
                    "min_s": config.latency_s},
        "imports": list(config.imports), "out_dir": str(out_dir), "build_index": build,
    }
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, default=str))
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "infermux.characterize._build_child", str(spec_path)],
            env=_child_env(cache, build, settings, config.build_timeout_s),
            capture_output=True, text=True,
            timeout=config.build_timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return ({"status": "error", "batch": config.batch,
                 "error": f"the build ran past --build-timeout {config.build_timeout_s:g}s"}, None)
    result_file = out_dir / "result.json"
    if not result_file.is_file():
        text = (proc.stderr or proc.stdout or "").strip()
        tail = text.splitlines()
        hung = "Timeout (" in text  # faulthandler's watchdog fired: the stacks follow
        return ({"status": "error", "batch": config.batch,
                 "error": (f"the build hung for {config.build_timeout_s:g}s" if hung else
                           f"the build process exited with code {proc.returncode}"
                           + (f": {tail[-1][:300]}" if tail else "")),
                 "stderr_tail": text[-4000:]}, None)
    record = json.loads(result_file.read_text())
    record["batch"] = config.batch
    record["process_s"] = time.perf_counter() - started
    outputs = None
    if record.get("status") == "ok":
        outputs = np.load(out_dir / "outputs.npy")
    return record, outputs


def run_study(ws: _Workspace, variant: Variant, knob: Knob | None, builds: int, tag: str,
              progress: Callable[[str], None] | None = None) -> Study:
    """`builds` fresh-process builds of `variant`, with `knob` pinned if given.

    A study that builds exactly what an earlier one built (with at least as many builds) is
    that study, not measured again: `Study.same_as` names the earlier one.
    """
    options, settings = (knob.pin(variant.options, variant.settings) if knob is not None
                         else (dict(variant.options), dict(variant.settings)))
    key = _study_key(variant, options, settings, bool(knob and knob.shared_cache))
    if knob is not None and key in ws.planned:
        builds = max(builds, ws.config.builds)  # measured once, for the later baseline too
    earlier = ws.studies.get(key)
    if earlier is not None and len(earlier[1].builds) >= builds:
        return Study(knob.name if knob else None, earlier[1].builds, earlier[1].outputs,
                     same_as=earlier[0])
    study = Study(knob.name if knob else None)
    ws.studies[key] = (variant.label + (f" · {knob.name}" if knob else ""), study)
    shared = ws.root / f"cache-{tag}-shared" if knob is not None and knob.shared_cache else None
    for b in range(builds):
        if progress is not None:
            progress(f"{variant.label}{f' · {knob.name}' if knob else ''} · build {b + 1}/{builds}")
        # With --share-cache every build uses the user's cache folder (None: left as it is).
        cache = None if ws.config.share_cache else shared or ws.root / f"cache-{tag}-{b}"
        record, outputs = _run_child(ws, variant, options, settings, b, ws.root / f"{tag}-{b}",
                                     cache)
        study.builds.append(record)
        if outputs is not None:
            study.outputs.append(outputs)
        if cache is not None and cache != shared:
            shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(ws.root / f"{tag}-{b}", ignore_errors=True)
    if shared is not None:
        shutil.rmtree(shared, ignore_errors=True)
    return study


def _cause(knob: Knob, study: Study, baseline: Study) -> Cause:
    found = baseline.variance()
    left = study.variance()
    removes: dict[str, bool | None] = {}
    for kind in found:
        if not study.ok or (kind == "rebuild" and len(study.ok) < 2):
            removes[kind] = None
        else:
            removes[kind] = kind not in left
    base, pinned = baseline.latency(), study.latency()
    ratio = (base["median_ms"] / pinned["median_ms"]
             if base and pinned and pinned["median_ms"] > 0 else None)
    return Cause(knob, study, removes, ratio)


# -- the study -----------------------------------------------------------------------------------


def _model_for_children(model: LoadedModel, root: Path) -> dict[str, Any]:
    """The model as each build loads it: the same reference, and the parent's own weights.

    A network without a weights file is randomly initialised, differently in every process: its
    weights are saved once here, so every build (and the reference) computes the same network.
    """
    spec = model.spec
    ref = spec.ref
    if model.module is not None and not spec.weights:
        import torch

        torch.save(model.module.state_dict(), root / "weights.pt")
        spec = ModelSpec(spec.ref, str(root / "weights.pt"), spec.input_shape, spec.dtype)
    if model.source == "onnx":
        ref = str(Path(ref).resolve())
    elif model.source == "factory":
        path, _, func = ref.rpartition(":")
        ref = f"{Path(path).resolve()}:{func}"
    weights = str(Path(spec.weights).resolve()) if spec.weights else None
    return {"ref": ref, "weights": weights, "input_shape": list(model.input_shape)}


def _score_labels(model: LoadedModel, data: Dataset, classes: int) -> tuple[bool, str]:
    if data.y is None:
        return False, "the data has no labels: top-1/top-5 against labels are not scored"
    if model.randomly_initialised:
        return False, ("the model is randomly initialised (no --weights): top-1/top-5 against "
                       "labels are not scored; agreement with the fp32 reference still is")
    if len(data.y) and int(data.y.max()) >= classes:
        return False, (f"labels go up to {int(data.y.max())} but the model has {classes} outputs: "
                       "top-1/top-5 against labels are not scored")
    return True, ""


def _describe_variance(result: VariantResult, builds: int) -> str:
    found = result.baseline.variance()
    if not found:
        return (f"{result.variant.label}: no variance — {builds} build(s) identical"
                if builds > 1 else f"{result.variant.label}: no variance within the build")
    parts = []
    for kind, knobs in result.removed_by().items():
        parts.append(f"{kind} removed by {', '.join(knobs)}" if knobs
                     else f"{kind} not removed by any knob tried" if result.causes
                     else f"{kind} (causes not measured)")
    return f"{result.variant.label}: " + "; ".join(parts)


def run_characterize(config: CharacterizeConfig, *, store: Store | None = None,
                     progress: ProgressFn | None = None, command: str = ""
                     ) -> CharacterizeReport:
    """Run the whole study (see the module docstring); stored as a run of kind `characterize`."""
    from infermux.units import discover, select_units

    started = time.perf_counter()
    config.validate()
    spec = config.units
    found = discover(with_runtimes=not all(p.strip().startswith(("cpu", "cuda"))
                                           for p in spec.split(",")))
    units = select_units(spec, found)
    model = load_model(config.model)
    data = load_data(config.data, model.input_shape, items=config.items,
                     calibration_items=config.calibration_items, seed=config.seed)
    if len(data.x) == 0:
        raise UsageError(f"--data {config.data!r} left no items to evaluate: give more items")
    variants = plan_variants(config, units, model)
    if progress is not None:
        progress("fp32 reference", 0.0)
    reference, reference_name = reference_outputs(model, data.x, config.batch)
    report = CharacterizeReport(None, model, data, reference_name, config)
    score, why_not = _score_labels(model, data, reference.shape[1])
    if why_not:
        report.notes.append(why_not)
    report.notes.append(f"model: {model.weights_note}")
    report.notes.append(f"data: {data.note}")
    cfg = config.to_dict() | {"resolved_units": [u.id for u in units],
                              "model_description": model.describe(),
                              "data_description": data.describe()}
    with recording(store, "characterize", cfg, command) as rec:
        run_id = report.run_id = rec.run_id
        root = Path(tempfile.mkdtemp(prefix="infermux-characterize-"))
        try:
            np.save(root / "inputs.npy", data.x)
            np.save(root / "calibration.npy", data.calibration)
            ws = _Workspace(root, root / "inputs.npy", root / "calibration.npy",
                            _model_for_children(model, root), config)
            ws.planned = {_study_key(v, v.options, v.settings, False) for v in variants}
            total = max(1, len(variants) * config.builds)
            done = [0]

            def tell(label: str) -> None:
                if progress is not None:
                    progress(label, min(0.99, done[0] / total))

            for i, variant in enumerate(variants):
                baseline = run_study(ws, variant, None, config.builds, f"v{i}", tell)
                done[0] += config.builds
                result = VariantResult(variant, baseline)
                if baseline.ok:
                    first = baseline.ok[0]
                    result.computed_precision = ("int8" if variant.precision == "int8"
                                                 else first.get("reported_precision"))
                    result.accuracy = accuracy_figures(baseline.outputs[0],
                                                       data.y if score else None, reference)
                    result.accuracy["top1_per_build"] = [
                        float(np.mean(o.argmax(axis=1) == data.y)) if score and data.y is not None
                        else None for o in baseline.outputs]
                found_kinds = baseline.variance()
                if config.causes and found_kinds and baseline.ok:
                    knobs = applicable_knobs(variant.engine, variant.unit.kind, variant.options,
                                             variant.settings, config.share_cache)
                    if not knobs:
                        result.notes.append("no knob to pin for this engine and unit")
                    for j, knob in enumerate(knobs):
                        n = config.builds if "rebuild" in found_kinds else 1
                        study = run_study(ws, variant, knob, n, f"v{i}k{j}", tell)
                        result.causes.append(_cause(knob, study, baseline))
                report.variants.append(result)
                if store is not None and run_id is not None:
                    records.add_variant(store, run_id, i, result)
            report.notes += [_describe_variance(r, config.builds) for r in report.variants
                             if r.status == "ok"]
            report.status = "complete" if any(r.status == "ok" for r in report.variants) \
                else "failed"
            return report
        except KeyboardInterrupt:
            report.status = "interrupted"
            raise
        finally:
            shutil.rmtree(root, ignore_errors=True)
            report.elapsed_s = time.perf_counter() - started
            rec.status, rec.summary = report.status, {
                "variants": len(report.variants),
                "with_variance": sum(1 for r in report.variants if r.baseline.variance()),
                "elapsed_s": report.elapsed_s}
