"""`study multi-instance` and `study pipeline` with their defaults on a one-GPU host, one command.

Each study runs through the CLI as a user would run it (units `auto`, default models, batches
and instances), one after the other, with only its budget set so that both end within about
nine minutes. Each study's JSON, its printed header and table, and the database holding every
point's run go under OUT; without plotly the HTML report is skipped with a line and the table
is still printed and stored. `OUT/summary.json` holds, per study: its units and models and why,
its wall time, its points by status, any central point not measured, and the paper's claims
beside this machine's figures.

    PYTHONPATH=src python3 bench/studies_gpu.py /tmp/studies
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Each study's budget, together under the 9 minutes a command may take: on an H200 a 150 s
#: budget held all but the batch-64 pairs of the multi-instance grid's 21 central points
#: (7 combinations × 3 batches, CPU workers as processes); the pipeline partitions three
#: networks over the GPU and the CPU.
_BUDGETS_S = {"multi-instance": 240, "pipeline": 260}


def _run(name: str, budget_s: int, out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "infermux", "study", name, "--budget", f"{budget_s}s",
               "--db", str(out / "studies.db")]
    started = time.perf_counter()
    # The table as printed (and the report, where plotly draws it, in OUT), then the JSON.
    shown = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    (out / f"{name}.log").write_text(shown.stdout + shown.stderr)
    if shown.returncode != 0:
        return {"study": name, "returncode": shown.returncode, "wall_s": wall_s,
                "error": shown.stderr.strip().splitlines()[-1:] or ["(no message)"]}
    run_id = _last_study_run(out / "studies.db")
    data = _from_store(out / "studies.db", run_id)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    points = data["points"]
    counts: dict[str, int] = {}
    for p in points:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    central = [p for p in points if _central(name, p)]
    return {"study": name, "returncode": 0, "wall_s": wall_s, "budget_s": budget_s,
            "run_id": run_id, "units": data["config"].get("resolved_units"),
            "units_why": data["config"].get("units_why"),
            "models": data["config"].get("models"),
            "models_why": data["config"].get("models_why"),
            "points": counts,
            "central_not_measured": [f"{p['variant']} b{p['params'].get('batch')}: "
                                     f"{p['status']} {p.get('error') or ''}".strip()
                                     for p in central if p["status"] != "ok"],
            "claims": data["headline"].get("claims"),
            "findings": data["headline"].get("findings")}


def _central(name: str, point: dict[str, Any]) -> bool:
    prm = point["params"]
    if name == "multi-instance":
        return prm.get("instances") == 1
    return prm.get("mode") in ("single", "pipeline")


def _last_study_run(db: Path) -> int:
    from infermux.store import Store

    with Store(db) as store:
        row = store.connection.execute(
            "SELECT MAX(id) FROM runs WHERE kind = 'study'").fetchone()
    return int(row[0])


def _from_store(db: Path, run_id: int) -> dict[str, Any]:
    """The study's config, headline and points, as stored."""
    from infermux.store import Store

    with Store(db) as store:
        config_json, summary_json = store.connection.execute(
            "SELECT config_json, summary_json FROM runs WHERE id = ?", (run_id,)).fetchone()
        points = store.study_points(run_id)
    summary = json.loads(summary_json or "{}")
    return {"run_id": run_id, "config": json.loads(config_json), "summary": summary,
            "headline": summary.get("headline") or {}, "points": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory for each study's JSON, log, database and report")
    parser.add_argument("--studies", default="multi-instance,pipeline")
    parser.add_argument("--budgets", default="",
                        help="seconds per study, e.g. pipeline=120 (default: "
                             + ", ".join(f"{k}={v}" for k, v in _BUDGETS_S.items()) + ")")
    args = parser.parse_args()
    budgets = dict(_BUDGETS_S)
    for item in filter(None, args.budgets.split(",")):
        name, _, seconds = item.partition("=")
        if name not in budgets or not seconds.isdigit():
            parser.error(f"--budgets {item!r}: use NAME=SECONDS with NAME one of "
                         f"{', '.join(budgets)}")
        budgets[name] = int(seconds)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    import torch

    host = {"python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpu_cores": os.cpu_count()}
    results = [_run(name, budgets[name], out) for name in args.studies.split(",")]
    summary = {"host": host, "studies": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for r in results:
        print(f"{r['study']}: {r['wall_s']:.0f} s, points {r.get('points')}, central not "
              f"measured: {r.get('central_not_measured') or 'none'}")
        for c in r.get("claims") or []:
            print(f"  {c['verdict']:>20}  {c['claim']}: {c['here']}")
    print(f"summary → {out / 'summary.json'}")


if __name__ == "__main__":
    main()
