"""Server peak / offline: the batching rules (and CPU workers' hosting) alternated on built plans.

The plan is the one a user would get (`--tune S`: `infermux tune --scenario server` for S
seconds, whose server search ranks its finalists by find-peak), a plan file (`--plan FILE`),
or one built from `--model/--unit/--engine/--batch/--instances`. It is built once per hosting
and bucket set (`--cpu-workers process,thread` builds it both ways, `--buckets pow2,fine` with
each bucket set; each runtime kept, the idle ones parked);
then, round after round, each (hosting, buckets, rule) runs the offline trial and `--find-peak`
(bisection, then the edge repeated) on the same workers: `queue_delay` (wait
`max_queue_delay_ms` for a fuller batch) and `deadline` (partial batches wait while the oldest
query can still finish within the bound). Taking turns, the order flipped every round, puts
every variant on the same host noise. Every trial keeps its latency phases (queueing, batching
wait, launch, run, host overhead, hand-over; runtime.metrics) and the load generator's issue
lag, so a slow query's time is accounted for.

    # the ResNet50 fp16 server plan on one GPU (H100: about 5 minutes)
    python bench/server_batching.py --model resnet50 --unit cuda:0/fp16 --batch 64 \
        --instances 2 --compile default --p99 15 --duration 3 --rounds 2 --json batching.json
    # power-of-two against fine batch buckets (`--buckets`, each a runtime of its own),
    # alternated ABBA under the default rule (H200: about 4 minutes)
    python bench/server_batching.py --model resnet50 --unit cuda:0/fp16 --batch 64 \
        --instances 2 --compile default --p99 15 --duration 3 --rounds 2 \
        --buckets pow2,fine --rules queue_delay --json buckets.json
    # the plan the server tune writes, three find-peaks under the batching rule it chose
    # (H200: about 6 minutes)
    python bench/server_batching.py --model resnet50 --unit cuda:0/fp16 --tune 150 --p99 15 \
        --duration 3 --rounds 3 --rules plan --max-s 330 --json tuned.json
    # mobilenet_v3_small on a 2-core CPU, p99 50 ms: the tuned plan, both hostings and rules
    # (the host to itself: about 6 minutes; LiteRT's conversion, ~90 s here, and torch, 4-10x
    # slower than the others on these cores, are left out of the tune to fit)
    python bench/server_batching.py --model mobilenet_v3_small --unit cpu --tune 150 \
        --tune-engines onnxruntime,openvino --cpu-workers process,thread --p99 50 \
        --duration 2 --queries 128 --rounds 1 --max-s 300 --json batching_cpu.json
    # the same hostings at fixed rates, alternated (a loaded host, where a search finds none)
    python bench/server_batching.py --model mobilenet_v3_small --unit cpu --engine openvino \
        --batch 4 --instances 2 --compile none --cpu-workers process,thread --rules queue_delay \
        --rates 10,30 --p99 50 --duration 3 --queries 64 --rounds 3 --json hosting_cpu.json

Each trial prints a line as it ends (stderr), and each row the host's 1-minute load before and
after it: on a shared CPU host the other processes' load decides the batch's own time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from infermux.runtime import parse_plan
from infermux.runtime.host_probe import describe_probes, plan_cuda_device, probe_host
from infermux.runtime.host_watch import HostWatch
from infermux.runtime.peak import TrialRun, device_stall, run_load, run_trial
from infermux.runtime.plan import Plan
from infermux.runtime.session import start_runtime
from infermux.runtime.trial import TrialSummary

RULES = ("queue_delay", "deadline")
HOSTINGS = ("process", "thread")
BUCKETS = ("pow2", "fine", "none")


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    options = {"compile": args.compile} if args.compile != "none" else {}
    return {
        "name": f"b{args.batch}x{args.instances}",
        "models": [{"name": "m", "model": args.model, "replicas": [
            {"unit": args.unit, "engine": args.engine, "instances": args.instances,
             "batch": args.batch, "batch_buckets": "pow2", "options": options}]}],
        "dispatcher": {"max_queue_delay_ms": args.delay_ms},
        "load": {"scenario": "server", "p99_bound_ms": args.p99},
    }


def _tuned(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """`infermux tune --scenario server` for `args.tune` seconds: its plan and what it saw."""
    from infermux.models import ModelSpec
    from infermux.tune import Constraints, TuneRequest, run_tune

    request = TuneRequest(models=[ModelSpec(args.model, None, None)], units=args.unit,
                          engines=args.tune_engines, scenario="server",
                          constraints=Constraints(p99_bound_ms=args.p99), budget_s=args.tune,
                          fresh=True)

    def said(phase: str, info: dict[str, Any]) -> None:
        t = info["trial"]
        figure = f"{t.items_per_s:.1f} items/s" if t.ok else f"{t.status}: {t.error}"
        print(f"  tune {phase:>9} {t.candidate.label()}: {figure}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    report = run_tune(request, progress=said)
    if report.plan is None:
        ok = [t for t in report.result.trials if t.ok]
        closest = min(ok, key=lambda t: t.p99_ms or float("inf"), default=None)
        said = "" if closest is None or closest.p99_ms is None else (
            f" (the lowest batch p99 measured, {closest.candidate.label()}: "
            f"{closest.p99_ms:.1f} ms; a server plan's batch must hold half the bound)")
        raise SystemExit(f"the tune found no plan within p99 {args.p99:g} ms in {args.tune:g} s"
                         f"{said}: give it a longer --tune or a plan with --plan")
    best = report.result.best
    return report.plan, {"budget_s": args.tune, "seconds": time.perf_counter() - started,
                         "best": best.candidate.label() if best else None,
                         "server_peaks": report.server_peaks,
                         # Which CPU hosting the tune wrote, and on what figures.
                         "hosting": report.hosting,
                         # Which batching rule it wrote: the plan's peak under each.
                         "batching": report.batching,
                         # Whether ONNX Runtime's intra-op threads spin in the plan written.
                         "spinning": report.spinning}


def _with_load(plan: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The plan with the bench's server load: its bound, trial length and query count."""
    load = {**plan.get("load", {}), "scenario": "server", "p99_bound_ms": args.p99,
            "min_duration_s": args.duration, "min_queries": args.queries}
    if args.confirm_duration is not None:
        load["confirm_duration_s"] = args.confirm_duration
    load.pop("find_peak", None)
    load.pop("rate_qps", None)
    return {**plan, "load": load}


