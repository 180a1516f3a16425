"""Each study's defaults on this machine's two cores: the units `auto` picks, no central mode
skipped, the budget planned before anything runs, the paper's claims beside this machine's
figures, CME on shared cores only where a study opts in, and the report's optional package
checked before measuring; each study measured once for its module and its report drawn from
that same run."""

from __future__ import annotations

import json

import pytest
import yaml

from infermux.errors import UsageError
from infermux.report import build_report
from infermux.runtime import parse_plan
from infermux.store import Store
from infermux.study import STUDIES, StudyConfig, prepare_study, run_study

from .conftest import TINY, invoke_cli

VERDICTS = {"held", "did not hold", "not measurable here"}


def _defaults(name: str, models: list[str], budget_s: float, duration_s: float = 0.3,
              min_queries: int = 64) -> StudyConfig:
    """The study's defaults as the CLI sets them, but for a tiny model and a short run."""
    d = STUDIES[name]
    return StudyConfig(name, models, batches=list(d["batches"]),
                       instances=list(d["instances"]), duration_s=duration_s, budget_s=budget_s,
                       min_queries=min_queries)


#: The multi-tenancy study's trials: its fifteen points, five of them peak searches, took 26 s
#: at 0.3 s and 64 queries a trial, 15 s at these.
MT_DURATION_S, MT_QUERIES = 0.15, 32


def _claims(head: dict, expected: set[str]) -> dict[str, dict]:
    """The paper's claims, one line each, every one with a verdict and what was measured."""
    claims = {c["claim"]: c for c in head["claims"]}
    assert expected <= set(claims), claims
    assert all(c["verdict"] in VERDICTS and c["here"] and c["paper"] for c in claims.values())
    return claims


def _shared_plan(**extra) -> dict:
    return {"models": [{"name": "a", "model": "resnet18", "replicas": [{"unit": "cpu:0"}]},
                       {"name": "b", "model": "resnet18", "replicas": [{"unit": "cpu:0"}]}],
            **extra}


def test_ordinary_plans_keep_disjoint_core_sets_and_studies_opt_into_sharing(tmp_path):
    # What the tuner writes and `plan --check` reads: shared cores are refused, one line.
    with pytest.raises(UsageError, match="shares core 0 .*disjoint core sets"):
        parse_plan(_shared_plan(), source="tuned plan")
    whole = {"models": [{**m, "replicas": [{"unit": "cpu"}]} for m in _shared_plan()["models"]]}
    with pytest.raises(UsageError, match="takes every core"):
        parse_plan(whole)
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump(_shared_plan()))
    r = invoke_cli("plan", "--check", str(path))
    assert r.returncode == 2 and "disjoint core sets" in r.stderr and "Traceback" not in r.stderr
    # The study's opt-in: marked in the plan and kept with every run's plan.
    plan = parse_plan(_shared_plan(sharing="cores"))
    assert plan.sharing == "cores" and plan.to_dict()["sharing"] == "cores"
    assert parse_plan(whole | {"sharing": "cores"}).sharing == "cores"
    assert parse_plan({"models": _shared_plan()["models"][:1]}).to_dict()["sharing"] == "none"
    with pytest.raises(UsageError, match="sharing"):
        parse_plan(_shared_plan(sharing="yes"))


@pytest.fixture(scope="module")
def multi_tenancy(tmp_path_factory):
    """The multi-tenancy study at its defaults on two tiny models, measured once for the module:
    (the prepared study, the study, its database)."""
    db = tmp_path_factory.mktemp("mt") / "mt.db"
    # The budget caps the study, it is not spent: each point still measures its 0.15 s, and
    # a loaded host's slower builds do not leave the last server points skipped.
    config = _defaults("multi-tenancy", [f"{TINY}:tiny_cnn", f"{TINY}:wide_cnn"], budget_s=300,
                       duration_s=MT_DURATION_S, min_queries=MT_QUERIES)
    ready = prepare_study(config)
    with Store(db) as store:
        study = run_study(config, store=store, prepared=ready)
    return ready, study, db


