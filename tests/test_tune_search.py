"""The tuner's search on synthetic landscapes: optimum vs brute force, budget, constraints,
measured combinations and the Pareto front. The evaluator answers from a formula and a
clock advanced by each answer's cost, so these run in milliseconds and cannot flake."""

import io
import itertools
import math

import pytest
from rich.console import Console

from infermux.cli.render import explain_table as _explain_table
from infermux.errors import UsageError
from infermux.models import ModelSpec
from infermux.tune import (
    Candidate,
    Config,
    Constraints,
    Space,
    TableEvaluator,
    Trial,
    Tuner,
    TuneRequest,
    TuneSettings,
    UnitSpace,
    build_space,
    pareto_front,
)
from infermux.tune.budget import COMPILE_PRIOR_S
from infermux.tune.space import overlapping_units
from infermux.units import Unit

LADDER = [1, 2, 4, 8, 16, 32, 64]


def gpu(i=0, mode="fp16"):
    return Unit(id=f"cuda:{i}/{mode}", kind="cuda", device=f"cuda:{i}", mode=mode, name="GPU",
                contention_domain=f"cuda:{i}")


def cpu():
    return Unit(id="cpu", kind="cpu", device="cpu", mode="fp32", name="CPU",
                contention_domain="cpu:host", cores=(0, 1, 2, 3))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def advance(self, s):
        self.t += s


# A unit's items/s: each engine saturates at its own peak; options and instances scale it.
PEAK = {("cuda:0/fp16", "torch"): 4000.0, ("cuda:0/fp16", "onnxruntime"): 3000.0,
        ("cpu", "torch"): 150.0, ("cpu", "onnxruntime"): 400.0, ("cpu", "openvino"): 450.0,
        ("cuda:1/fp16", "torch"): 4000.0}
HALF = {"torch": 6.0, "onnxruntime": 3.0, "openvino": 4.0}
OPTION = {(): 1.0, (("cuda_graph", False),): 0.8, (("hint", "latency"),): 1.1,
          (("allow_spinning", False),): 0.97}


def solo_rate(c: Config) -> float:
    rate = PEAK[(c.unit, c.engine)] * c.batch / (c.batch + HALF[c.engine])
    rate *= OPTION.get(c.options, 1.0)
    # A second instance helps small batches (it hides per-batch overhead), not large ones.
    if c.instances > 1:
        rate *= 1 + 0.4 * HALF[c.engine] / (c.batch + HALF[c.engine]) * math.log2(c.instances)
    return rate


def p99_ms(c: Config) -> float:
    return 1e3 * c.batch / solo_rate(c) * c.instances * 1.2


def landscape(contention=0.9):
    def fn(candidate: Candidate) -> Trial:
        per_unit = {}
        for c in candidate.configs:
            factor = contention if len(candidate.configs) > 1 else 1.0
            per_unit[c.unit] = solo_rate(c) * factor
        total = sum(per_unit.values())
        return Trial(candidate, "engine", "ok", total,
                     max(p99_ms(c) for c in candidate.configs),
                     energy_per_item_j=sum(0.5 + 0.01 * c.batch for c in candidate.configs) / total
                     * 100, power_w=100.0, memory_bytes=max(c.batch for c in candidate.configs)
                     * 10 * 2**20, per_unit=per_unit)
    return fn


def space_one(unit=None, engines=("torch", "onnxruntime"), instances=(1, 2)):
    unit = unit or gpu()
    options = {"torch": [{}, {"cuda_graph": False}], "onnxruntime": [{}],
               "openvino": [{}, {"hint": "latency"}]}
    return Space(["m"], [UnitSpace(unit, list(engines), LADDER, list(instances),
                                   {e: options[e] for e in engines})])


def tuner(space, fn=None, budget=600.0, cost=2.0, runtime_cost=6.0, **kw):
    clock = Clock()
    ev = TableEvaluator(fn or landscape(), cost_s=lambda c, m: runtime_cost if m == "runtime"
                        else cost, on_cost=clock.advance)
    constraints = kw.pop("constraints", None)
    settings = TuneSettings(budget_s=budget, **kw)
    return Tuner(space, ev, constraints, settings, clock=clock), ev, clock