def _hosted(plan: dict[str, Any], hosting: str | None, buckets: str | None = None) -> Plan:
    """The plan with its CPU workers hosted `hosting` and every replica's `batch_buckets`."""
    if hosting is not None:
        plan = {**plan, "dispatcher": {**plan.get("dispatcher", {}), "cpu_workers": hosting}}
    if buckets is not None:
        plan = {**plan, "models": [
            {**m, "replicas": [{**r, "batch_buckets": buckets} for r in m.get("replicas", [])]}
            for m in plan["models"]]}
    return parse_plan(plan, source="bench plan")


def _brief(record: TrialSummary) -> dict[str, Any]:
    """A trial's figures that say where the time went (JSON, as the results file keeps them)."""
    model = next(iter(record.models.values()), None)
    server = record.server
    return {
        "scenario": record.scenario, "rate_qps": record.rate_qps,
        "valid": record.valid, "items_per_s": record.items_per_s,
        "p99_ms": record.latency.p99_ms if record.latency else None,
        "issue_lag": server.issue_lag.to_dict() if server and server.issue_lag else (
            {} if server else None),
        "load_generator_lag": server.load_generator_lag if server else None,
        "phases": model.phases.to_dict() if model else None,
        "mean_batch": model.mean_batch if model else None,
        "batch_histogram": model.batch_histogram if model else None,
        "worker_batch_latency": {name: w.batch_latency.to_dict() if w.batch_latency else {}
                                 for name, w in record.workers.items()},
        # The runtime process's collector pauses (`runtime.gcpause`): a full collection holds
        # the interpreter, the load generator's included.
        "gc": record.gc,
    }


def _say(brief: dict[str, Any]) -> None:
    """One line per trial as it ends: a slow host shows its progress, and a stall where it is."""
    rate = brief["rate_qps"]
    lag = (brief.get("issue_lag") or {}).get("p99_ms")
    p99 = brief.get("p99_ms")
    print(f"  {brief['scenario']:>7} {'' if rate is None else f'{rate:9.1f} qps':>13}  "
          f"{brief.get('items_per_s') or 0:8.1f} items/s  p99 "
          f"{'-' if p99 is None else f'{p99:.1f}'} ms  valid {brief['valid']}  issue lag p99 "
          f"{'-' if lag is None else f'{lag:.1f}'} ms  mean batch {brief.get('mean_batch')}"
          + (f"  device stall {stall['longest_ms']:.1f} ms ({stall['batches']} batches)"
             if (stall := brief.get("device_stall")) else "")
          + (f"  host stall {hs['longest_ms']:.0f} ms" if (hs := brief.get("host_stall")) else "")
          + (f"  full gc {gcs['full_collections']} (longest {gcs['full_max_ms']:.0f} ms, "
             f"of it on the CPU {gcs.get('full_max_cpu_ms', 0):.0f} ms)"
             if (gcs := brief.get("gc")) and gcs.get("full_collections") else ""),
          file=sys.stderr, flush=True)


