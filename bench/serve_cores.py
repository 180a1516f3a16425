r"""Who uses the host's cores while `infermux serve --fronts N` is driven to its ceiling.

A served ceiling that neither more front processes nor a faster runtime process raises is set
somewhere else: this bench serves a plan (bench/serve_gpu.py's `digits` or `resnet50`, batch
and instances as given), drives it with perf_analyzer over gRPC (`--shared-memory system`,
single items, one concurrency; or over HTTP), and reads, over a window in the middle of the
run, the host's busy share (/proc/stat) and the cores used by each side: the runtime process,
the front processes, perf_analyzer, and the runtime's other child processes (CPU workers,
templates). Each row also keeps perf_analyzer's requests/s, p99 and the server's own split of
a request (queue, compute, the rest). Optionally the runtime process's interpreter-lock share
is sampled with py-spy (`--py-spy PATH`: the share of samples in which some thread holds the
lock, 1.0 meaning the process is bound by it, and which threads and functions hold it), and so
is one front (where its samples are: the
innermost frames' shares, and the share with an infermux frame on the stack).

    python bench/serve_cores.py --perf-analyzer PA --json cores.json \
        --cases digits:8:256:64:2,digits:8:256:64:2:async,resnet50:8:256:64:2
    python bench/serve_cores.py --device cpu --perf-analyzer PA --json cpu.json \
        --cases digits:2:32:32:1 --py-spy .venv/bin/py-spy

A case is `model:fronts:concurrency:batch:instances[:async][:http][:triton[:np1]][:asyncio][:age0]`
(`async`: perf_analyzer's `--async` mode instead of one thread per concurrent request; `http`:
HTTP/REST instead of gRPC; `triton`: `--front triton`, Triton's server as the front with
`fronts` instances per model, whose cores are counted as the fronts'; `np1`: its model
instances on the numpy 1 of `--triton-python-path`; `asyncio`: the server's processes on
asyncio's own event loop, `--loop asyncio`, instead of uvloop; `age0`: `--connection-age 0`,
gRPC connections left where they first landed, where `--connection-age AGE` has the other
cases' servers re-place them on the least loaded front).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_gpu import cpu_s, perf_analyzer_env, plans, start_server, stop_server

#: Seconds after perf_analyzer starts before the window opens (its warm-up), and the window.
_SETTLE_S = 6.0
_WINDOW_S = 6.0


def _host_ticks() -> tuple[int, int]:
    """(all, idle + iowait) jiffies of the host, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]


def _children(pid: int) -> list[int]:
    done = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in done.stdout.split()]