def test_multi_tenancy_defaults_measure_every_mode_offline_and_under_server_load(multi_tenancy):
    ready, study, db = multi_tenancy
    # auto on a CPU-only host: a core set per model.
    assert ready.choice.ids == ["cpu:0", "cpu:1"]
    assert "CPU-only host" in ready.header()[0]
    assert study.status == "complete"
    got = {(p["params"]["mode"], p["params"]["scenario"], p["params"]["batch"]): p
           for p in study.points}
    for mode in ("alone", "cme", "static", "dmp"):
        for key in (("offline", 1), ("offline", 8), ("server", 8)):
            p = got[(mode, *key)]
            # Measured, none skipped. A server search on two shared cores may find no rate
            # within the bound ("invalid", with the p99 it saw): still measured and reported.
            allowed = ("ok", "invalid") if key[0] == "server" else ("ok",)
            assert p["status"] in allowed, (p["variant"], key, p["status"], p["error"])
    cme = got[("cme", "offline", 8)]
    assert cme["params"]["sharing"] == "cores" and cme["params"]["units"] == ["cpu:0", "cpu:1"]
    assert "shared cores" in cme["variant"]
    with Store(db) as store:
        plan = json.loads(store.connection.execute(
            "SELECT config_json FROM runs WHERE id = ?", (cme["sub_run_id"],)).fetchone()[0])["plan"]
    # Both models ran at once on the same cores: the plan says so, and both did work.
    assert plan["sharing"] == "cores"
    assert [r["unit"] for m in plan["models"] for r in m["replicas"]] == ["cpu:0", "cpu:1"] * 2
    assert all(v > 0 for v in cme["figures"]["per_model"].values())
    head = study.headline
    rows = {r["mode"]: r for r in head["rows"]}
    assert set(rows) == {"sequential", "cme", "static", "dmp"}
    assert all(r["cells"]["1"]["items_per_s"] and r["cells"]["8"]["items_per_s"]
               for r in rows.values())
    assert {s["mode"] for s in head["server"]} == {"sequential", "cme", "static", "dmp"}
    assert all(s["peak_qps"] for s in head["server"] if s.get("status", "ok") == "ok"), \
        head["server"]
    claims = _claims(head, {"batching", "CME", "DMP", "clusters"})
    assert claims["DMP"]["verdict"] != "not measurable here"
    assert claims["CME"]["verdict"] != "not measurable here"
    assert claims["clusters"]["verdict"] == "not measurable here"
    # The budget is split over the points: each ran with its share of it.
    assert all(0 < p["params"]["duration_s"] <= MT_DURATION_S for p in study.points)


def test_multi_tenancy_report_has_the_papers_claims_first_and_its_figures_beside(multi_tenancy):
    _, study, db = multi_tenancy
    offline = [p for p in study.points if p["params"]["scenario"] == "offline"]
    seq = next(r for r in study.headline["rows"] if r["mode"] == "sequential")
    for batch in (1, 8):
        # Sequential: the models alone, one after the other, equal items of each.
        alone = [p["figures"]["items_per_s"] for p in offline
                 if p["params"]["mode"] == "alone" and p["params"]["batch"] == batch]
        assert len(alone) == 2
        assert abs(seq["cells"][str(batch)]["items_per_s"] - 2 / sum(1 / x for x in alone)) < 1e-6
    html = build_report(db, [study.run_id]).html
    assert "Published figures, for context — measured on NVIDIA Jetson TX2" in html
    assert "sequential (models alone, equal items)" in html
    # The report opens with the paper's claims beside this machine's figures.
    assert html.index("The paper&#x27;s claims on this machine") < html.index("Published figures")


def test_multi_instance_defaults_report_every_combination_at_every_batch(tmp_path):
    with Store(tmp_path / "mi.db") as store:
        mi = run_study(_defaults("multi-instance", [f"{TINY}:tiny_cnn"], budget_s=120),
                       store=store)
    central = [p for p in mi.points if p["params"]["instances"] == 1]
    assert {p["variant"] for p in central} == {"cpu:0", "cpu:1", "cpu:0 + cpu:1"}
    assert {p["params"]["batch"] for p in central} == {1, 8, 64}
    assert all(p["status"] == "ok" for p in central), [(p["variant"], p["error"]) for p in central]
    # Two instances do not fit a one-core set: refused before the budget was planned.
    assert all("oversubscribe" in p["error"] for p in mi.points if p["params"]["instances"] == 2)
    assert mi.headline["best_combination"] and mi.headline["best_single"]
    mi_claims = _claims(mi.headline, {"large batch", "small batch", "all units"})
    assert mi_claims["large batch"]["verdict"] in ("held", "did not hold")
    assert mi_claims["small batch"]["verdict"] in ("held", "did not hold")
    assert mi_claims["all units"]["verdict"] == "not measurable here"


@pytest.fixture(scope="module")
def pipeline_study(tmp_path_factory):
    """The pipeline study at its defaults on a tiny model, measured once for the module:
    (the study, its database)."""
    db = tmp_path_factory.mktemp("pipe") / "pipe.db"
    with Store(db) as store:
        pipe = run_study(_defaults("pipeline", [f"{TINY}:tiny_cnn"], budget_s=120),
                         store=store)
    return pipe, db