def _one(rt: Any, rule: str, settings: dict[str, Any], shares: dict[str, float],
         bound: float, rates: list[float], watch: HostWatch) -> dict[str, Any]:
    rt.set_batching(rule)
    records: list[dict[str, Any]] = []

    def keep(run: TrialRun) -> None:
        # Batches that stopped on the device in this trial (`runtime.peak.device_stall`).
        records.append({**_brief(run.record), "device_stall": device_stall(run.batches, bound),
                        **({"min_duration_s": run.record.settings["min_duration_s"]}
                           if run.record.settings and run.record.scenario == "server" else {})})
        _say(records[-1])

    if rates:
        # Fixed rates instead of the search: on a loaded host every variant is judged at the
        # same loads, and a search that finds no valid rate does not halve down to minutes-long
        # trials at a few queries/s.
        host_before = probe_host(device=plan_cuda_device(rt.plan))
        keep(run_trial(rt, {**settings, "scenario": "offline"}, shares))
        for rate in rates:
            keep(run_trial(rt, {**settings, "scenario": "server", "rate_qps": rate}, shares))
        return {"rule": rule, "offline_items_per_s": records[0]["items_per_s"] or 0.0,
                "peak_qps": None, "ratio": None, "edge_confirmed": None, "p99_spread_ms": None,
                "notes": [], "reason": None, "at_peak": None,
                "host": {"before": host_before.to_dict()}, "trials": records}
    # The search `infermux run --find-peak` runs (`runtime.peak.run_load`): the offline trial
    # and the server rates, stalled trials run again, the host probed before and after.
    peak = run_load(rt, {**settings, "scenario": "server", "find_peak": True,
                         "p99_bound_ms": bound}, keep=keep, shares=shares, watch=watch)
    assert peak is not None, "interrupted"
    # The server trials are the search's, in its order (the offline ones before and after).
    servers = [r for r in records if r["scenario"] == "server"]
    for t, r in zip(peak["trials"], servers, strict=True):
        # Which runs confirmed the edge, went halfway down, or were run again (the host stopped).
        for flag in ("repeat", "between", "disturbed"):
            r[flag] = bool(t.get(flag))
        r["host_stall"] = t.get("host_stall")
    at_peak = [r for r in servers if r["rate_qps"] == peak["peak_qps"] and r["valid"]]
    return {"rule": rule, "offline_items_per_s": peak["offline_items_per_s"],
            "peak_qps": peak["peak_qps"], "ratio": peak["peak_fraction_of_offline"],
            "edge_confirmed": peak["edge_confirmed"], "p99_spread_ms": peak["p99_spread_ms"],
            "offline_after_items_per_s": peak["offline_after_items_per_s"],
            "offline_drift": peak["offline_drift"],
            "notes": peak.get("notes", []), "reason": peak["reason"],
            "at_peak": at_peak[-1] if at_peak else None, "host": peak["host"],
            "host_stalls": peak["host_stalls"],
            "offline_host_stalls": peak["offline_host_stalls"], "trials": records}