def test_reaches_the_brute_force_optimum_measuring_a_fifth_of_the_space():
    space = space_one(instances=(1, 2, 4))
    space.units[0].batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    configs = space.solo_configs()
    assert len(configs) == 2 * 9 * 3 + 1 * 9 * 3  # torch has two option variants
    best_brute = max(solo_rate(c) for c in configs)
    t, ev, _ = tuner(space, fine_tune=True)
    result = t.run()
    assert result.best is not None
    distinct = {c.key() for c, _ in ev.calls}
    assert result.best.items_per_s >= 0.95 * best_brute
    assert len(distinct) <= 0.2 * len(configs) + 1  # +1: the runtime check of the chosen plan
    assert result.verified is not None and result.verified.method == "runtime"


def test_the_budget_is_honoured_and_the_best_so_far_is_kept():
    t, _ev, clock = tuner(space_one(), budget=20.0, cost=3.0, runtime_cost=3.0)
    result = t.run()
    assert clock.t <= 20.0
    assert result.stopped_by_budget
    assert result.best is not None and result.best.items_per_s > 0
    # The ladder was cut short, yet the explanation still has the unit's best solo figure.
    assert list(result.solo_best) == ["m@cuda:0/fp16"]


def test_a_p99_bound_is_never_broken_by_the_chosen_plan():
    bound = 8.0
    space = space_one()
    t, _, _ = tuner(space, constraints=Constraints(p99_bound_ms=bound))
    result = t.run()
    assert result.best is not None
    assert result.best.p99_ms <= bound / 2
    feasible = [c for c in space.solo_configs() if p99_ms(c) <= bound / 2]
    assert result.best.items_per_s >= 0.9 * max(solo_rate(c) for c in feasible)
    # Without the bound the tuner goes to batches that break it.
    free = tuner(space)[0].run()
    assert free.best.p99_ms > bound / 2


def test_a_tight_bound_walks_the_ladder_down_past_every_batch_that_breaks_it():
    # On the CPU's ONNX Runtime only b1 (p99 12 ms) and b2 (15 ms) hold half of a 31 ms bound;
    # the ladder starts at b8 and b4 breaks it too.
    space = space_one(cpu(), engines=("onnxruntime",), instances=(1,))
    bound = 31.0
    assert [round(p99_ms(Config.make("m", "cpu", "onnxruntime", b)), 1) for b in (1, 2, 4)] == [
        12.0, 15.0, 21.0]
    t, ev, _ = tuner(space, constraints=Constraints(p99_bound_ms=bound), fine_tune=False)
    result = t.run()
    assert result.best is not None and result.best.candidate.configs[0].batch == 2
    assert result.best.p99_ms <= bound / 2
    tried = {c.configs[0].batch for c, _ in ev.calls}
    assert {8, 4, 2, 1} <= tried


def test_memory_cap_and_impossible_constraints():
    cap = 16 * 10 * 2**20
    result = tuner(space_one(), constraints=Constraints(max_memory_bytes=cap))[0].run()
    assert result.best.memory_bytes <= cap
    nothing = tuner(space_one(), constraints=Constraints(p99_bound_ms=1e-3))[0].run()
    assert nothing.best is None and nothing.pareto == []


def test_combinations_are_measured_and_contention_decides():
    two = Space(["m"], [UnitSpace(gpu(0), ["torch"], LADDER, [1], {"torch": [{}]}),
                        UnitSpace(gpu(1), ["torch"], LADDER, [1], {"torch": [{}]})])
    result, ev = None, None
    t, ev, _ = tuner(two, landscape(contention=0.9))
    result = t.run()
    assert len(result.best.candidate.configs) == 2  # 1.8× one GPU: kept
    assert any(m == "runtime" and len(c.configs) == 2 for c, m in ev.calls)
    whole = [c for c in result.contention if c["unit"] == "all"]
    assert whole and abs(whole[0]["factor"] - 0.9) < 1e-6
    per_unit = [c for c in result.contention if c["unit"] != "all"]
    assert {c["unit"] for c in per_unit} == {"cuda:0/fp16", "cuda:1/fp16"}
    # Heavy contention: together they give less than one alone, so one unit is chosen.
    t2, _, _ = tuner(two, landscape(contention=0.45))
    assert len(t2.run().best.candidate.configs) == 1


