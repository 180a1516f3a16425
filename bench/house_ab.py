"""The same six commands on two source trees, side by side, to tell a changed figure from noise.

Six commands — `run`, `partition`, `tune`, `serve`, `serve --cluster` and `study pipeline` —
each run on the SAME input from an older tree (`--before-src`, e.g. a `git archive` of an
earlier commit's `src/`) and from this checkout's `src/`, alternated ABBA (before, after, after,
before; `--rounds N` gives N runs of each tree, the order flipping every pair) so that a
drifting, shared machine weighs on both alike. Every run is a real subprocess,
`python -m infermux ...` with PYTHONPATH set to the tree's `src`, on this interpreter's venv.

Per command the report gives each tree's figures (items/s or requests/s, p99 where there is
one), their medians, the ratio after/before of the medians, and the spread between repeats of
one tree ((max - min) / median): a ratio whose distance from 1 is inside the larger spread is
not a difference this run can tell from noise.

- run: one plan (one ONNX Runtime replica on cpu:1), offline, the `result` figures.
- partition: the chosen plan's figure as each tree's partitioner reports it. The partitioner
  began measuring its candidates through the runtime (`run_plan`: dispatcher, LoadGen) where it
  used to time the bare executor, so this figure changed by design; the like-for-like figure is
  each tree's written plan run by THIS tree's `infermux run`, alternated the same way.
- tune: the best trial's figure and the written plan's label (fresh database per run, so no
  stored trial is reused); then each tree's written plan run by this tree's `infermux run`.
- serve: `infermux serve PLAN` driven by bench/serve_load.py (gRPC, closed loop, fixed
  concurrency and duration): requests/s and p99 as the client sees them.
- serve --cluster: the same served from a local Ray cluster (`--cluster local:1`).
- study pipeline: the study's pipeline, best single-unit and data-parallel figures.

Flags that only one tree has are passed to that tree alone (`TREE_FLAGS`): the current
`serve` takes `--fronts 1` (the front in the server process, as the older tree always had it).
Where a tree cannot run a command, the command is reported as not comparable with that tree's
error line. Each run builds its workers afresh (an ONNX export, worker processes), so the
defaults (two runs of each tree, six commands, plus the written plans run again) take about 19
minutes on two loaded cores; `--only` picks a subset.

    git -C . archive f2fd2a5 src | tar -x -C /tmp/house-before
    python bench/house_ab.py --before-src /tmp/house-before/src --json house-ab.json
    python bench/house_ab.py --before-src /tmp/house-before/src --only run,serve --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["COMMANDS", "main"]

ROOT = Path(__file__).resolve().parents[1]
TREES = ("before", "after")
COMMANDS = ("run", "partition", "tune", "serve", "serve-cluster", "study-pipeline")
#: Flags that one tree has and the other has not, per command and tree.
TREE_FLAGS: dict[str, dict[str, list[str]]] = {
    "serve": {"after": ["--fronts", "1"]},
    "serve-cluster": {"after": ["--fronts", "1"]},
}


class RunError(Exception):
    """A command exited non-zero (or printed no result): its last error line is the message."""


def _env(src: Path) -> dict[str, str]:
    # Ray reports usage unless told not to; the tree's own sources come first on the path.
    return dict(os.environ, PYTHONPATH=str(src), RAY_USAGE_STATS_ENABLED="0")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def infermux(src: Path, argv: list[str], timeout_s: float) -> dict[str, Any]:
    """`python -m infermux ARGV --json` on the tree at `src`; its JSON (the last JSON document)."""
    try:
        done = subprocess.run([sys.executable, "-m", "infermux", *argv], capture_output=True,
                              text=True, env=_env(src), timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise RunError(f"timed out after {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        raise RunError(f"exit {done.returncode}: {_last_line(done.stderr or done.stdout)}")
    out = done.stdout
    start = out.find("{")
    if start < 0:
        raise RunError(f"no JSON on stdout: {_last_line(done.stderr)}")
    return dict(json.loads(out[start:]))


class Bench:
    """The settings, the trees and a scratch folder; one method per command."""

    def __init__(self, args: argparse.Namespace, scratch: Path) -> None:
        self.args = args
        self.scratch = scratch
        self.src = {"before": Path(args.before_src).resolve(), "after": ROOT / "src"}
        self.plan = self._write_plan()

    def _write_plan(self) -> Path:
        a = self.args
        plan = {"name": "house-ab", "models": [{"name": "net", "model": a.model, "replicas": [
            {"unit": a.unit, "engine": a.engine, "instances": 1, "batch": a.batch}]}],
            "dispatcher": {"max_queue_delay_ms": 2.0},
            "load": {"scenario": "offline", "min_duration_s": a.duration_s, "min_queries": 64}}
        path = self.scratch / "plan.json"
        path.write_text(json.dumps(plan, indent=1))
        return path

    def flags(self, command: str, tree: str) -> list[str]:
        return TREE_FLAGS.get(command, {}).get(tree, [])

    def timeout_s(self, extra_s: float = 0.0) -> float:
        return 240.0 + extra_s

    # -- the commands: each returns one run's figures ------------------------------------------

    def run_plan_file(self, tree: str, plan: Path) -> dict[str, Any]:
        out = infermux(self.src[tree], ["run", str(plan), "--scenario", "offline", "--duration",
                                        f"{self.args.duration_s:g}s", "--no-store", "--json"],
                       self.timeout_s())
        result = out.get("result") or {}
        if out.get("status") != "complete" or not result:
            raise RunError(f"status {out.get('status')}: {out.get('error')}")
        return {"items_per_s": result["items_per_s"],
                "p99_ms": (result.get("latency") or {}).get("p99_ms"),
                "valid": result.get("valid")}

    def run(self, tree: str, i: int) -> dict[str, Any]:
        return self.run_plan_file(tree, self.plan)

    def partition(self, tree: str, i: int) -> dict[str, Any]:
        a = self.args
        written = self.scratch / f"partition-{tree}-{i}.yaml"
        out = infermux(self.src[tree], [
            "partition", "--model", a.model, "--units", a.units, "--engines", a.engine,
            "--batch", str(a.batch), "--max-pieces", "4", "--measure-top", "1",
            "--duration", "2s", "--warmup", "1s", "--out", str(written), "--no-store", "--json",
            *self.flags("partition", tree)], self.timeout_s())
        plan = out.get("plan") or {}
        chosen: dict[str, Any] = next(
            (c for c in out.get("candidates") or [] if c.get("chosen")), {})
        measured = chosen.get("measurement") or {}
        return {"items_per_s": plan.get("measured_items_per_s"),
                "p99_ms": measured.get("p99_ms"),
                "predicted_items_per_s": plan.get("predicted_items_per_s"),
                "plan": chosen.get("plan"), "plan_file": str(written)}

    def tune(self, tree: str, i: int) -> dict[str, Any]:
        a = self.args
        written = self.scratch / f"tune-{tree}-{i}.yaml"
        out = infermux(self.src[tree], [
            "tune", "--model", a.model, "--units", a.unit, "--engine", a.engine,
            "--budget", f"{a.tune_budget_s:g}s", "--batch", "1,4,8", "--max-instances", "1",
            "--trial-duration", "1s", "--trial-queries", "32", "--no-fine-tune", "--fresh",
            "--out", str(written), "--db", str(self.scratch / f"tune-{tree}-{i}.db"), "--json",
            *self.flags("tune", tree)], self.timeout_s(a.tune_budget_s))
        best = _best_trial(out)
        return {"items_per_s": best.get("items_per_s"), "p99_ms": best.get("p99_ms"),
                "plan": best.get("label"), "trials": best.get("trials"),
                "plan_file": str(written)}

    def _serve(self, command: str, tree: str, extra: list[str]) -> dict[str, Any]:
        a = self.args
        argv = [sys.executable, "-m", "infermux", "serve", str(self.plan), "--http-port", "0",
                "--grpc-port", "0", "--metrics-port", "0", "--telemetry", "off", "--no-store",
                "--json", *extra, *self.flags(command, tree)]
        log = (self.scratch / f"{command}-{tree}.log").open("w")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                env=_env(self.src[tree]), start_new_session=True)
        try:
            assert proc.stdout is not None  # stdout=PIPE above
            # The ready line comes once the workers are built; a server that never gets there
            # is given up on rather than waited on for good.
            if not select.select([proc.stdout], [], [], self.timeout_s())[0]:
                raise RunError(f"server not ready after {self.timeout_s():.0f} s")
            ready_line = proc.stdout.readline()
            if not ready_line.strip().startswith("{"):
                proc.wait(30)
                log.flush()
                raise RunError(f"server did not start (exit {proc.returncode}): "
                                f"{_last_line((self.scratch / f'{command}-{tree}.log').read_text())}")
            ready = json.loads(ready_line)
            client = subprocess.run(
                [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--url",
                 f"127.0.0.1:{ready['grpc_port']}", "--protocol", "grpc", "--metadata-port",
                 str(ready["http_port"]), "--model", "net", "--concurrency",
                 str(a.concurrency), "--duration", f"{a.serve_s:g}", "--warmup", "2", "--json"],
                capture_output=True, text=True, timeout=a.serve_s + 120)
            if client.returncode != 0:
                raise RunError(f"client exit {client.returncode}: {_last_line(client.stderr)}")
            row = json.loads(client.stdout)[0]
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                # A server that will not drain: end its whole session (it started it).
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            log.close()
        return {"requests_per_s": row["throughput_rps"], "p99_ms": row["p99_ms"],
                "p50_ms": row["p50_ms"], "rejected": row.get("rejected"),
                "errors": row.get("errors")}

    def serve(self, tree: str, i: int) -> dict[str, Any]:
        return self._serve("serve", tree, [])

    def serve_cluster(self, tree: str, i: int) -> dict[str, Any]:
        return self._serve("serve-cluster", tree, ["--cluster", "local:1"])

    def study_pipeline(self, tree: str, i: int) -> dict[str, Any]:
        a = self.args
        out = infermux(self.src[tree], [
            "study", "pipeline", "--model", a.model, "--units", a.units, "--engine", a.engine,
            "--batch", str(a.batch), "--budget", f"{a.study_budget_s:g}s", "--duration", "2s",
            "--min-queries", "32", "--no-report", "--db",
            str(self.scratch / f"study-{tree}-{i}.db"), "--json",
            *self.flags("study-pipeline", tree)], self.timeout_s(a.study_budget_s))
        rows = (out.get("headline") or {}).get("rows") or []
        if not rows:
            raise RunError(f"status {out.get('status')}: no headline row")
        row = rows[0]

        def fig(kind: str) -> float | None:
            point = row.get(kind) or {}
            return point.get("items_per_s") if point.get("status") == "ok" else None

        pipe = row.get("pipeline") or {}
        if pipe.get("status") != "ok":
            raise RunError(f"pipeline point {pipe.get('status')}: {pipe.get('error')}")
        return {"items_per_s": fig("pipeline"), "p99_ms": pipe.get("p99_ms"),
                "single_items_per_s": fig("single"), "replicas_items_per_s": fig("replicas"),
                "single_unit": (row.get("single") or {}).get("unit")}


def _best_trial(out: dict[str, Any]) -> dict[str, Any]:
    """The tuner's chosen configuration (`best` in `tune --json`): figure, p99 and label."""
    best = out.get("best") or {}
    if best.get("status") not in (None, "ok"):
        raise RunError(f"best trial {best.get('status')}: {best.get('error')}")
    trials = out.get("trials")
    return {"items_per_s": best.get("items_per_s"), "p99_ms": best.get("p99_ms"),
            "label": best.get("plan"), "trials": len(trials) if isinstance(trials, list) else None}


