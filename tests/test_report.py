"""`infermux report` on real stored runs: one of every kind, made by the library on tiny models
(bench, a bench with a failed and an out-of-memory point, an interrupted bench, tune with a
measured combination, partition, a peak search through the runtime, a kind the report does not
know), rendered to one self-contained HTML file."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from infermux.bench import BenchConfig, run_bench
from infermux.errors import UsageError
from infermux.models import ModelSpec
from infermux.partition.search import PartitionConfig, run_partition
from infermux.report import build_report, parse_run_ids, register_kind, write_report
from infermux.report.data import open_reader
from infermux.runtime import parse_plan, run_plan
from infermux.store import Store
from infermux.tune import TrialSettings, TuneRequest, run_tune

from .conftest import TINY, invoke_cli, run_cli

MODEL = f"{TINY}:tiny_cnn"

# A network that fails at batch 3 (an engine error) and runs out of memory above 16 items, the
# way a GPU does when a batch's activations do not fit.
PICKY = '''
import torch
from torch import nn


class Picky(nn.Module):
    input_shape = (3, 16, 16)

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(4, 3))

    def forward(self, x):
        if x.shape[0] == 3:
            raise RuntimeError("kernel failure at batch 3")
        if x.shape[0] > 16:
            raise torch.OutOfMemoryError(f"out of memory: a batch of {x.shape[0]} does not fit")
        return self.body(x)


def build():
    torch.manual_seed(0)
    return Picky()
'''


def _bench(store: Store, model: str, batches: list[int], *, telemetry: float | None = None,
           min_s: float = 0.05, progress=None, agreement: bool = True) -> int:
    report = run_bench(BenchConfig(ModelSpec(model), units="cpu", batches=batches,
                                   min_duration_s=min_s, min_queries=4, warmup_s=0.02,
                                   telemetry_interval_s=telemetry, check_agreement=agreement),
                       store=store,
                       progress=progress, command="infermux bench (test)")
    assert report.run_id is not None
    return report.run_id


#: The runs are made once per test session, whichever module asks first.
_RUNS: dict[str, object] = {}


@pytest.fixture(scope="session")
def report_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A results database holding one real run of every kind the report draws."""
    if not _RUNS:
        _RUNS.update(_make_runs(tmp_path_factory))
    return _RUNS


def _make_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("report")
    db = root / "runs.db"
    picky = root / "picky.py"
    picky.write_text(PICKY)
    ids: dict[str, int] = {}
    with Store(db) as store:
        ids["bench"] = _bench(store, MODEL, [1, 4], telemetry=0.05, min_s=0.2)
        ids["failures"] = _bench(store, f"{picky}:build", [2, 3, 32])
        calls = {"n": 0}

        def stop_midway(label: str, fraction: float) -> None:
            # What Ctrl-C does: one KeyboardInterrupt in the middle of the b4 point.
            if "b4" in label and 0 < fraction < 1:
                calls["n"] += 1
                if calls["n"] == 2:
                    raise KeyboardInterrupt

        ids["interrupted"] = _bench(store, MODEL, [1, 4, 8], min_s=0.6, progress=stop_midway)
        # The tune ends when its search does (seconds); the budget only has to let a loaded
        # host's slower runtime trials reach the combination, which the report draws.
        tune = run_tune(TuneRequest(
            [ModelSpec(MODEL)], units="cpu:0,cpu:1", engines="torch", budget_s=90.0,
            batches=[4], max_instances=1, fine_tune=False, pipelines=False,
            trial=TrialSettings(min_duration_s=0.2, min_queries=16, warmup_s=0.1)), store=store)
        assert tune.run_id is not None
        ids["tune"] = tune.run_id
        part = run_partition(PartitionConfig(model=ModelSpec(MODEL), units="cpu:0,cpu:1",
                                             batch=4, top_k=2, max_pieces=4, measure_s=0.3,
                                             warmup_s=0.1), store=store)
        assert part.run_id is not None
        ids["partition"] = part.run_id
        plan = parse_plan({
            "name": "peak", "models": [{"name": "tiny", "model": MODEL, "replicas": [
                {"unit": "cpu:0", "engine": "torch", "batch": 4}]}],
            "dispatcher": {"cpu_workers": "thread"},
            "load": {"scenario": "server", "find_peak": True, "p99_bound_ms": 50,
                     "min_duration_s": 0.15, "min_queries": 32}})
        run = run_plan(plan, store=store, command="infermux run (test)")
        assert run.run_id is not None
        ids["run"] = run.run_id
        # A kind this report has no view for (as `serve` will store): a table of its own.
        serve = store.begin_run("serve", {"model": "tiny"}, {"cpu": {"model": "test CPU"}},
                                "infermux serve (test)")
        store.connection.execute("CREATE TABLE serve_requests (run_id INTEGER, route TEXT, "
                                 "requests INTEGER, p99_ms REAL)")
        store.connection.executemany("INSERT INTO serve_requests VALUES (?,?,?,?)",
                                     [(serve, "/v2/models/tiny/infer", 120, 4.5),
                                      (serve, "/v2/health", 7, 0.2)])
        store.connection.commit()
        store.finish_run(serve, "complete", {"requests": 127, "uptime_s": 3.5})
        ids["serve"] = serve
    return {"db": db, "ids": ids, "root": root}


