"""Per-request stage traces of `infermux serve --trace-requests N`: where a request waits.

A traced request (every Nth) is stamped with `time.perf_counter_ns` (CLOCK_MONOTONIC on Linux:
one clock for every process of the host, so a front's stamps and the runtime's compare) at each
hand-over on its way: the front received it and sent its descriptor; the runtime read the
frame, admitted and queued it; a worker took its batch, gathered, launched and collected it; its
outputs were written, its answer queued for the event loop, delivered by the loop and written
to the front; the front got it and resumed the request's handler. Each process appends its own
JSON lines (the runtime to the trace file, a front process to `<file>.<pid>`), buffered and
written at exit, so tracing costs nothing when off and a few dict writes per traced request
when on. `summarize` joins the lines by (front, request) and gives the p50/p99 of every gap
between consecutive stages, and of the traced requests' batches per bucket (items, time on
the device as the runner timed it); the server puts it in its summary (`--json`).

Which gap grows with load says where requests wait: the dispatcher's queue (`enqueued` →
`taken`) is the only wait that should.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["STAGES", "TRITON_SUFFIX", "RequestTrace", "summarize"]

#: Behind Triton's front (`--front triton`), Triton's own trace of the requests it sampled is
#: written beside the runtime's lines, to `<trace file>.triton`.
TRITON_SUFFIX = "triton"

#: The stages in the order a request passes them (a record holds those that apply to it: an
#: in-process front's requests have no front stages).
STAGES = (
    "front_received",   # a front process's handler called the runtime proxy
    "front_sent",       # its descriptor handed to the link (written in the same turn)
    "frame_read",       # the runtime process read the frame holding it
    "admitted",         # admitted (InferenceCore: the request span's start)
    "enqueued",         # its items in the dispatcher's queue
    "taken",            # a worker took the batch holding it
    "gather_begin",     # the batch's rows started into the input buffer
    "gather_end",
    "launch",           # the batch's launch began (its copies and work queued on the device)
    "launched",         # the launch call returned (its time is the host's, under the lock)
    "collect",          # the batch's end (outputs ready on the host)
    "reported",         # the worker reported the batch (`Dispatcher.finished`)
    "outputs_written",  # the request's outputs written (its last item's batch)
    "answer_queued",    # its answer handed to the event loop (the request span's end)
    "delivered",        # the event loop took it
    "written",          # handed to the front's link (or the in-process handler resumed)
    "front_got",        # the front process read the answer
    "front_resumed",    # the request's handler resumed with it
)


class RequestTrace:
    """One process's trace lines: chooses the traced requests, buffers, appends at `close`."""

    def __init__(self, path: str, every: int) -> None:
        self.path = path
        self.every = max(1, int(every))
        self._lines: list[dict[str, Any]] = []

    def wants(self, request_id: int) -> bool:
        """Whether the request numbered `request_id` (1, 2, ...) is traced."""
        return request_id % self.every == 0

    def add(self, record: dict[str, Any]) -> None:
        """Keep one request's record (stage → ns, and its ids)."""
        self._lines.append(record)

    def close(self) -> int:
        """Append the records to the file; how many."""
        lines, self._lines = self._lines, []
        if lines:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in lines))
        return len(lines)


