"""The tuner on networks with a sequence length: the bucket set is part of the space.

The candidate `seq_buckets` derived from the query lengths, their padding, how a config carries
its set into the plan's model entry, and a short real tune of a two-layer BERT (built from a
config, nothing downloaded) on this CPU that writes a plan the runtime runs. `partition` says
in one line that it runs such a network whole.
"""

from __future__ import annotations

import pytest
import yaml

from infermux.errors import UsageError
from infermux.load.samples import parse_lengths
from infermux.models import ModelSpec
from infermux.runtime import parse_plan, run_plan
from infermux.tune import (
    Candidate,
    Space,
    TableEvaluator,
    Trial,
    TrialSettings,
    Tuner,
    TuneRequest,
    TuneSettings,
    run_tune,
)
from infermux.tune.space import Config, UnitSpace, padding_efficiency, seq_bucket_sets
from infermux.units import Unit

from .conftest import invoke_cli


def test_bucket_sets_follow_the_query_lengths_and_finer_sets_pad_less():
    uniform = parse_lengths("uniform:16-256")
    sets = seq_bucket_sets(uniform)
    assert sets[0] == (32, 64, 128, 256)
    assert sets[-1] == (256,)
    fine = sets[1]
    assert fine[-1] == 256 and len(fine) == 8 and all(n % 8 == 0 for n in fine)
    effs = [padding_efficiency(s, uniform) for s in sets]
    assert effs[1] > effs[0] > effs[2]
    assert effs[0] == pytest.approx(32776 / 43552)  # 241 lengths, mean 136, padded to pow2
    assert seq_bucket_sets(parse_lengths(128)) == [(128,)]
    listed = parse_lengths("32,64,128")
    assert seq_bucket_sets(listed) == [(32, 64, 128), (128,)]
    assert padding_efficiency((32, 64, 128), listed) == 1.0
    with pytest.raises(ValueError):
        padding_efficiency((64,), listed)


def test_a_config_carries_its_buckets_to_the_model_entry_not_the_engine():
    cfg = Config.make("bert", "cpu", "torch", 8, options={"seq_buckets": (32, 64)})
    assert cfg.seq_buckets == (32, 64)
    assert cfg.replica()["options"] == {}
    assert "seq=32/64" in cfg.label()
    assert Config.make("bert", "cpu", "torch", 8).seq_buckets is None
    unit = Unit(id="cpu", kind="cpu", device="cpu", mode="fp32", name="cpu",
                contention_domain="cpu")
    us = UnitSpace(unit, ["openvino"], [1, 8], [1], {"openvino": [{}, {"hint": "latency"}]},
                   {"bert": [(32, 64), (64,)]})
    assert us.variants("openvino", "bert") == [
        {}, {"hint": "latency"}, {"seq_buckets": (64,)},
        {"hint": "latency", "seq_buckets": (64,)}]
    assert us.variants("openvino", "resnet") == [{}, {"hint": "latency"}]
    assert len(us.configs("bert")) == 2 * 4 and len(us.configs("resnet")) == 2 * 2


def _request(bert: str, **kw):
    base = {"models": [ModelSpec(bert)], "units": "cpu", "engines": "torch",
            "budget_s": 90.0, "batches": [2, 4], "max_instances": 1, "pipelines": False,
            "trial": TrialSettings(min_duration_s=0.2, min_queries=16, warmup_s=0.05,
                                   lengths="uniform:8-64"),
            "fine_tune": False}
    base.update(kw)
    return TuneRequest(**base)


def _rate(candidate: Candidate) -> Trial:
    """Tokens/s fall with padding; each extra bucket costs 2% (its partial batches)."""
    cfg = candidate.configs[0]
    lengths = parse_lengths("uniform:16-256")
    buckets = cfg.seq_buckets or seq_bucket_sets(lengths)[0]
    rate = 100.0 * cfg.batch / (cfg.batch + 4) * padding_efficiency(buckets, lengths)
    rate *= 0.98 ** len(buckets) * (1.1 if cfg.options_dict.get("hint") else 1.0)
    return Trial(candidate, "runtime", items_per_s=rate, p99_ms=1.0,
                 per_unit={cfg.unit: rate})


def test_the_search_tries_each_bucket_set_on_the_best_options_through_the_runtime():
    unit = Unit(id="cpu", kind="cpu", device="cpu", mode="fp32", name="cpu",
                contention_domain="cpu", cores=(0, 1))
    sets = seq_bucket_sets(parse_lengths("uniform:16-256"))
    space = Space(["bert"], [UnitSpace(unit, ["openvino"], [1, 2, 4, 8], [1],
                                       {"openvino": [{}, {"hint": "latency"}]},
                                       {"bert": sets})], mixed_lengths={"bert"})
    ev = TableEvaluator(_rate)
    result = Tuner(space, ev, None, TuneSettings(budget_s=600.0, fine_tune=False)).run()
    # Queries of several lengths: nothing is measured in-process.
    assert {m for _, m in ev.calls} == {"runtime"}
    tried = {c.configs[0].options for c, _ in ev.calls}
    for seq in sets[1:]:  # each other set, on the best engine option (the latency hint)
        assert (("hint", "latency"), ("seq_buckets", seq)) in tried
    assert (("seq_buckets", sets[-1]),) not in tried  # not crossed with the losing options
    best = result.best.candidate.configs[0]
    assert best.seq_buckets == sets[1]  # the fine set pads least and wins here
    assert best.options_dict["hint"] == "latency"