def test_a_slow_unit_beside_a_fast_one_is_dropped_when_it_does_not_pay():
    mixed = Space(["m"], [UnitSpace(gpu(0), ["torch"], LADDER, [1], {"torch": [{}]}),
                          UnitSpace(cpu(), ["torch"], LADDER, [1], {"torch": [{}]})])
    # The CPU adds ~150 items/s but costs the GPU 10%: 0.9 × (4000 + 150) < 4000.
    result = tuner(mixed, landscape(contention=0.9))[0].run()
    assert result.best.candidate.units == ("cuda:0/fp16",)


def test_objectives_latency_and_energy_pick_their_own_optimum():
    space = space_one(engines=("torch",), instances=(1,))
    lat = tuner(space, objective="latency")[0].run()
    assert lat.best.candidate.configs[0].batch == 1
    energy = tuner(space, objective="energy")[0].run()
    brute = min(space.solo_configs(),
                key=lambda c: landscape()(Candidate.of(c)).energy_per_item_j)
    found = landscape()(energy.best.candidate).energy_per_item_j
    assert found <= 1.05 * landscape()(Candidate.of(brute)).energy_per_item_j


def test_pareto_front_is_the_non_dominated_set():
    cands = [Candidate.of(Config.make("m", "cpu", "torch", b)) for b in (1, 2, 4)]
    trials = [Trial(cands[0], "engine", "ok", 100.0, 1.0), Trial(cands[1], "engine", "ok", 200.0, 2.0),
              Trial(cands[2], "engine", "ok", 150.0, 3.0)]
    front = pareto_front(trials, with_energy=False)
    assert [t.items_per_s for t in front] == [200.0, 100.0]
    pareto = tuner(space_one(), objective="pareto")[0].run()
    vecs = [(t.items_per_s, t.p99_ms) for t in pareto.pareto]
    for a, b in itertools.permutations(vecs, 2):
        assert not (b[0] >= a[0] and b[1] <= a[1] and b != a)
    assert len(pareto.pareto) >= 2


def test_stored_answers_are_not_measured_twice():
    t, ev, _ = tuner(space_one())
    t.run()
    keys = [f"{m}|{c.key()}" for c, m in ev.calls]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("budget", [5.0, 60.0, 600.0])
def test_any_budget_returns_a_plan_or_says_why(budget):
    result = tuner(space_one(), budget=budget)[0].run()
    assert result.best is not None
    assert result.elapsed_s <= budget


def test_a_steep_batch_curve_is_climbed_in_longer_strides():
    # One engine, one instance, no options: only the ladder. torch saturates at 4000 items/s
    # with half its peak at batch 6, so the first steps gain far more than min_gain.
    ladder = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    space = Space(["m"], [UnitSpace(gpu(), ["torch"], ladder, [1], {"torch": [{}]})])
    t, ev, _ = tuner(space, fine_tune=False)
    result = t.run()
    measured = sorted({c.configs[0].batch for c, _ in ev.calls})
    # Screened at 16; 16 → 32 gains 19% (steep), so 128 is tried before 64; 128 gains 4%
    # (not steep), so 256 is next and gains under 3%: the climb stops there, and the best
    # measured config is chosen.
    assert measured == [16, 32, 128, 256]
    assert result.best.candidate.configs[0].batch == 256
    best_brute = max(solo_rate(c) for c in space.solo_configs())
    assert result.best.items_per_s >= 0.97 * best_brute



def ov_cpu():
    return Unit(id="openvino:CPU", kind="openvino", device="openvino:CPU", mode="auto",
                name="OpenVINO CPU", contention_domain="cpu:host")


def test_units_sharing_cores_are_alternatives_never_combined():
    units = [cpu(), ov_cpu(), gpu()]
    overlaps = overlapping_units(units, host_cores=(0, 1, 2, 3))
    assert overlaps == {frozenset(("cpu", "openvino:CPU"))}
    # Core sets overlap when they intersect; a GPU shares no cores with anything.
    halves = [Unit(id=f"cpu:{c}", kind="cpu", device="cpu", mode="fp32", name="CPU",
                   contention_domain="cpu:host", cores=cores)
              for c, cores in (("0-1", (0, 1)), ("1-2", (1, 2)), ("3", (3,)))]
    assert overlapping_units(halves, (0, 1, 2, 3)) == {frozenset(("cpu:0-1", "cpu:1-2"))}
    space = Space(["m"], [UnitSpace(cpu(), ["torch"], LADDER, [1], {"torch": [{}]}),
                          UnitSpace(ov_cpu(), ["openvino"], LADDER, [1], {"openvino": [{}]}),
                          UnitSpace(gpu(), ["torch"], LADDER, [1], {"torch": [{}]})],
                  overlaps)
    n = len(LADDER)
    # Plans: any one unit, the GPU with either CPU name, never both CPU names.
    assert space.size() == 3 * n + 2 * n * n
    PEAK[("openvino:CPU", "openvino")] = 600.0
    try:
        t, ev, _ = tuner(space, landscape(contention=0.95), fine_tune=False)
        result = t.run()
    finally:
        del PEAK[("openvino:CPU", "openvino")]
    solo_units = {c.configs[0].unit for c, _ in ev.calls if c.solo}
    assert {"cpu", "openvino:CPU"} <= solo_units  # each weighed alone
    assert not any({"cpu", "openvino:CPU"} <= set(c.units) for c, _ in ev.calls)
    # The faster name for the host's cores joins the GPU; the other is not added beside it.
    assert set(result.best.candidate.units) == {"cuda:0/fp16", "openvino:CPU"}