def _text(html: str) -> str:
    """The page's visible text, roughly (tags and the inlined scripts removed)."""
    html = re.sub(r"<script.*?</script>", " ", html, flags=re.S)
    return re.sub(r"<[^>]+>", " ", html)


def test_a_report_of_every_kind_draws_each_from_the_store(report_runs, tmp_path):
    ids = report_runs["ids"]
    order = [ids[k] for k in ("bench", "tune", "partition", "run", "serve")]
    report = write_report(report_runs["db"], order, tmp_path / "all.html")
    views = {r["id"]: r["view"] for r in report.runs}
    assert views == {ids["bench"]: "bench", ids["tune"]: "tune", ids["partition"]: "partition",
                     ids["run"]: "run", ids["serve"]: "generic"}
    assert report.notes == []  # no view fell back
    html = (tmp_path / "all.html").read_text()
    assert html.startswith("<!doctype html>") and "plotly.js" in html
    assert not re.search(r"<(script|link)[^>]+(src|href)=\"https?:", html)  # nothing fetched
    text = _text(html)
    # bench: curves against batch, percentiles, telemetry of every point
    assert "throughput against batch size" in html and "p99 (dashed)" in html
    assert "Telemetry during the measured windows" in html
    # tune: the choice and why, the Pareto front, contention of the measured combination
    assert "The chosen plan and why" in text and "Pareto front" in text
    assert "cpu:0 torch b4 + cpu:1 torch b4" in text and "Contention matrix" in html
    # partition: cut points on the network, candidates predicted vs measured, stage times
    assert "cut after" in html and "predicted (from the profiles)" in html
    assert "Stage time per batch" in html
    # run: every trial of the peak search, the curve with its bound, phases, workers, timeline
    assert "Throughput against p99 latency" in html and "p99 bound 50 ms" in html
    assert "Where each query" in html and "Workers: utilisation" in html
    assert "Items served over time" in html
    # an unknown kind: its summary and its own table
    assert "no dedicated view" in text and "serve_requests" in text
    assert "/v2/models/tiny/infer" in text
    assert report.figures >= 15
    assert len(re.findall(r'<div class="fig" id="fig-\d+">', html)) == report.figures


def test_failed_oom_and_interrupted_runs_still_render_and_say_so(report_runs, tmp_path):
    ids = report_runs["ids"]
    report = build_report(report_runs["db"], [ids["failures"], ids["interrupted"]])
    text = _text(report.html)
    assert "1 point(s) ran out of memory: cpu torch b32" in text
    assert "1 point(s) failed" in text and "kernel failure at batch 3" in text
    assert "This run was interrupted" in text
    assert "1 point(s) was interrupted" in text and "interrupted by the user" in text
    assert "OOM" in text and "ERROR" in text  # the status cells
    # What was measured is drawn: the failures' good point and the interrupted run's first.
    assert report.figures >= 4


def test_several_runs_compare_side_by_side(report_runs):
    ids = report_runs["ids"]
    report = build_report(report_runs["db"], [ids["bench"], ids["interrupted"], ids["tune"]])
    html = report.html
    assert "Benchmarks side by side" in html
    assert f"run {ids['bench']} · cpu torch" in html
    assert f"run {ids['interrupted']} · cpu torch" in html
    assert "Headline figure of each run (items/s)" in html