def fronts_and_others(pid: int) -> tuple[list[int], list[int]]:
    """The process's children: (its front processes, the others: CPU workers, templates).

    With `--front triton` the fronts are `tritonserver` and its Python-backend stubs.
    """
    fronts: list[int] = []
    others: list[int] = []
    for child in _children(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"tritonserver" in command:
            fronts += [child, *_children(child)]
            continue
        (fronts if b"infermux.serve.fronts" in command else others).append(child)
    return fronts, others


def _lock_share(py_spy: str, pid: int, out: Path) -> float | None:
    """Share of py-spy's samples (500 Hz, 4 s) in which a thread of `pid` holds the lock."""
    raw = out / f"gil-{pid}.txt"
    subprocess.run([py_spy, "record", "--pid", str(pid), "--duration", "4", "--rate", "500",
                    "--format", "raw", "--output", str(raw), "--nonblocking", "--gil"],
                   capture_output=True, check=False)
    if not raw.exists():
        return None
    samples = sum(int(line.rpartition(" ")[2]) for line in raw.read_text().splitlines() if line)
    return samples / (500 * 4)


#: What a sampled stack's thread is, by a frame on it.
_THREADS = (("worker", "Worker._main"), ("event loop", "BaseEventLoop.run_forever"))
#: Frames every stack of a thread has (its start, the loop's turn): left out of the shares.
_SCAFFOLD = ("threading.py", "<frozen runpy>", "typer/", "infermux/__main__.py",
             "infermux/cli/", "asyncio/", "serve_plan (infermux/serve/server.py)",
             "Worker._main (", "Worker._loop")


def _lock_holders(raw: Path, top: int = 12) -> dict[str, Any] | None:
    """What holds the runtime process's lock, from `_lock_share`'s samples.

    Shares by thread and, per function, of the samples with it on the stack (inclusive) and
    innermost (its own).
    """
    if not raw.exists():
        return None
    threads: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n, frames = int(count), stack.split(";")
        names = [re.sub(r":\d+\)$", ")", f) for f in frames[1:]]  # no line numbers
        total += n
        head = next((kind for kind, marker in _THREADS if any(marker in f for f in names)),
                    names[-1] if names else frames[0])
        threads[head] = threads.get(head, 0) + n
        for name in set(names):
            if not any(skip in name for skip in _SCAFFOLD):
                inclusive[name] = inclusive.get(name, 0) + n
        if names:
            own[names[-1]] = own.get(names[-1], 0) + n
    if not total:
        return None

    def shares(d: dict[str, int]) -> list[tuple[str, float]]:
        return [(k, round(v / total, 4)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return {"samples": total, "threads": shares(threads), "inclusive": shares(inclusive),
            "own": shares(own)}


def _front_profile(py_spy: str, pid: int, out: Path) -> dict[str, Any] | None:
    """One front's stacks (py-spy, 500 Hz, 4 s): the innermost frames' shares, and infermux's.

    `infermux_share` is the share of samples with an infermux frame anywhere on the stack
    (the handler, the slab, the link); what is left is the protocol stack's and the loop's.
    """
    raw = out / f"front-{pid}.txt"
    subprocess.run([py_spy, "record", "--pid", str(pid), "--duration", "4", "--rate", "500",
                    "--format", "raw", "--output", str(raw), "--nonblocking"],
                   capture_output=True, check=False)
    if not raw.exists():
        return None
    innermost: dict[str, int] = {}
    ours = total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n, frames = int(count), stack.split(";")
        total += n
        innermost[frames[-1]] = innermost.get(frames[-1], 0) + n
        ours += n if any("infermux/" in f and "fronts.py" not in f for f in frames) else 0
    if not total:
        return None
    top = sorted(innermost.items(), key=lambda kv: -kv[1])[:8]
    return {"samples": total, "infermux_share": ours / total,
            "innermost": [(frame, n / total) for frame, n in top]}


def _case(args: argparse.Namespace, spec: str, out: Path) -> dict[str, Any]:
    model, fronts, concurrency, batch, instances, *flags = spec.split(":")
    mode = "async" if "async" in flags else "sync"
    protocol = "http" if "http" in flags else "grpc"
    plan = plans(args.device)[model]
    plan.pop("load", None)
    replica = plan["models"][0]["replicas"][0]
    replica.update(batch=int(batch), instances=int(instances))
    path = out / f"{model}-b{batch}x{instances}.json"
    path.write_text(json.dumps(plan))
    front = "triton" if "triton" in flags else "own"
    extra = ["--front", front, "--loop", "asyncio" if "asyncio" in flags else "auto"]
    if "age0" in flags:
        extra += ["--connection-age", "0"]
    elif args.connection_age:
        extra += ["--connection-age", args.connection_age]
    if "np1" in flags:
        if not args.triton_python_path:
            raise SystemExit(f"case {spec}: np1 needs --triton-python-path")
        extra += ["--triton-python-path", args.triton_python_path]
    server, ready = start_server(path, out, int(fronts), extra=extra,
                                 tag=f"-c{concurrency}-{mode}-{protocol}-{front}"
                                     f"{'-np1' if 'np1' in flags else ''}"
                                     f"{'-asyncio' if 'asyncio' in flags else ''}"
                                     f"{'-age0' if 'age0' in flags else ''}")
    name = plan["models"][0]["name"]
    cmd = [args.perf_analyzer, "-m", name, "-u", f"127.0.0.1:{ready[protocol + '_port']}",
           "-i", protocol,
           "-b", "1", "--concurrency-range", f"{concurrency}:{concurrency}",
           # With profiles to take after the window, windows long enough that the load is on.
           "--measurement-interval", "8000" if args.py_spy else "4000",
           "--stability-percentage", "50", "--max-trials", "4",
           "--shared-memory", "system", *(["--async"] if mode == "async" else [])]
    row: dict[str, Any] = {"case": spec, "plan": plan, "command": " ".join(cmd)}
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(_SETTLE_S)
        front_pids, other_pids = fronts_and_others(server.pid)
        sides = {"runtime": [server.pid], "fronts": front_pids, "perf_analyzer": [client.pid],
                 "workers": other_pids}
        before = {k: cpu_s(v) for k, v in sides.items()}
        host0, t0 = _host_ticks(), time.monotonic()
        time.sleep(_WINDOW_S)
        after = {k: cpu_s(v) for k, v in sides.items()}
        host1, seconds = _host_ticks(), time.monotonic() - t0
        row["cores_used"] = {k: (after[k] - before[k]) / seconds for k in sides}
        row["host_busy"] = 1 - (host1[1] - host0[1]) / max(1, host1[0] - host0[0])
        row["host_cores"] = os.cpu_count()
        if args.py_spy:
            row["runtime_lock_share"] = _lock_share(args.py_spy, server.pid, out)
            row["runtime_lock_holders"] = _lock_holders(out / f"gil-{server.pid}.txt")
            if front_pids and front == "own":  # Triton's fronts are C++: nothing to sample
                row["front_profile"] = _front_profile(args.py_spy, front_pids[0], out)
        try:
            shown = client.communicate(timeout=240)[0]
        except subprocess.TimeoutExpired:
            client.kill()
            shown = client.communicate()[0] + "\nperf_analyzer did not finish within 240 s"
            row["error"] = "perf_analyzer did not finish within 240 s"
    finally:
        if client.poll() is None:
            client.kill()
        row["server"] = stop_server(server)["status"]
    row["perf_analyzer"] = [ln.strip() for ln in shown.splitlines() if any(
        k in ln for k in ("Throughput", "p99 latency", "Avg request latency", "within 240"))]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="where the report goes")
    p.add_argument("--perf-analyzer", required=True, help="path of perf_analyzer")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--cases", default="digits:8:256:64:2,resnet50:8:256:64:2",
                   help="model:fronts:concurrency:batch:instances[:async][:http][:triton[:np1]], "
                        "comma-separated")
    p.add_argument("--triton-python-path", help="a numpy<2 install, for the cases marked np1")
    p.add_argument("--py-spy", help="py-spy executable: the runtime process's lock share")
    p.add_argument("--connection-age", help="serve's --connection-age for the cases not marked "
                                            "age0 (e.g. 5s; default: serve's own)")
    args = p.parse_args()
    perf_analyzer_env(args.perf_analyzer)
    out = Path(args.json).resolve().parent / (Path(args.json).stem + "-logs")
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"rows": []}
    for spec in args.cases.split(","):
        row = _case(args, spec, out)
        report["rows"].append(row)
        Path(args.json).write_text(json.dumps(report, indent=1))
        cores = ", ".join(f"{k} {v:.2f}" for k, v in row["cores_used"].items())
        share = row.get("runtime_lock_share")
        print(f"{spec}: host busy {row['host_busy']:.0%} of {row['host_cores']} cores; cores "
              f"used: {cores}" + (f"; runtime lock share {share:.2f}" if share is not None
                                  else ""), flush=True)
        for line in row["perf_analyzer"]:
            print(f"  {line}", flush=True)
        holders = row.get("runtime_lock_holders")
        if holders:
            for what in ("threads", "own", "inclusive"):
                print(f"  runtime lock, {what}: " + "; ".join(
                    f"{share:.0%} {name}" for name, share in holders[what][:10]), flush=True)
        profile = row.get("front_profile")
        if profile:
            print(f"  one front's samples: {profile['infermux_share']:.0%} with an infermux "
                  "frame; innermost: " + "; ".join(f"{share:.0%} {frame}" for frame, share
                                                    in profile["innermost"][:5]), flush=True)


if __name__ == "__main__":
    main()
