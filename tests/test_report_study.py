"""`infermux study` on this machine's two cores with tiny models: each point a stored run, the
headline in the paper's shape, the budget honoured, and the report with the published figures
in a box of their own."""

from __future__ import annotations

import re

from infermux.report import build_report
from infermux.store import Store
from infermux.study import StudyConfig, run_study

from .conftest import TINY, invoke_cli


def test_multi_instance_measures_combinations_and_their_contention(tmp_path):
    db = tmp_path / "s.db"
    with Store(db) as store:
        study = run_study(StudyConfig("multi-instance", [f"{TINY}:tiny_cnn"],
                                      units="cpu:0,cpu:1", batches=[2], instances=[1, 2],
                                      budget_s=60, duration_s=0.3, min_queries=16,
                                      cpu_workers="thread"),
                          store=store)
    assert study.status == "complete" and study.run_id is not None
    by = {(p["variant"], p["params"]["instances"]): p for p in study.points}
    assert set(by) == {(c, k) for c in ("cpu:0", "cpu:1", "cpu:0 + cpu:1") for k in (1, 2)}
    for combo in ("cpu:0", "cpu:1", "cpu:0 + cpu:1"):
        assert by[(combo, 1)]["status"] == "ok" and by[(combo, 1)]["sub_run_id"]
        # Two instances on a one-core unit: the runtime refuses, the study says why.
        assert by[(combo, 2)]["status"] == "skipped"
        assert "oversubscribe" in by[(combo, 2)]["error"]
    head = study.headline
    [cont] = head["contention"]
    both = by[("cpu:0 + cpu:1", 1)]["figures"]
    summed = sum(by[(u, 1)]["figures"]["items_per_s"] for u in ("cpu:0", "cpu:1"))
    assert cont["summed_solo_items_per_s"] == summed
    assert abs(cont["factor"] - both["items_per_s"] / summed) < 1e-9
    assert set(cont["per_unit"]) == {"cpu:0", "cpu:1"}
    assert head["best_single"]["combination"] in ("cpu:0", "cpu:1")
    assert head["best_combination"]["combination"] == "cpu:0 + cpu:1"
    with Store(db) as store:
        kinds = dict(store.connection.execute("SELECT id, kind FROM runs").fetchall())
    assert kinds[study.run_id] == "study"
    assert sorted(k for i, k in kinds.items() if i != study.run_id) == ["run"] * 3
    html = build_report(db, [study.run_id]).html
    text = re.sub(r"<[^>]+>", " ", re.sub(r"<script.*?</script>", " ", html, flags=re.S))
    assert "Published figures, for context — measured on NVIDIA Jetson AGX Orin" in text
    assert "415.2 images/s at batch 64" in text
    assert "Headline: items/s (query p99 ms) per unit combination and batch size" in text
    assert "Contention factor" in html
    # The paper's figures are in their box only, never in this machine's tables or plots.
    body = html[html.index("</head>"):]  # after the inlined plotly.js
    box = re.search(r'<div class="paper">.*?</div>', body, flags=re.S)
    assert box is not None and "415.2" in box.group(0)
    assert "415.2" not in body.replace(box.group(0), "")


def test_study_usage_errors_are_one_line(tmp_path):
    db = str(tmp_path / "u.db")
    r = invoke_cli("study", "nope", "--db", db)
    assert r.returncode == 2 and "study 'nope' unknown" in r.stderr and "Traceback" not in r.stderr
    r = invoke_cli("study", "multi-tenancy", "-m", f"{TINY}:tiny_cnn", "--units", "cpu", "--db", db)
    assert r.returncode == 2 and "several models" in r.stderr
    r = invoke_cli("study", "multi-instance", "-m", f"{TINY}:tiny_cnn", "--budget", "0s", "--db", db)
    assert r.returncode == 2 and "--budget" in r.stderr