def test_an_unknown_run_and_a_missing_database_are_one_clear_line(report_runs, tmp_path):
    db = str(report_runs["db"])
    missing = tmp_path / "nope.db"
    r = invoke_cli("report", "999", "--db", db, "-o", str(tmp_path / "x.html"))
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: run 999 is not in")
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = invoke_cli("report", "1", "--db", str(missing), "-o", str(tmp_path / "x.html"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    assert not missing.exists()  # a report never creates a database
    notes = tmp_path / "notes.db"
    notes.write_text("not a database")
    r = invoke_cli("report", "1", "--db", str(notes), "-o", str(tmp_path / "x.html"))
    assert r.returncode == 2 and "not an infermux results database" in r.stderr
    assert notes.read_text() == "not a database"
    r = invoke_cli("report", "abc", "--db", db)
    assert r.returncode == 2 and "is not a run id" in r.stderr
    r = invoke_cli("report", "1", "--db", db, "-o", str(tmp_path / "no" / "dir.html"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run_cli("--debug", "report", "999", "--db", db, "-o", str(tmp_path / "x.html"))
    assert r.returncode != 0 and "Traceback" in r.stderr
    assert not (tmp_path / "x.html").exists()


def test_cli_writes_the_report_and_says_what_it_holds_as_json(report_runs, tmp_path):
    import json

    out = tmp_path / "r.html"
    ids = report_runs["ids"]
    r = invoke_cli("report", str(ids["bench"]), str(ids["serve"]), "--db", str(report_runs["db"]),
                   "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["path"] == str(out) and data["bytes"] == out.stat().st_size
    assert [x["view"] for x in data["runs"]] == ["bench", "generic"]
    r = invoke_cli("report", str(ids["serve"]), "--db", str(report_runs["db"]), "-o", str(out))
    assert r.returncode == 0 and f"{ids['serve']} (serve, generic view)" in r.stdout


def test_a_recorded_telemetry_window_draws_its_series(tmp_path):
    db = tmp_path / "m.db"
    r = invoke_cli("monitor", "--duration", "0.6s", "--interval", "50ms", "--record", "--json",
                   "--db", str(db))
    assert r.returncode == 0, r.stderr
    report = build_report(db, ["last"])
    assert report.runs[0]["view"] == "monitor"
    assert "Telemetry: utilisation (%)" in report.html
    assert report.figures >= 1


def test_run_ids_take_ranges_lists_and_the_latest(report_runs):
    with open_reader(report_runs["db"]) as reader:
        newest = reader.query("SELECT MAX(id) FROM runs")[0][0]
        assert parse_run_ids(["1-3", "5,2"], reader) == [1, 2, 3, 5]
        assert parse_run_ids(["last"], reader) == [newest]
        assert parse_run_ids(["last:2"], reader) == [newest - 1, newest]
    for bad in (["3-1"], ["x"], ["last:0"], []):
        with pytest.raises(UsageError):
            parse_run_ids(bad)


def test_a_view_that_fails_falls_back_to_the_records(report_runs, tmp_path):
    @register_kind("broken-view")
    def _broken(run, section):
        section.text("half drawn")
        raise KeyError("a field this version does not know")

    with Store(report_runs["db"]) as store:
        run_id = store.begin_run("broken-view", {}, {}, "")
        store.finish_run(run_id, "complete", {"answer": 42})
    report = build_report(report_runs["db"], [run_id])
    assert len(report.notes) == 1 and "KeyError" in report.notes[0]
    assert "half drawn" not in report.html and "answer" in _text(report.html)
    with pytest.raises(KeyError):
        build_report(report_runs["db"], [run_id], strict=True)


def test_report_is_self_contained_and_escapes_stored_text(report_runs, tmp_path):
    with Store(report_runs["db"]) as store:
        run_id = store.begin_run("odd", {"model": "<script>alert(1)</script>"}, {}, "</script>")
        store.finish_run(run_id, "failed", {"error": "<b>bad</b>"})
    report = build_report(report_runs["db"], [run_id])
    assert "<script>alert(1)</script>" not in report.html
    assert "&lt;b&gt;bad&lt;/b&gt;" in report.html and "This run failed" in report.html
    assert Path(report.db) == Path(report_runs["db"])


# -- in a browser --------------------------------------------------------------------------------
# Reports opened in headless Chromium (Debian's `chromium`): every figure draws (its SVG has
# marks), nothing logs an error, and a 20-run comparison stays under 10 MB and opens in under
# 5 s. Skipped, with the reason, where Chromium is not installed (`make test` installs it).
# Here, beside the other report tests, so that one test process makes the shared runs.

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser",
                                                        "google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed: apt-get install chromium "
                             "(make test installs it where apt-get exists)")


def _copy_run(store: Store, run_id: int) -> int:
    """A new run in the store holding a copy of bench run `run_id`'s rows; its id."""
    con = store.connection

    def copy(table: str, where: str, arg: int, **fixed: int | None) -> list[tuple[int, int]]:
        """Rows of `table` matching `where = arg`, inserted again with `fixed` values: (old
        id, new id) pairs (ids are 0 for a table without an id)."""
        cols = [r[1] for r in con.execute(f"PRAGMA table_info({table})")]
        pairs = []
        for row in con.execute(f"SELECT * FROM {table} WHERE {where} = ?", (arg,)).fetchall():
            values = dict(zip(cols, row, strict=True))
            old = values.pop("id", 0)
            values.update(fixed)
            cur = con.execute(f"INSERT INTO {table} ({', '.join(values)}) VALUES "
                              f"({', '.join('?' * len(values))})", tuple(values.values()))
            pairs.append((old, cur.lastrowid or 0))
        return pairs

    [(_, new_run)] = copy("runs", "id", run_id)
    for old, new in copy("results", "run_id", run_id, run_id=new_run):
        copy("samples", "result_id", old, result_id=new)
        copy("telemetry", "result_id", old, run_id=new_run, result_id=new)
    con.commit()
    return new_run


def open_in_chromium(path: Path, tmp: Path) -> tuple[dict[str, str], list[str], str, float]:
    """Load `path` headless; (body data attributes, console lines, DOM, seconds it took)."""
    assert CHROMIUM is not None
    started = time.monotonic()
    r = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", f"--user-data-dir={tmp / 'chromium-profile'}",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=20000",
         "--window-size=1280,2000", "--dump-dom", path.resolve().as_uri()],
        capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - started
    assert r.returncode == 0, r.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", r.stdout)
    assert body is not None, r.stdout[:500]
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body.group(1)))
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line]
    return attrs, console, r.stdout, wall