def test_pipeline_defaults_report_the_pipeline_against_each_unit_alone(pipeline_study):
    pipe, db = pipeline_study
    with Store(db) as store:
        partitions = store.connection.execute(
            "SELECT COUNT(*) FROM runs WHERE kind = 'partition'").fetchone()[0]
    # The central comparison (each unit alone, the pipeline) first; replicas after it.
    assert [p["params"]["mode"] for p in pipe.points] == ["single", "single", "pipeline",
                                                          "replicas"]
    modes = {(p["params"]["mode"], tuple(p["params"]["units"])): p for p in pipe.points}
    assert set(modes) == {("single", ("cpu:0",)), ("single", ("cpu:1",)),
                          ("replicas", ("cpu:0", "cpu:1")), ("pipeline", ("cpu:0", "cpu:1"))}
    assert all(p["status"] == "ok" for p in pipe.points), [(p["variant"], p["error"])
                                                            for p in pipe.points]
    pipeline = next(p for p in pipe.points if p["params"]["mode"] == "pipeline")
    assert "|" in pipeline["params"]["stages"] and partitions == 1
    [row] = pipe.headline["rows"]
    assert row["pipeline_over_single"] and row["pipeline_over_replicas"]
    p_claims = _claims(pipe.headline, {"throughput", "energy"})
    assert p_claims["throughput"]["verdict"] in ("held", "did not hold")
    assert p_claims["energy"]["verdict"] in VERDICTS


def test_pipeline_study_compares_the_partitioned_plan_with_single_units_and_replicas(
        pipeline_study):
    study, db = pipeline_study
    assert study.status == "complete"
    modes = {p["params"]["mode"]: p for p in study.points if p["params"]["mode"] != "single"}
    singles = [p for p in study.points if p["params"]["mode"] == "single"]
    pipe = modes["pipeline"]
    # The pipeline point runs the plan its own partition run kept, over both units.
    assert pipe["params"]["partition_run"] and "@cpu:0" in pipe["params"]["stages"] \
        and "@cpu:1" in pipe["params"]["stages"]
    [row] = study.headline["rows"]
    best_single = max(p["figures"]["items_per_s"] for p in singles)
    assert abs(row["pipeline_over_single"] - pipe["figures"]["items_per_s"] / best_single) < 1e-9
    assert abs(row["pipeline_over_replicas"] - pipe["figures"]["items_per_s"]
               / modes["replicas"]["figures"]["items_per_s"]) < 1e-9
    with Store(db) as store:
        kinds = dict(store.connection.execute("SELECT id, kind FROM runs").fetchall())
    assert kinds[pipe["params"]["partition_run"]] == "partition"
    assert kinds[study.run_id] == "study"
    html = build_report(db, [study.run_id]).html
    assert "pipeline" in html and pipe["params"]["stages"].split(" @")[0] in html


def test_without_a_model_each_study_takes_its_default_for_the_units_chosen():
    from infermux.study import default_models

    # ResNet50, the papers' network, where a GPU is among the units; lighter on CPU core sets.
    assert default_models("multi-instance", gpu=True)[0] == ["resnet50"]
    assert default_models("pipeline", gpu=True)[0][0] == "resnet50"
    for name in ("multi-instance", "pipeline"):
        models, why = default_models(name, gpu=False)
        assert "resnet50" not in models and "ResNet50" in why
    assert default_models("multi-tenancy", gpu=False) == default_models("multi-tenancy", True)
    ready = prepare_study(StudyConfig("multi-instance", [], units="cpu:0,cpu:1",
                                      batches=[1], instances=[1]))
    assert ready.config.models == ["mobilenet_v3_small"]
    assert ready.header()[1].startswith("models: mobilenet_v3_small — the default on CPU")
    with pytest.raises(UsageError, match="takes one model"):
        prepare_study(StudyConfig("multi-instance", ["resnet18", "resnet50"]))


def test_a_budget_too_small_is_refused_before_anything_runs_and_says_what_fits(tmp_path):
    config = _defaults("multi-tenancy", [f"{TINY}:tiny_cnn", f"{TINY}:wide_cnn"], budget_s=5)
    with pytest.raises(UsageError, match=r"--budget 5s is too small .* --budget \d+m would fit"):
        prepare_study(config)
    db = tmp_path / "b.db"
    r = invoke_cli("study", "multi-tenancy", "-m", f"{TINY}:tiny_cnn", "-m", f"{TINY}:wide_cnn",
                   "--budget", "5s", "--db", str(db))
    assert r.returncode == 2 and "would fit" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1
    with Store(db) as store:
        assert store.connection.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0