def test_a_failed_combination_is_reported_failed_not_as_a_zero_factor():
    two = Space(["m"], [UnitSpace(gpu(0), ["torch"], LADDER, [1], {"torch": [{}]}),
                        UnitSpace(gpu(1), ["torch"], LADDER, [1], {"torch": [{}]})])
    ok = landscape()
    message = "m on cuda:1/fp16 at batch 64 ran out of device memory"

    def fn(candidate):
        if len(candidate.configs) > 1:
            return Trial(candidate, "runtime", "oom", error=message)
        return ok(candidate)

    result = tuner(two, fn, fine_tune=False)[0].run()
    assert result.best.candidate.solo
    assert [(c["unit"], c["status"], c["error"], c["factor"]) for c in result.contention] == [
        ("all", "oom", message, None)]
    data = result.to_dict()
    assert [t["error"] for t in data["failed"]] == [message]
    console = Console(width=250, record=True, file=io.StringIO())
    console.print(_explain_table(data))
    text = console.export_text()
    assert "OOM" in text and message in text
    assert "0.00" not in text and "contention factor" not in text


def compile_space(modes=("default", "reduce-overhead")):
    variants = [{}, {"cuda_graph": False}] + [{"compile": m} for m in modes]
    return Space(["m"], [UnitSpace(gpu(), ["torch"], LADDER, [1], {"torch": variants})])


def with_compile(gain):
    base = landscape()

    def fn(candidate):
        trial = base(candidate)
        mode = candidate.configs[0].options_dict.get("compile")
        if mode is not None:
            factor = gain * (1.05 if mode == "reduce-overhead" else 1.0)
            trial.items_per_s *= factor
            trial.per_unit = {k: v * factor for k, v in trial.per_unit.items()}
        return trial
    return fn


def compile_cost(candidate, method):
    return 40.0 if candidate.compiled else (6.0 if method == "runtime" else 2.0)


def test_compile_is_in_the_gpu_space_and_reduce_overhead_where_compile_pays():
    def measured_modes(gain):
        clock = Clock()
        ev = TableEvaluator(with_compile(gain), cost_s=compile_cost, on_cost=clock.advance)
        result = Tuner(compile_space(), ev, None, TuneSettings(budget_s=600.0, fine_tune=False),
                       clock=clock).run()
        modes = {c.configs[0].options_dict.get("compile") for c, _ in ev.calls} - {None}
        return modes, result

    modes, result = measured_modes(gain=1.3)
    assert modes == {"default", "reduce-overhead"}
    assert result.best.candidate.configs[0].options_dict == {"compile": "reduce-overhead"}
    # Compiling does not pay: reduce-overhead (the same kernels under torch's graphs) is not
    # tried, and the plan stays eager.
    modes, result = measured_modes(gain=0.9)
    assert modes == {"default"}
    assert not result.best.candidate.compiled


def test_a_compile_build_that_does_not_fit_is_skipped_and_the_search_goes_on():
    clock = Clock()
    ev = TableEvaluator(with_compile(1.3), cost_s=compile_cost, on_cost=clock.advance)
    # 40 s compile trials do not fit a 30 s budget; the eager search finishes within it.
    result = Tuner(compile_space(), ev, None, TuneSettings(budget_s=30.0, fine_tune=False),
                   clock=clock).run()
    assert not any(c.compiled for c, _ in ev.calls)
    assert result.skipped and all("compile=" in s for s in result.skipped)
    assert result.best is not None and result.best.method == "runtime"
    assert result.elapsed_s <= 30.0