def _records(paths: Iterable[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            out.extend(json.loads(line) for line in f if line.strip())
    return out


def summarize(path: str, window_ns: tuple[int, int] | None = None) -> dict[str, Any]:
    """p50/p99 (ms) of each gap between consecutive stages, over the traced requests.

    Reads `path` (the runtime's lines) and `path.<pid>` (each front's), joined by (front pid,
    request id). A gap is named `from->to` between the stages a request has, in `STAGES` order.
    Behind Triton's front, `path.triton` (Triton's own trace) is summarized apart (`triton`).
    `window_ns`: only the requests whose first stage falls in [begin, end) (clock ns).
    """
    runtime = _records([path] if os.path.exists(path) else [])
    front = _records(p for p in glob.glob(glob.escape(path) + ".*") if p[len(path) + 1:].isdigit())
    joined: dict[tuple[int, int], dict[str, int]] = {}
    # request → its batch's bucket, items, device ns, gather path, device idle before it (ns)
    batches: dict[tuple[int, int], tuple[int, int, int, str, int]] = {}
    for r in runtime:
        joined[(r.get("front", 0), r["id"])] = {k: v for k, v in r.items() if k in STAGES}
        if "bucket" in r:
            batches[(r.get("front", 0), r["id"])] = (
                r["bucket"], r["items"], r["device_ns"], r.get("gather_path", ""),
                r.get("idle_before_ns", 0))
    for r in front:
        key = (r["front"], r["id"])
        if key in joined:
            joined[key].update({k: v for k, v in r.items() if k in STAGES})
    kept, timing = _gap_summary(joined.items(), STAGES, window_ns)
    by_bucket: dict[int, tuple[list[int], list[float], list[float]]] = {}
    paths: dict[str, int] = {}
    for key in kept:
        if key in batches:
            bucket, items, device_ns, gather_path, idle_ns = batches[key]
            sizes, device, idle = by_bucket.setdefault(bucket, ([], [], []))
            sizes.append(items)
            if device_ns:
                device.append(device_ns / 1e6)
            idle.append(idle_ns / 1e6)
            if gather_path:
                paths[gather_path] = paths.get(gather_path, 0) + 1
    return {
        **timing,
        # The traced requests' batches by bucket (a batch counted once per traced request in
        # it): their items, their time on the device as the runner timed it, and how long the
        # worker's device had nothing of its own to run while the batch's first item waited.
        "batches": {bucket: {"requests": len(sizes), "mean_items": round(float(np.mean(sizes)), 1),
                             "device": _stats(device) if device else None,
                             "idle_before": _stats(idle)}
                    for bucket, (sizes, device, idle) in sorted(by_bucket.items())},
        # Where those batches' gathers ran (a pipelined GPU worker's: `Batch.gather_path`).
        "gather_paths": paths,
        # Behind Triton's front: its own trace of the requests it sampled.
        **({"triton": triton} if (triton := _triton(f"{path}.{TRITON_SUFFIX}", window_ns))
           else {}),
    }


#: Triton's trace timestamps in the order a request passes them (those of either protocol).
TRITON_STAGES = ("HTTP_RECV_START", "HTTP_RECV_END", "GRPC_WAITREAD_START", "GRPC_WAITREAD_END",
                 "REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
                 "COMPUTE_OUTPUT_START", "COMPUTE_END", "INFER_RESPONSE_COMPLETE",
                 "GRPC_SEND_START", "HTTP_SEND_START", "REQUEST_END", "GRPC_SEND_END",
                 "HTTP_SEND_END")


def _triton(path: str, window_ns: tuple[int, int] | None) -> dict[str, Any] | None:
    """p50/p99 of the gaps between Triton's stages over its traced requests, or None.

    Triton's file is a JSON array of entries, each an `id` with its model or with some of its
    `timestamps` (name, ns). Its clock is the runtime's (CLOCK_MONOTONIC), but its request ids
    are its own, so its requests are summarized apart: from the front's read of the request to
    the response sent, with the backend's span (`COMPUTE_START` → `COMPUTE_END`: the
    runtime's part, up to the response's release) in between.
    """
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            entries = json.load(f)
        except json.JSONDecodeError:
            return None
    stamps: dict[int, dict[str, int]] = {}
    for entry in entries:
        for t in entry.get("timestamps", ()):
            if t.get("name") in TRITON_STAGES:
                stamps.setdefault(entry["id"], {})[t["name"]] = int(t["ns"])
    kept, timing = _gap_summary(stamps.items(), TRITON_STAGES, window_ns, name=str.lower)
    return {"path": path, **timing} if kept else None


def _stats(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values)
    return {"p50_ms": round(float(np.percentile(arr, 50)), 4),
            "p99_ms": round(float(np.percentile(arr, 99)), 4),
            "mean_ms": round(float(arr.mean()), 4), "count": len(values)}


def _gap_summary(stamped: Iterable[tuple[Any, dict[str, int]]], stages: tuple[str, ...],
                 window_ns: tuple[int, int] | None,
                 name: Callable[[str], str] = str) -> tuple[list[Any], dict[str, Any]]:
    """The keys of the requests kept, and their `requests`, `total` and `gaps`.

    Over (key, stage → ns) records: each gap is `from->to` between consecutive stages a request
    has (named by `name`, in `stages` order). A request is kept when it has a stage and, with
    `window_ns`, when its first stage falls in [begin, end).
    """
    gaps: dict[str, list[float]] = {}
    totals: list[float] = []
    kept = []
    for key, marks in stamped:
        have = [s for s in stages if s in marks]
        if not have or (window_ns is not None
                        and not window_ns[0] <= marks[have[0]] < window_ns[1]):
            continue
        kept.append(key)
        for a, b in itertools.pairwise(have):
            gaps.setdefault(f"{name(a)}->{name(b)}", []).append((marks[b] - marks[a]) / 1e6)
        if len(have) > 1:
            totals.append((marks[have[-1]] - marks[have[0]]) / 1e6)
    order = {f"{name(a)}->{name(b)}": (i, j) for i, a in enumerate(stages)
             for j, b in enumerate(stages)}
    return kept, {"requests": len(kept), "total": _stats(totals) if totals else None,
                  "gaps": {g: _stats(gaps[g]) for g in sorted(gaps, key=order.__getitem__)}}