def _hide_plotly(monkeypatch) -> None:
    """`import plotly` fails in this process, as where it is not installed."""
    import sys

    for name in [n for n in sys.modules if n == "plotly" or n.startswith("plotly.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "plotly", None)  # None in sys.modules: ImportError


def test_without_plotly_the_study_says_so_first_and_still_prints_and_stores_its_table(
        tmp_path, monkeypatch):
    _hide_plotly(monkeypatch)
    db = tmp_path / "p.db"
    base = ["study", "multi-instance", "-m", f"{TINY}:tiny_cnn", "--batch", "2",
            "--instances", "1", "--duration", "0.3s", "--min-queries", "16", "--budget", "60s",
            "--cpu-workers", "thread", "--db", str(db)]
    # A report asked for by name: refused before anything is measured.
    r = invoke_cli(*base, "-o", str(tmp_path / "x.html"))
    assert r.returncode == 2 and "plotly" in r.stderr and "--no-report" in r.stderr
    with Store(db) as store:
        assert store.connection.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0
    # The default report: skipped with a line; the table and the claims are printed and stored.
    r = invoke_cli(*base)
    assert r.returncode == 0, r.stderr
    assert "report skipped" in r.stdout and "plotly" in r.stdout
    assert "every point" in r.stdout and "cpu:0 + cpu:1" in r.stdout
    assert "models: tests/tiny_models.py:tiny_cnn — as given by --model" in r.stdout
    assert "large batch" in r.stdout and "not measurable here" in r.stdout
    assert "report →" not in r.stdout
    with Store(db) as store:
        kinds = [k for (k,) in store.connection.execute("SELECT kind FROM runs")]
    assert kinds.count("study") == 1 and kinds.count("run") == 3


def test_auto_units_on_a_gpu_host_are_the_gpus_modes_and_the_cpu():
    import dataclasses

    from infermux.study.layout import choose_units
    from infermux.units import Unit, discover

    found = discover(with_runtimes=False)
    gpu = [Unit(f"cuda:0/{m}", "cuda", "cuda:0", m, "H100", "cuda:0") for m in
           ("fp32", "tf32", "fp16", "bf16")]
    host = dataclasses.replace(found, units=[*found.units, *gpu])
    mi = choose_units("multi-instance", "auto", host, 1)
    assert mi.ids == ["cuda:0/fp32", "cuda:0/fp16", "cpu"] and "Tensor Cores" in mi.why
    mt = choose_units("multi-tenancy", "auto", host, 2)
    assert mt.ids == ["cuda:0/fp16", "cpu"] and "CME on the GPU" in mt.why
    assert choose_units("pipeline", "auto", host, 3).ids == ["cuda:0/fp16", "cpu"]
    # Without the GPU: the usable cores split in two disjoint sets, whatever the study.
    cpu_only = dataclasses.replace(found, units=[u for u in found.units if u.kind == "cpu"])
    usable = sorted(found.cpu["usable_cores"])
    if len(usable) >= 2:
        for name in ("multi-instance", "multi-tenancy", "pipeline"):
            sets = choose_units(name, "auto", cpu_only, 2).units
            assert len(sets) == 2 and not set(sets[0].cores) & set(sets[1].cores)
            assert sorted(sets[0].cores + sets[1].cores) == usable
    assert choose_units("multi-tenancy", "cpu:1", found, 2).why == "as given by --units"


def test_the_server_bound_fits_the_slowest_model_alone_when_none_is_given():
    from infermux.study.base import Point, server_bound_ms

    def alone(batch: int, p99_ms: float, status: str = "ok") -> Point:
        return Point("m alone", {"mode": "alone", "scenario": "offline", "batch": batch},
                     {}, status=status, figures={"batch_p99_ms": p99_ms})

    assert server_bound_ms([], 8) == 100.0
    assert server_bound_ms([alone(8, 20.0), alone(8, 30.0)], 8) == 100.0
    # resnet18 at batch 8 on one core: 240 ms a batch, so 100 ms would hold for no rate.
    assert server_bound_ms([alone(8, 20.0), alone(8, 240.0), alone(1, 900.0)], 8) == 750.0
    assert server_bound_ms([alone(8, 240.0, status="invalid")], 8) == 100.0
    assert server_bound_ms([alone(8, 13_500.0)], 8) == 1000.0  # at most a second