def test_the_first_compile_trial_is_expected_to_cost_a_build():
    clock = Clock()
    ev = TableEvaluator(with_compile(1.3), cost_s=compile_cost, on_cost=clock.advance)
    t = Tuner(compile_space(), ev, None, TuneSettings(budget_s=600.0), clock=clock)
    t.trials.append(Trial(Candidate.of(Config.make("m", "cuda:0/fp16", "torch", 8)), "engine",
                          "ok", 100.0, cost_s=2.0))
    assert t.budget.expected_s("engine") == 2.0
    assert t.budget.expected_s("engine", compiled=True) == COMPILE_PRIOR_S
    compiled = Candidate.of(Config.make("m", "cuda:0/fp16", "torch", 8,
                                        options={"compile": "default"}))
    t.trials.append(Trial(compiled, "engine", "ok", 130.0, cost_s=55.0))
    # Measured compile builds set the expectation of the next, and leave the others' alone.
    assert t.budget.expected_s("engine", compiled=True) == 55.0
    assert t.budget.expected_s("engine") == 2.0


def test_build_space_puts_compile_on_gpus_not_cpus():
    request = TuneRequest(models=[ModelSpec("resnet50")])
    space = build_space(request, [gpu(), cpu()], {"cuda:0/fp16": ["torch"], "cpu": ["torch"]})
    assert space.unit("cuda:0/fp16").options["torch"] == [
        {}, {"cuda_graph": False}, {"compile": "default"}]
    assert space.unit("cpu").options["torch"] == [{}]
    opt_in = TuneRequest(models=[ModelSpec("resnet50")], compile_modes=("max-autotune",))
    assert {"compile": "max-autotune"} in build_space(
        opt_in, [gpu()], {"cuda:0/fp16": ["torch"]}).unit("cuda:0/fp16").options["torch"]
    none = TuneRequest(models=[ModelSpec("resnet50")], compile_modes=())
    assert build_space(none, [gpu()], {"cuda:0/fp16": ["torch"]}).unit(
        "cuda:0/fp16").options["torch"] == [{}, {"cuda_graph": False}]
    with pytest.raises(UsageError, match="--compile 'fast' is not a torch.compile mode"):
        TuneRequest(models=[ModelSpec("resnet50")], compile_modes=("fast",))


def test_build_space_screens_slow_building_engines_last():
    space = build_space(TuneRequest(models=[ModelSpec("resnet50")]), [cpu()],
                        {"cpu": ["litert", "onnxruntime", "openvino", "torch"]})
    assert space.unit("cpu").engines == ["onnxruntime", "openvino", "torch", "litert"]


# A LiteRT trial on two cores: a 15.4 s conversion, then 1.6 s of measuring; the others ~2 s.
BUILD = {"litert": 15.4, "onnxruntime": 0.5, "openvino": 0.5}
RATE = {"litert": 1300.0, "onnxruntime": 1450.0, "openvino": 1700.0}


def slow_build_landscape(candidate: Candidate) -> Trial:
    c = candidate.configs[0]
    rate = RATE[c.engine] * c.batch / (c.batch + 2.0)
    return Trial(candidate, "engine", "ok", rate, 1e3 * c.batch / rate,
                 build_s=BUILD[c.engine])


def slow_build_cost(candidate: Candidate, method: str) -> float:
    build = BUILD[candidate.configs[0].engine]
    return build + (1.6 if method == "engine" else 4.8)


def test_a_slow_building_engine_does_not_make_the_others_look_slow():
    clock = Clock()
    ev = TableEvaluator(slow_build_landscape, cost_s=slow_build_cost, on_cost=clock.advance)
    t = Tuner(Space(["m"], [UnitSpace(cpu(), ["onnxruntime", "litert"], [1, 4, 16, 64], [1],
                                      {})]), ev, None, TuneSettings(budget_s=600.0), clock=clock)
    ort = Candidate.of(Config.make("m", "cpu", "onnxruntime", 16))
    lite = Candidate.of(Config.make("m", "cpu", "litert", 16))
    t.trials.append(Trial(ort, "engine", "ok", 1000.0, cost_s=2.1, build_s=0.5))
    t.trials.append(Trial(lite, "engine", "ok", 1000.0, cost_s=17.0, build_s=15.4))
    # Each engine expects what its own trials cost; an engine not measured yet, the mean.
    assert t.budget.expected_s("engine", engines=ort.engines) == 2.1
    assert t.budget.expected_s("engine", engines=lite.engines) == 17.0
    assert t.budget.expected_s("engine", engines=frozenset({"openvino"})) == pytest.approx(9.55)
    # Through the runtime the build is paid once, the measuring three times over.
    assert t.budget.expected_s("runtime", engines=lite.engines) == pytest.approx(15.4 + 3 * 1.6)
    assert t.budget.expected_s("runtime", engines=ort.engines) == pytest.approx(0.5 + 3 * 1.6)