def _names(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise SystemExit(f"{flag} {text!r}: use a comma list of {', '.join(allowed)}")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--unit", default="cuda:0/fp16")
    parser.add_argument("--engine", default="torch", help="the built plan's engine")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--compile", default="default", help="torch.compile mode, or none")
    parser.add_argument("--plan", help="measure this plan file instead of building one")
    parser.add_argument("--tune", type=float, metavar="S",
                        help="measure the plan `infermux tune --scenario server` writes in S s")
    parser.add_argument("--tune-engines", default="auto",
                        help="engines the tune considers (auto, or a comma list)")
    parser.add_argument("--cpu-workers", default="",
                        help="host CPU workers as process, thread or both (process,thread: "
                             "alternated); default: as the plan says")
    parser.add_argument("--rules", default=",".join(RULES),
                        help="batching rules to alternate; `plan`: the rule the plan (or the "
                             "tune) wrote")
    parser.add_argument("--buckets", default="",
                        help="batch bucket sets to alternate, e.g. pow2,fine (default: the plan's)")
    parser.add_argument("--rates", default="",
                        help="server rates (queries/s, comma list) run by every variant instead "
                             "of the peak search")
    parser.add_argument("--delay-ms", type=float, default=2.0,
                        help="max_queue_delay_ms (the queue_delay rule's wait)")
    parser.add_argument("--p99", type=float, default=15.0, help="the bound, ms")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per trial")
    parser.add_argument("--queries", type=int, default=1024, help="min_queries per trial")
    parser.add_argument("--confirm-duration", type=float, default=None,
                        help="seconds of each run that confirms the edge (default: "
                             "runtime.peak.CONFIRM_SCALE x --duration)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-s", type=float, default=300.0,
                        help="start no find-peak after this many seconds")
    parser.add_argument("--json", dest="json_path", required=True)
    args = parser.parse_args()
    if args.plan and args.tune:
        raise SystemExit("--plan and --tune both given: measure a plan file or a tuned plan")
    rules = _names(args.rules, (*RULES, "plan"), "--rules")
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"--rates {args.rates!r}: give queries/s as a comma list, e.g. "
                         "10,20") from None
    if any(r <= 0 for r in rates):
        raise SystemExit(f"--rates {args.rates!r}: every rate must be positive")
    hostings: list[str | None] = (list(_names(args.cpu_workers, HOSTINGS, "--cpu-workers"))
                                  if args.cpu_workers else [None])
    bucket_sets: list[str | None] = (list(_names(args.buckets, BUCKETS, "--buckets"))
                                     if args.buckets else [None])
    started = time.perf_counter()
    out: dict[str, Any] = {"args": vars(args), "rows": []}
    if args.plan:
        base = yaml.safe_load(Path(args.plan).read_text())
    elif args.tune:
        base, out["tune"] = _tuned(args)
    else:
        base = _plan(args)
    base = _with_load(base, args)
    parsed = parse_plan(base, source="bench plan")
    rules = list(dict.fromkeys(parsed.dispatcher.batching if r == "plan" else r for r in rules))
    runtimes: dict[tuple[str | None, str | None], Any] = {}
    out["plans"] = {}
    # The whole host's stalls, seen from a process of its own (`runtime.host_watch`).
    watch = HostWatch().start()
    try:
        for hosting in hostings:
            for buckets in bucket_sets:
                plan = _hosted(base, hosting, buckets)
                built = time.perf_counter()
                runtimes[hosting, buckets] = start_runtime(plan)
                name = "/".join(n for n in (hosting, buckets) if n) or "plan"
                out["plans"][name] = {"plan": plan.to_dict(),
                                      "build_s": time.perf_counter() - built}
        settings = parsed.load.model_dump(mode="json")
        shares = {m.name: m.share for m in parsed.models}
        variants = [(h, b, r) for h in hostings for b in bucket_sets for r in rules]
        for i in range(args.rounds):
            # The order flips each round, so no variant always runs first.
            for hosting, buckets, rule in (variants if i % 2 == 0
                                           else list(reversed(variants))):
                if time.perf_counter() - started > args.max_s:
                    break
                before = os.getloadavg()
                row = _one(runtimes[hosting, buckets], rule, settings, shares, args.p99, rates,
                           watch)
                row["round"], row["hosting"] = i, hosting or "plan"
                row["buckets"] = buckets or "plan"
                # A shared host's load decides a CPU plan's figures: kept beside each row.
                row["loadavg_1m"] = [before[0], os.getloadavg()[0]]
                out["rows"].append(row)
                # Without a peak, the lowest rate tried says where even a light load's time went.
                servers = [t for t in row["trials"] if t["scenario"] == "server"]
                shown = row["at_peak"] or (min(servers, key=lambda t: t["rate_qps"] or 0)
                                           if servers else {})
                ph = shown.get("phases") or {}
                p99s = {k: round(v["p99_ms"], 2) for k, v in ph.items() if v.get("p99_ms")}
                for t in servers if rates else []:
                    tp = {k: round(v["p99_ms"], 1) for k, v in (t.get("phases") or {}).items()
                          if v.get("p99_ms")}
                    print(f"round {i} {row['hosting']:>7} {row['buckets']:>5} {rule:>11}: "
                          f"{t['rate_qps']:7.1f} qps "
                          f"p99 {t['p99_ms'] or 0:7.1f} ms valid {t['valid']}  phases p99 {tp}",
                          flush=True)
                ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
                after = row.get("offline_after_items_per_s")
                print(f"round {i} {row['hosting']:>7} {row['buckets']:>5} {rule:>11}: offline "
                      f"{row['offline_items_per_s']:9.1f}"
                      + (f" (after {after:.1f})" if after else "")
                      + f"  peak {row['peak_qps'] or 0:9.1f}  ratio {ratio}  edge confirmed "
                      f"{row['edge_confirmed']}  load {row['loadavg_1m'][0]:.1f}/"
                      f"{row['loadavg_1m'][1]:.1f}  phases p99 at "
                      f"{'peak' if row['at_peak'] else 'lowest rate'} {p99s}", flush=True)
                print(f"round {i} host (before/after): {describe_probes(row['host'])}", flush=True)
                for note in row["notes"]:
                    print(f"  note: {note}", flush=True)
                Path(args.json_path).write_text(json.dumps(out, indent=1))
    finally:
        watch.stop()
        for rt in runtimes.values():
            rt.stop(drain=False)
    out["seconds"] = time.perf_counter() - started
    Path(args.json_path).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