def test_a_mixed_length_tune_measures_through_the_runtime_and_writes_its_buckets(
        tiny_bert, tmp_path):
    out = tmp_path / "bert.yaml"
    # A short budget: the first trial always runs (a runtime one, workers and all); a faster
    # host may run more, and another bucket set may win.
    report = run_tune(_request(tiny_bert, budget_s=15.0), out_path=out)
    result = report.result
    assert result.best is not None and result.best.ok
    assert {t.method for t in result.trials} == {"runtime"}
    plan = yaml.safe_load(out.read_text())
    entry = plan["models"][0]
    sets = seq_bucket_sets(parse_lengths("uniform:8-64"))
    best = result.best.candidate.configs[0].seq_buckets or sets[0]
    assert best in sets
    assert entry["seq_buckets"] == list(best)  # the winner's set, not the default's
    assert plan["load"]["lengths"] == "uniform:8-64"
    assert "seq_buckets" not in entry["replicas"][0]["options"]
    # The written plan runs (threads here: process workers are covered in test_multi_input).
    short = {**plan, "dispatcher": {**plan["dispatcher"], "cpu_workers": "thread"},
             "load": {**plan["load"], "min_duration_s": 0.3, "min_queries": 32}}
    final = run_plan(parse_plan(short)).final
    assert final is not None and final.tokens_per_s and final.items_per_s
    assert final.tokens_per_s > final.items_per_s * 8


def test_a_fixed_length_tune_measures_in_process_at_that_length(tiny_bert, tmp_path):
    trial = TrialSettings(min_duration_s=0.2, min_queries=16, warmup_s=0.05, lengths="24")
    report = run_tune(_request(tiny_bert, trial=trial, batches=[2], budget_s=30.0),
                      out_path=tmp_path / "b.yaml")
    best = report.result.best
    assert best is not None and best.ok
    assert any(t.method == "engine" and t.record.get("seq_len") == 24
               for t in report.result.trials)
    assert report.plan is not None and report.plan["models"][0]["seq_buckets"] == [24]


def test_tune_bucket_options_that_cannot_work_are_one_line(tiny_bert, two_inputs, tmp_path):
    from infermux.models import load_model
    from infermux.tune.run import seq_sets

    bert = {"bert": load_model(tiny_bert)}
    with pytest.raises(UsageError, match="go past the longest of --seq 16,32"):
        seq_sets(_request(tiny_bert, seq_buckets=[32, 16]), bert)
    assert seq_sets(_request(tiny_bert, seq_buckets=[64, 16]), bert) == {"bert": [(16, 64)]}
    with pytest.raises(UsageError, match="at least 1"):
        _request(tiny_bert, seq_buckets=[0])
    # A model with no mask input compiles exactly the lengths it is sent (never padded).
    two = {"two": load_model(two_inputs[1])}
    assert seq_sets(_request(two_inputs[1], trial=TrialSettings(lengths="8,4,8")), two) == {
        "two": [(4, 8)]}
    with pytest.raises(UsageError, match=r"uniform:8-64: model two has no mask input, .* that "
                                         r"is 57 lengths: give --lengths as a list"):
        seq_sets(_request(two_inputs[1]), two)
    with pytest.raises(UsageError, match=r"--seq 4,16 leaves out 8: add them to --seq"):
        seq_sets(_request(two_inputs[1], seq_buckets=[4, 16],
                          trial=TrialSettings(lengths="4,8")), two)
    res = invoke_cli("tune", "-m", "mobilenet_v3_small", "--units", "cpu", "--lengths",
                  "uniform:8-64", "--db", str(tmp_path / "t.db"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("error: --lengths uniform:8-64: no model")
    res = invoke_cli("tune", "-m", tiny_bert, "--units", "cpu", "--seq", "8,x",
                  "--db", str(tmp_path / "t.db"))
    assert res.returncode == 2 and "'x' is not a length" in res.stderr


def test_partition_says_in_one_line_that_a_transformer_runs_whole(tiny_bert):
    for args in (("--show",), ("--units", "cpu:0,cpu:0")):
        res = invoke_cli("partition", "--model", tiny_bert, *args)
        assert res.returncode == 2, res.stderr
        lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in res.stderr
        assert "input_ids: int64[batch, seq]" in lines[0] and "runs whole" in lines[0]