def order(rounds: int) -> list[tuple[str, int]]:
    """ABBA...: before, after, then after, before, N runs of each; (tree, repeat index)."""
    seq: list[tuple[str, int]] = []
    for r in range(rounds):
        pair = TREES if r % 2 == 0 else TREES[::-1]
        seq += [(t, r) for t in pair]
    return seq


def compare(runs: dict[str, list[dict[str, Any]]], key: str) -> dict[str, Any]:
    """Medians per tree, the ratio after/before and each tree's spread between repeats."""
    out: dict[str, Any] = {"figure": key}
    medians = {}
    for tree in TREES:
        values = [r[key] for r in runs[tree] if r.get(key) is not None]
        if not values:
            out[tree] = None
            continue
        med = statistics.median(values)
        medians[tree] = med
        # One run of a tree has no spread to tell noise by (None, not 0).
        out[tree] = {"values": values, "median": med,
                     "spread": (max(values) - min(values)) / med if med and len(values) > 1
                     else None}
    if len(medians) == 2 and medians["before"]:
        ratio = medians["after"] / medians["before"]
        spreads = [out[t]["spread"] for t in TREES if out[t]["spread"] is not None]
        out["ratio_after_over_before"] = ratio
        out["within_noise"] = abs(ratio - 1.0) <= max(spreads) if spreads else None
    return out