def assert_drew(attrs: dict[str, str], console: list[str], dom: str) -> None:
    assert attrs.get("errors") == "0", (attrs, console)
    assert int(attrs["figures"]) > 0 and attrs["drawn"] == attrs["figures"], attrs
    marks = re.findall(r'id="(fig-\d+)"[^>]*data-marks="(\d+)"', dom)
    assert len(marks) == int(attrs["figures"])
    empty = [fig for fig, n in marks if int(n) == 0]
    assert not empty, f"figures drew no marks: {empty}"
    assert dom.count('class="main-svg"') >= int(attrs["figures"])
    bad = [line for line in console if re.search(r"Uncaught|Error|error", line)]
    assert not bad, bad


@needs_chromium
def test_every_kind_renders_in_chromium(report_runs, tmp_path):
    ids = report_runs["ids"]
    out = tmp_path / "every-kind.html"
    write_report(report_runs["db"], [ids[k] for k in ("bench", "failures", "interrupted", "tune",
                                                       "partition", "run", "serve")], out)
    attrs, console, dom, _ = open_in_chromium(out, tmp_path)
    assert_drew(attrs, console, dom)


@needs_chromium
def test_a_twenty_run_comparison_is_small_and_opens_fast(report_runs, tmp_path):
    ids = dict(report_runs["ids"])
    chosen = [ids[k] for k in ("bench", "failures", "interrupted", "tune", "partition", "run",
                               "serve")]
    with Store(report_runs["db"]) as store:
        measured = _bench(store, MODEL, [1, 4], telemetry=0.05, agreement=False)
        chosen.append(measured)
        while len(chosen) < 20:  # what is drawn, not what is measured, is the subject here
            chosen.append(_copy_run(store, measured))
    out = tmp_path / "twenty.html"
    report = write_report(report_runs["db"], chosen, out)
    assert len(report.runs) == 20
    assert out.stat().st_size < 10 * 2**20, f"{out.stat().st_size / 2**20:.1f} MiB"
    attrs, console, dom, wall = open_in_chromium(out, tmp_path)
    assert_drew(attrs, console, dom)
    # From navigation start until the first screen is drawn, in the page's own clock; the
    # rest draws after it, one figure at a time.
    assert int(attrs["open-ms"]) < 5000, (attrs, wall)
    assert int(attrs["all-ms"]) < 20000, (attrs, wall)
