"""`infermux tune --served`: the best plans served by `infermux serve`, driven over the wire.

The concurrency sweep's rule on a measured curve, requests of several inputs cut to their
drawn lengths, and real plans served by real server processes and a real client: the plan
that serves the most within the bound is chosen even where the runtime ranked another first.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from infermux.iospec import IOSpec, TensorSpec
from infermux.load.v2client import V2Tensor, closed_loop_peak, requests_from_samples
from infermux.tune.served import (
    ServedSettings,
    front_room,
    serve_candidates,
    served_peak,
    served_requests,
    served_words,
)

from .conftest import invoke_cli

TINY = str(Path(__file__).resolve().parent / "tiny_models.py")


def _curve(table: dict[int, tuple[float, float]]):
    seen: list[int] = []

    def measure(c: int) -> dict:
        seen.append(c)
        rps, p99 = table[c]
        return {"throughput_rps": rps, "p99_ms": p99, "ok": 100, "rejected": 0, "errors": 0}

    return measure, seen


def test_the_sweep_doubles_then_narrows_between_the_last_level_within_the_bound_and_the_first_past():
    table = {1: (100, 2), 2: (190, 3), 4: (350, 5), 8: (600, 8), 16: (900, 12), 32: (950, 30),
             24: (940, 14), 28: (945, 18)}
    measure, seen = _curve(table)
    peak = closed_loop_peak(measure, 15.0)
    assert seen == [1, 2, 4, 8, 16, 32, 24, 28]
    assert peak["concurrency"] == 24 and peak["peak_rps"] == 940 and peak["p99_ms"] == 14
    assert [lv["within_bound"] for lv in peak["levels"]] == [True] * 5 + [False, True, False]


def test_the_sweep_stops_where_more_streams_only_queue_and_says_why_none_held():
    measure, seen = _curve({1: (100, 2), 2: (180, 3), 4: (182, 6), 8: (181, 11), 16: (300, 20)})
    peak = closed_loop_peak(measure, 50.0)
    assert seen == [1, 2, 4, 8]  # 182 and 181 are not 3% above 180, twice: the knee
    assert peak["concurrency"] == 4 and peak["peak_rps"] == 182
    measure, seen = _curve({1: (100, 20)})
    none = closed_loop_peak(measure, 15.0)
    assert none["peak_rps"] is None and "20.0 ms at concurrency 1" in none["reason"]

    def refusing(c: int) -> dict:
        return {"throughput_rps": 50, "p99_ms": 1, "ok": 50, "rejected": 10, "errors": 0,
                "first_error": None}

    assert closed_loop_peak(refusing, 15.0)["peak_rps"] is None  # refusals do not count


def test_perf_analyzer_s_csv_row_gives_the_rate_the_tail_and_the_server_s_split():
    # Captured from perf_analyzer 2.48 (`-f`) against `infermux serve`, gRPC, concurrency 2.
    from infermux.load.v2client import perf_analyzer_figures

    row = perf_analyzer_figures(Path(__file__).parent / "fixtures" / "perf_analyzer" /
                                "grpc_c2.csv")
    assert row == {"requests_per_s": 1299.74, "p50_ms": 1.531, "p99_ms": 2.172,
                   "avg_us": 1532.0, "server_queue_us": 241.0, "server_compute_us": 539.0,
                   "outside_us": 750.0}


def test_requests_carry_every_input_cut_to_its_drawn_length():
    io = IOSpec(inputs=(TensorSpec("ids", "int64", ("seq",), "ids", 100),
                        TensorSpec("mask", "int64", ("seq",), "ones"),
                        TensorSpec("scale", "float32", (3,))))
    requests = served_requests(io, "m", {"seq_buckets": [16, 32]}, "uniform:5-20", count=32)
    assert len(requests) == 32
    lengths = {r[0].array.shape[1] for r in requests}
    assert min(lengths) >= 5 and max(lengths) <= 20 and len(lengths) > 3
    for ids, mask, scale in requests:
        assert ids.name == "ids" and ids.datatype == "INT64" and mask.array.shape == ids.array.shape
        assert (mask.array == 1).all() and (ids.array < 100).all()
        assert scale.datatype == "FP32" and scale.array.shape == (1, 3)
    fixed = served_requests(io, "m", {"seq_buckets": [16, 32]}, None, count=4)
    assert {r[0].array.shape for r in fixed} == {(1, 32)}  # the longest bucket without lengths
    three = requests_from_samples(["x"], [np.arange(6, dtype=np.float32).reshape(3, 2)])
    assert [r[0].array.tolist() for r in three] == [[[0, 1]], [[2, 3]], [[4, 5]]]


def test_a_plan_on_every_core_is_given_a_twin_that_leaves_the_fronts_their_cores():
    plan = {"name": "p", "models": [
        {"name": "a", "model": "m", "replicas": [
            {"unit": "cpu", "engine": "onnxruntime", "instances": 3, "batch": 4},
            {"unit": "cuda:0/fp16", "engine": "torch", "batch": 64}]},
        {"name": "b", "model": "m", "replicas": [
            {"unit": "cpu/int8", "engine": "onnxruntime", "batch": 2}]}]}
    # 2 cores: serve's fronts run in its own process, on the first core.
    moved, unit = front_room(plan, ServedSettings(), [0, 1])
    assert unit == "cpu:1"
    a, b = moved["models"]
    assert a["replicas"][0] == {"unit": "cpu:1", "engine": "onnxruntime", "instances": 1,
                                "batch": 4}
    assert a["replicas"][1]["unit"] == "cuda:0/fp16"  # GPUs stay as they were
    assert b["replicas"][0]["unit"] == "cpu:1/int8"
    assert plan["models"][0]["replicas"][0]["unit"] == "cpu"  # the tuned plan is left alone
    # 16 cores: serve starts 8 front processes by default, or as many as asked.
    assert front_room(plan, ServedSettings(), list(range(16)))[1] == "cpu:8-15"
    assert front_room(plan, ServedSettings(fronts=2), list(range(16)))[1] == "cpu:2-15"
    assert front_room(plan, ServedSettings(fronts=3), [0, 1, 2, 5, 6])[1] == "cpu:5-6"
    assert front_room(plan, ServedSettings(fronts=8), [0, 1])[1] == "cpu:1"  # one left at least
    assert front_room(plan, ServedSettings(fronts=0), list(range(16)))[1] == "cpu:1-15"
    assert front_room(plan, ServedSettings(), [0]) is None
    on_cores = {"name": "q", "models": [{"name": "a", "model": "m", "replicas": [
        {"unit": "cpu:1", "engine": "torch", "batch": 1}]}]}
    assert front_room(on_cores, ServedSettings(), [0, 1]) is None


def _plan(batch: int, instances: int) -> dict:
    return {"name": f"paced-b{batch}x{instances}",
            "models": [{"name": "paced", "model": f"{TINY}:paced_cnn", "input_shape": [3, 32, 32],
                        "replicas": [{"unit": "cpu", "engine": "torch", "instances": instances,
                                      "batch": batch}]}],
            "dispatcher": {"max_queue_delay_ms": 1.0, "cpu_workers": "thread"},
            "load": {"scenario": "server", "p99_bound_ms": 60.0}}


def test_the_plan_that_serves_the_most_is_chosen_over_the_runtime_s_first():
    # Each batch costs 4 ms at any size: b1 x1 answers at most 250 requests/s, b8 x2 far more.
    plans = [_plan(1, 1), _plan(8, 2)]
    # The runtime's choice first, though its find-peak held no rate (a queue delay can break a
    # bound that a server's idle worker, taking each request at once, holds).
    rows = [{"plan": "b1 x1", "peak_qps": None, "chosen": True},
            {"plan": "b8 x2", "peak_qps": 800.0, "chosen": False}]
    io = IOSpec(inputs=(TensorSpec("input", "float32", (3, 32, 32)),))
    requests = served_requests(io, "paced", plans[0]["models"][0], None, count=8)
    settings = ServedSettings(protocol="grpc", fronts=1, seconds=1.5, warmup_s=0.5,
                              max_concurrency=16)
    choice = serve_candidates(rows, plans, 0, requests, 60.0, settings,
                              deadline=time.monotonic() + 600)
    assert choice["rows"] == [0, 1]
    slow, fast = rows[0]["served_peak_rps"], rows[1]["served_peak_rps"]
    assert slow is not None and fast is not None
    assert slow < 1000 / 4 * 1.05  # one 4 ms batch at a time
    assert fast > 1.5 * slow, (slow, fast)
    assert choice["written_row"] == 1 and "the served figure decides" in choice["reason"]
    assert rows[1]["served_p99_ms"] <= 60.0
    levels = rows[1]["served_levels"]
    assert levels[0]["concurrency"] == 1 and all(lv["errors"] == 0 for lv in levels)
    # A plan the runtime ranked below the best served figure is not served at all.
    rows2 = [{"plan": "b8 x2", "peak_qps": 800.0, "chosen": True},
             {"plan": "b1 x1", "peak_qps": 100.0, "chosen": False}]  # far below b8 x2's
    choice2 = serve_candidates(rows2, plans[::-1], 0, requests, 60.0, settings,
                               deadline=time.monotonic() + 600)
    assert rows2[0]["served_peak_rps"] > 100.0
    assert choice2["written_row"] == 0 and "served_peak_rps" not in rows2[1]
    assert served_words(rows2[1]).startswith("not served: its runtime peak is not above")
    assert served_words({"plan": "no candidate"}) is None
    # Past the served share of the budget only the first is served, and the rest say so.
    rows3 = [{"plan": "b8 x2", "peak_qps": 800.0, "chosen": True},
             {"plan": "b1 x1", "peak_qps": 900.0, "chosen": False}]
    serve_candidates(rows3, plans[::-1], 0, requests, 60.0, settings,
                     deadline=time.monotonic())
    assert rows3[0]["served_peak_rps"] and "served_peak_rps" not in rows3[1]
    assert served_words(rows3[1]) == "not served: the budget's share for serving was spent"


def test_a_network_of_several_inputs_is_served_at_the_lengths_drawn(tiny_bert):
    from infermux.models import ModelSpec, load_model

    plan = {"name": "bert", "models": [{"name": "bert", "model": tiny_bert,
                                         "seq_buckets": [16, 32],
                                         "replicas": [{"unit": "cpu", "engine": "torch",
                                                       "batch": 4}]}],
            "dispatcher": {"max_queue_delay_ms": 1.0, "cpu_workers": "thread"},
            "load": {"scenario": "server", "p99_bound_ms": 200.0, "lengths": "uniform:4-32"}}
    io = load_model(ModelSpec(tiny_bert)).spec_io
    requests = served_requests(io, "bert", plan["models"][0], "uniform:4-32", count=16)
    assert len({r[0].array.shape[1] for r in requests}) > 1
    peak = served_peak(plan, requests, 200.0,
                       ServedSettings(protocol="http", fronts=1, seconds=1.0, warmup_s=0.3,
                                      max_concurrency=2))
    assert peak["peak_rps"] and peak["peak_rps"] > 0, peak["reason"]
    assert all(lv["errors"] == 0 and lv["rejected"] == 0 for lv in peak["levels"])


def test_a_plan_that_cannot_be_served_gets_a_reason_not_a_traceback():
    plan = _plan(1, 1)
    plan["models"][0]["model"] = f"{TINY}:no_such_factory"
    io = IOSpec(inputs=(TensorSpec("input", "float32", (3, 32, 32)),))
    peak = served_peak(plan, served_requests(io, "paced", plan["models"][0], None, count=2),
                       60.0, ServedSettings(fronts=1, seconds=0.5))
    assert peak["peak_rps"] is None and "did not get ready" in peak["reason"]
    assert "no_such_factory" in peak["reason"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--served", "grpc"], "--scenario server --p99"),
    (["--scenario", "server", "--p99", "10ms", "--served", "udp"], "--served 'udp' unknown"),
    (["--perf-analyzer", "/bin/true"], "add --served grpc"),
    (["--scenario", "server", "--p99", "10ms", "--served", "grpc", "--served-max-concurrency",
      "0"], "--served-max-concurrency 0 must be at least 1"),
    (["--scenario", "server", "--p99", "10ms", "--served", "grpc", "--perf-analyzer",
      "/no/such/pa"], "is not an executable"),
    (["--scenario", "server", "--p99", "10ms", "--served", "grpc", "--served-front",
      "own,nginx"], "--served-front 'own,nginx' unknown: use own, triton or own,triton"),
])
def test_bad_served_options_get_one_line(args, needle):
    res = invoke_cli("tune", "-m", "digits-cnn", "-u", "cpu", "--budget", "5s", *args)
    assert res.returncode != 0
    assert needle in res.stderr and "Traceback" not in res.stderr


def test_tune_served_writes_the_served_winner_and_says_so(tmp_path):
    import json

    import yaml

    out = tmp_path / "plan.yaml"
    res = invoke_cli("tune", "-m", f"{TINY}:tiny_cnn", "-u", "cpu", "--engine", "onnxruntime",
                     "--scenario", "server", "--p99", "50ms", "--budget", "10s",
                     "--trial-duration", "0.2s", "--peak-trial-duration", "0.5s",
                     "--peak-trial-queries", "64", "--no-fine-tune", "--no-pipelines",
                     "--served", "http", "--served-seconds", "0.5", "-o", str(out),
                     "--db", str(tmp_path / "t.db"), "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout)
    served = report["served"]
    assert served["protocol"] == "http" and served["client"] == "infermux"
    written = served["written_row"]
    assert written is not None and written in served["rows"]
    rows = report["server_peaks"]
    assert [i for i, r in enumerate(rows) if r["chosen"]] == [written]
    row = rows[written]
    assert row["served_peak_rps"] > 0 and row["served_p99_ms"] <= 50.0
    assert row["served_levels"][0]["concurrency"] == 1
    text = out.read_text()
    assert "#   served over http, closed loop: " in text and "# served: " in text
    assert yaml.safe_load(text) == report["plan"]
    assert report["plan"]["serve"] == {"front": "own"}  # what it was served through
    # The plan on both cores is served beside a twin whose worker leaves core 0 to the front.
    twin = [r for r in rows if r.get("derived") == "front_room"]
    assert len(twin) == 1 and "on cpu:1, the other cores left to the fronts" in twin[0]["plan"]
    assert twin[0]["peak_qps"] is None and "served_peak_rps" in twin[0]
    if rows.index(twin[0]) == written:
        assert report["plan"]["models"][0]["replicas"][0]["unit"] == "cpu:1"


def _perf_analyzer() -> str | None:
    import os
    import shutil

    return os.environ.get("INFERMUX_PERF_ANALYZER") or shutil.which("perf_analyzer")


@pytest.mark.parametrize("shared_memory", ["none", "system"])
def test_perf_analyzer_drives_the_sweep_with_the_requests_written_for_it(shared_memory, tiny_bert):
    pa = _perf_analyzer()
    if pa is None:
        pytest.skip("perf_analyzer is not installed (make perf-analyzer, or "
                    "INFERMUX_PERF_ANALYZER=PATH)")
    from infermux.models import ModelSpec, load_model

    plan = {"name": "bert", "models": [{"name": "bert", "model": tiny_bert,
                                         "seq_buckets": [16, 32],
                                         "replicas": [{"unit": "cpu", "engine": "torch",
                                                       "batch": 4}]}],
            "dispatcher": {"max_queue_delay_ms": 1.0, "cpu_workers": "thread"},
            "load": {"scenario": "server", "p99_bound_ms": 200.0}}
    io = load_model(ModelSpec(tiny_bert)).spec_io
    requests = served_requests(io, "bert", plan["models"][0], "uniform:4-32", count=16)
    peak = served_peak(plan, requests, 200.0,
                       ServedSettings(protocol="grpc", fronts=1, seconds=1.0, max_concurrency=2,
                                      perf_analyzer=pa, shared_memory=shared_memory))
    assert peak["peak_rps"] and peak["peak_rps"] > 0, (peak["reason"], peak["levels"])
    assert [lv["concurrency"] for lv in peak["levels"]][:2] == [1, 2]
    assert all(lv["errors"] == 0 for lv in peak["levels"])


def test_perf_analyzer_data_carries_each_tensor_s_bytes_whatever_its_datatype(tmp_path) -> None:
    """FP16 values go as base64 of their bytes (perf_analyzer refuses a content list for FP16)."""
    import base64
    import json

    from infermux.tune.served import _perf_analyzer_data

    rng = np.random.default_rng(0)
    image = rng.standard_normal((1, 3, 8, 8)).astype(np.float16)
    ids = rng.integers(0, 1000, (1, 16)).astype(np.int64)
    data = json.loads(_perf_analyzer_data(
        [[V2Tensor("input", image)], [V2Tensor("input", image)]], tmp_path).read_text())["data"]
    assert len(data) == 1 and data[0]["input"]["shape"] == [3, 8, 8]  # one shape: one request
    got = np.frombuffer(base64.b64decode(data[0]["input"]["b64"]), np.float16)
    np.testing.assert_array_equal(got.reshape(3, 8, 8), image[0])
    two = json.loads(_perf_analyzer_data(
        [[V2Tensor("ids", ids[:, :n])] for n in (8, 16)], tmp_path).read_text())["data"]
    assert [d["ids"]["shape"] for d in two] == [[8], [16]]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(two[1]["ids"]["b64"]), np.int64),
                                  ids[0])


def test_requests_go_in_the_datatypes_the_server_states(tiny_bert, tmp_path) -> None:
    """The served model's metadata names each input's datatype; requests are cast to it."""
    from infermux.load.v2client import as_datatypes, model_datatypes
    from infermux.models import ModelSpec, load_model
    from infermux.tune.served import serving

    plan = {"name": "bert", "models": [{"name": "bert", "model": tiny_bert, "seq_buckets": [16],
                                         "replicas": [{"unit": "cpu", "engine": "torch",
                                                       "batch": 2}]}],
            "dispatcher": {"cpu_workers": "thread"}}
    io = load_model(ModelSpec(tiny_bert)).spec_io
    with serving(plan, ServedSettings(protocol="http", fronts=1), tmp_path) as ready:
        stated = model_datatypes(ready["host"], ready["http_port"], "bert")
    assert stated == {t.name: {"int64": "INT64", "float32": "FP32"}[t.dtype] for t in io.inputs}
    # An fp16 plan's server states FP16 (the CUDA units): its requests carry half the bytes.
    image = V2Tensor("input", np.linspace(-1, 1, 48, dtype=np.float32).reshape(1, 3, 4, 4))
    ids = V2Tensor("ids", np.arange(4, dtype=np.int64).reshape(1, 4))
    [[half, same]] = as_datatypes([[image, ids]], {"input": "FP16", "ids": "INT64"})
    assert half.datatype == "FP16" and half.array.nbytes == image.array.nbytes // 2
    np.testing.assert_allclose(half.array, image.array, atol=1e-3)
    assert same.array is ids.array
    [[kept]] = as_datatypes([[image]], {"input": "BF16"})  # numpy has no BF16: left as it is
    assert kept.array is image.array


def test_serve_takes_the_front_the_plan_was_tuned_with_unless_told(tmp_path) -> None:
    """A plan's `serve` section (written by `tune --served`) sets serve's fronts by default."""
    from infermux.errors import UsageError
    from infermux.runtime import parse_plan
    from infermux.tune.served import serving

    plan = {**_plan(4, 1), "serve": {"front": "own", "fronts": 2}}
    assert parse_plan(plan).serve.fronts == 2
    with serving(plan, ServedSettings(protocol="http"), tmp_path) as ready:
        assert ready["fronts"] == 2 and len(ready["front_pids"]) == 2
    with serving(plan, ServedSettings(protocol="http", fronts=0), tmp_path) as ready:
        assert ready["fronts"] == 1  # the command line wins
    with pytest.raises(UsageError, match="serve.front"):
        parse_plan({**plan, "serve": {"front": "nginx"}})


def test_each_candidate_is_served_through_each_front_and_keeps_the_best(tmp_path) -> None:
    """`--served-front own,triton`: both fronts serve the plan; its figure is the higher."""
    from infermux.errors import UsageError
    from infermux.serve.triton_front import find_triton

    both = ServedSettings(protocol="grpc", front="own,triton")
    assert both.front_list == ["own", "triton"]
    with pytest.raises(ValueError, match="one front"):
        both.serve_args()  # a server has one front: each is served in turn
    try:
        find_triton()
    except UsageError as exc:
        pytest.skip(f"no Triton build: {exc}")
    plan = _plan(8, 2)
    rows = [{"plan": "b8 x2", "peak_qps": 800.0, "chosen": True}]
    io = IOSpec(inputs=(TensorSpec("input", "float32", (3, 32, 32)),))
    requests = served_requests(io, "paced", plan["models"][0], None, count=8)
    settings = ServedSettings(protocol="grpc", front="own,triton", fronts=2, seconds=1.0,
                              warmup_s=0.3, max_concurrency=8)
    choice = serve_candidates(rows, [plan], 0, requests, 60.0, settings,
                              deadline=time.monotonic() + 600)
    row = rows[0]
    assert choice["written_row"] == 0
    figures = {f: v["served_peak_rps"] for f, v in row["served_by_front"].items()}
    assert set(figures) == {"own", "triton"} and all(figures.values()), row["served_by_front"]
    assert row["served_front"] == max(figures, key=figures.get)
    assert row["served_peak_rps"] == figures[row["served_front"]]
    other = ({"own", "triton"} - {row["served_front"]}).pop()
    assert f"through the {row['served_front']} front; {other}: " in served_words(row)


def test_serve_says_which_settings_it_took_from_the_plan(tmp_path) -> None:
    """Without --json, serve names the options the plan's serve section set."""
    import signal
    import subprocess
    import sys

    import yaml

    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({**_plan(4, 1), "serve": {"front": "own", "fronts": 2}}))
    errors = tmp_path / "serve.err"
    with errors.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "infermux", "serve", str(plan_file), "--http-port", "0",
             "--grpc-port", "0", "--metrics-port", "0", "--no-store", "--telemetry", "off",
             "--fronts", "1"], stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert first.startswith("serving "), (first, errors.read_text())
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    said = errors.read_text()
    # --fronts was given, so only --front came from the plan.
    assert "--front from the plan's serve section (--front own --fronts 1)" in said, said
