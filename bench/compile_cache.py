"""torch.compile's artefacts kept between runs: build time cold vs warm, in two fresh processes.

python3 bench/compile_cache.py --model resnet18 --unit cpu --mode default
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
from infermux.engines import create_engine
from infermux.models import load_model
from infermux.units import discover, select_units
model, unit, mode, cache = sys.argv[1:5]
m = load_model(model)
u = select_units(unit, discover(with_runtimes=False))[0]
start = time.perf_counter()
runner = create_engine("torch").build(m, u, 1, {"compile": mode, "compile_cache_dir": cache})
print(json.dumps({"build_s": time.perf_counter() - start}))
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--unit", default="cpu")
    parser.add_argument("--mode", default="default")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        times = []
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", CHILD, args.model, args.unit, args.mode,
                                  cache], capture_output=True, text=True, check=True).stdout
            times.append(json.loads(out.strip().splitlines()[-1])["build_s"])
    print(f"| {args.model} | {args.unit} | {args.mode} | {times[0]:.1f} s | {times[1]:.1f} s | "
          f"{times[0] / times[1]:.1f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