def ab(bench: Bench, name: str, one: Callable[[str, int], dict[str, Any]],
       keys: tuple[str, ...]) -> dict[str, Any]:
    """`one(tree, i)` for every step of the ABBA order; figures compared per key."""
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TREES}
    errors: dict[str, str] = {}
    for tree, i in order(bench.args.rounds):
        if tree in errors:
            continue  # a tree that failed once is not run again: the command is not comparable
        started = time.perf_counter()
        try:
            fig = one(tree, i)
        except RunError as exc:
            errors[tree] = str(exc)
            print(f"  {name} {tree} #{i + 1}: FAILED {exc}", flush=True)
            continue
        fig["wall_s"] = time.perf_counter() - started
        runs[tree].append(fig)
        shown = ", ".join(f"{k} {fig[k]:,.1f}" for k in keys if fig.get(k) is not None)
        print(f"  {name} {tree} #{i + 1}: {shown} ({fig['wall_s']:.0f} s)", flush=True)
    report: dict[str, Any] = {"runs": runs, "flags": TREE_FLAGS.get(name, {})}
    if errors:
        report["comparable"] = False
        report["errors"] = errors
        return report
    report["comparable"] = True
    report["compare"] = {k: compare(runs, k) for k in keys}
    return report


def plans_by_current_run(bench: Bench, name: str, runs: dict[str, list[dict[str, Any]]],
                         ) -> dict[str, Any]:
    """Each tree's first written plan, run by this tree's `infermux run`, alternated ABBA."""
    plans = {t: Path(runs[t][0]["plan_file"]) for t in TREES if runs[t]}
    missing = [t for t in TREES if t not in plans or not plans[t].exists()]
    if missing:
        return {"comparable": False, "errors": {t: "no plan written" for t in missing}}
    note = f"{name} plan of each tree, run by the current tree"
    return ab(bench, note, lambda tree, i: bench.run_plan_file("after", plans[tree]),
              ("items_per_s", "p99_ms"))


