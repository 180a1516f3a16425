"""Start and stop of a runtime with two process-hosted CPU workers, repeated in one process.

    PYTHONPATH=src python bench/worker_start.py            # workers forked from the template
    INFERMUX_FORK_WORKERS=0 PYTHONPATH=src python bench/worker_start.py   # fresh interpreters

The first start includes the worker template's own imports (or, without it, the children's);
later starts show what each run, tuner trial or worker restart in a long-lived process pays.
"""

import argparse
import json
import os
import time

from infermux.runtime import parse_plan
from infermux.runtime.session import start_runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--model", default="tests/tiny_models.py:tiny_cnn")
    ap.add_argument("--engine", default="onnxruntime")
    args = ap.parse_args()
    rows = []
    for _ in range(args.repeats):
        plan = {"name": "start", "models": [{"name": "m", "model": args.model, "replicas": [
            {"unit": "cpu", "engine": args.engine, "instances": 2, "batch": 4}]}],
            "dispatcher": {"cpu_workers": "process"},
            "load": {"scenario": "offline", "min_duration_s": 0.2, "min_queries": 16}}
        started = time.perf_counter()
        rt = start_runtime(parse_plan(plan, source="worker_start"))
        ready = time.perf_counter()
        rt.stop(drain=False)
        rows.append({"start_s": round(ready - started, 3),
                     "stop_s": round(time.perf_counter() - ready, 3)})
    print(json.dumps({"fork": os.environ.get("INFERMUX_FORK_WORKERS", "1") != "0",
                      "runs": rows}))


if __name__ == "__main__":
    main()