def test_a_short_budget_screens_every_engine_and_climbs_the_quick_ones():
    # The demo's case: 45 s left for the search of its 90 s, three CPU engines, LiteRT's first
    # build 15 s. Screened first, LiteRT's cost made every later trial look like a build, and
    # the search stopped after it (each change alone still stops before the ladders).
    space = build_space(TuneRequest(models=[ModelSpec("m")], batches=[1, 4, 16, 64]), [cpu()],
                        {"cpu": ["litert", "onnxruntime", "openvino"]})
    for us in space.units:
        us.instances = [1]
        us.options = {}
    clock = Clock()
    ev = TableEvaluator(slow_build_landscape, cost_s=slow_build_cost, on_cost=clock.advance)
    result = Tuner(space, ev, None, TuneSettings(budget_s=45.0, fine_tune=False),
                   clock=clock).run()
    screened = [c.configs[0].engine for c, m in ev.calls if m == "engine"][:3]
    assert screened == ["onnxruntime", "openvino", "litert"]
    # Then the two quick engines' ladders (b64), and the check of the best through the runtime,
    # all within the budget and without running out of it.
    assert len([c for c, m in ev.calls if m == "engine"]) == 5
    assert not result.stopped_by_budget and clock.t <= 45.0
    assert result.best is not None and result.best.candidate.label() == "cpu openvino b64"
    assert result.verified is not None


def test_a_host_that_slowed_during_the_search_is_named_not_passed_for_the_runtime():
    """Two H200 hosts' tunes measured their winners at 0.43-0.47 of the in-process figure
    through the runtime, and the same plans' offline figures then moved by half between runs.
    A winner measured again in-process as slow says the host slowed; one as fast as before
    leaves it to the runtime's figure; a runtime within the usual share asks nothing."""
    from dataclasses import replace

    from infermux.tune.search import speed_note

    def run(runtime_share, host_share_after_runtime, space=None):
        base, seen, slow = landscape(), {}, {"on": False}

        def fn(candidate):
            trial = base(candidate)
            method = seen["ev"].calls[-1][1]
            share = runtime_share if method == "runtime" else 1.0
            if method == "runtime":
                slow["on"] = True  # from the first runtime measurement on, the host is slower
            share *= host_share_after_runtime if slow["on"] else 1.0
            return replace(trial, items_per_s=trial.items_per_s * share)

        t, ev, _ = tuner(space or space_one(), fn=fn)
        seen["ev"] = ev
        return t.run(), ev

    result, _ = run(1.0, 0.45)
    assert len(result.speed_moved) == 1 and result.phases.get("speed check") == 1
    moved = result.speed_moved[0]
    assert moved["runtime"] < 0.6 * moved["in_process"]
    assert moved["in_process_again"] < 0.75 * moved["in_process"]
    note = speed_note(result)
    assert note is not None and moved["plan"] in note and "steadier host" in note
    assert result.to_dict()["speed_moved"] == result.speed_moved
    # The runtime alone slow (its own overhead, not the host): checked, not named.
    result, _ = run(0.45, 1.0)
    assert result.phases.get("speed check", 0) >= 1 and not result.speed_moved
    assert speed_note(result) is None
    # Within the usual share: no second measurement at all.
    result, _ = run(0.8, 1.0)
    assert "speed check" not in result.phases and not result.speed_moved
    # On a CPU the runtime runs small plans far below their in-process figures as a matter of
    # course: the share says nothing of the host there, and nothing is measured again.
    result, _ = run(1.0, 0.45, space_one(unit=cpu(), engines=("onnxruntime",), instances=(1,)))
    assert result.verified is not None and "speed check" not in result.phases
    assert not result.speed_moved