def summary_line(name: str, rep: dict[str, Any]) -> str:
    if not rep.get("comparable"):
        return f"{name}: not comparable — " + "; ".join(
            f"{t}: {e}" for t, e in (rep.get("errors") or {}).items())
    parts = []
    for key, c in rep["compare"].items():
        if c.get("ratio_after_over_before") is None:
            continue
        spreads = [c[t]["spread"] for t in TREES if c[t]["spread"] is not None]
        noise = (f"spread {max(spreads):.1%}" if spreads else "one run each: no spread")
        outside = ", OUTSIDE the spread" if c["within_noise"] is False else ""
        parts.append(f"{key} {c['before']['median']:,.1f} → {c['after']['median']:,.1f} "
                     f"(×{c['ratio_after_over_before']:.3f}, {noise}{outside})")
    # The plan each tree chose (partition, tune): a different choice explains a different figure.
    chose = {t: sorted({str(r["plan"]) for r in rep["runs"][t] if r.get("plan")}) for t in TREES}
    if any(chose.values()):
        parts.append("chosen: " + "; ".join(f"{t} {' / '.join(chose[t])}" for t in TREES))
    return f"{name}: " + "; ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before-src", required=True,
                   help="the older tree's src/ (e.g. `git archive f2fd2a5 src | tar -x -C DIR`)")
    p.add_argument("--only", default=",".join(COMMANDS), help="comma list of " + ", ".join(COMMANDS))
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each tree per command (2: before, after, after, before)")
    p.add_argument("--model", default="mobilenet_v3_small")
    p.add_argument("--engine", default="onnxruntime")
    p.add_argument("--unit", default="cpu:1", help="the plan's replica (leave a core to a front)")
    p.add_argument("--units", default="cpu:0,cpu:1", help="partition and study units")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--duration-s", type=float, default=4.0, help="offline run's minimum seconds")
    p.add_argument("--serve-s", type=float, default=6.0, help="client's measured seconds")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--tune-budget-s", type=float, default=40.0)
    p.add_argument("--study-budget-s", type=float, default=150.0)
    p.add_argument("--json", dest="json_out", help="write every figure to this file")
    args = p.parse_args()
    chosen = [c.strip() for c in args.only.split(",") if c.strip()]
    bad = [c for c in chosen if c not in COMMANDS]
    if bad:
        raise SystemExit(f"--only {','.join(bad)}: not a command; choose from {', '.join(COMMANDS)}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be at least 1")
    if not (Path(args.before_src) / "infermux").is_dir():
        raise SystemExit(f"--before-src {args.before_src}: no infermux package there; extract "
                         "one with `git archive COMMIT src | tar -x -C DIR` and pass DIR/src")
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="house-ab-"))
    bench = Bench(args, scratch)
    report: dict[str, Any] = {
        "machine": platform.node(), "processor": platform.processor() or platform.machine(),
        "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
        "args": vars(args), "before_src": str(bench.src["before"]),
        "after_src": str(bench.src["after"]), "order": order(args.rounds), "commands": {}}
    steps: dict[str, tuple[Callable[[str, int], dict[str, Any]], tuple[str, ...]]] = {
        "run": (bench.run, ("items_per_s", "p99_ms")),
        "partition": (bench.partition, ("items_per_s", "p99_ms")),
        "tune": (bench.tune, ("items_per_s", "p99_ms")),
        "serve": (bench.serve, ("requests_per_s", "p99_ms")),
        "serve-cluster": (bench.serve_cluster, ("requests_per_s", "p99_ms")),
        "study-pipeline": (bench.study_pipeline,
                           ("items_per_s", "single_items_per_s", "replicas_items_per_s")),
    }
    lines = []
    for name in chosen:
        print(f"{name} ...", flush=True)
        fn, keys = steps[name]
        rep = ab(bench, name, fn, keys)
        lines.append(summary_line(name, rep))
        if name in ("partition", "tune"):
            if name == "partition":
                rep["note"] = ("the partitioner's own figure changed by design when it began "
                               "measuring its candidates through the runtime (run_plan) instead "
                               "of the bare executor; `by_current_run` is the like-for-like "
                               "figure: each tree's written plan run by the current `infermux run`")
            print(f"{name} plans by the current run ...", flush=True)
            rep["by_current_run"] = plans_by_current_run(bench, name, rep["runs"])
            lines.append(summary_line(f"{name} (plans by the current run)", rep["by_current_run"]))
        report["commands"][name] = rep
        if args.json_out:  # written after every command, so a cut-off run keeps what it has
            report["elapsed_s"] = time.perf_counter() - started
            Path(args.json_out).write_text(json.dumps(report, indent=1, default=str))
    report["elapsed_s"] = time.perf_counter() - started
    report["summary"] = lines
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1, default=str))
    print("\n".join(lines))
    print(f"{report['elapsed_s']:.0f} s; scratch files in {scratch}")


if __name__ == "__main__":
    main()
