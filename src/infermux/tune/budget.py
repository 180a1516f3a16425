"""The tuner's budget: wall time, and what a trial of each kind is expected to cost.

The budget is wall time: a trial starts only if its expected cost (the mean of past trials of
its kind) fits in what is left. Trials that build with torch.compile are a kind of their own
(their build is most of their cost); one that does not fit is skipped (`SkippedError`) and
the search goes on without it, any other ends the search (`BudgetSpentError`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from infermux.tune.evaluate import Trial

__all__ = ["COMPILE_PRIOR_S", "Budget", "BudgetSpentError", "SkippedError"]

#: What the first torch.compile trial is expected to cost before one was measured: cold
#: `default` builds of ResNet50 took 11-19 s on an H100 host (16 cores); later ones are timed.
COMPILE_PRIOR_S = 20.0


class BudgetSpentError(Exception):
    """The next trial would not fit in what is left of the budget: the search ends."""


class SkippedError(Exception):
    """An optional trial (a torch.compile build) that does not fit in what is left."""


class Budget:
    """A search's wall-time budget over its measured `trials` (the tuner's own list).

    `clock` (seconds) is injectable so the budget logic is tested deterministically.
    """

    def __init__(self, budget_s: float, trials: list[Trial],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_s = budget_s
        self.trials = trials
        self.clock = clock
        self.start_s = clock()

    def begin(self) -> None:
        """The search starts now."""
        self.start_s = self.clock()

    def elapsed_s(self) -> float:
        """Seconds since the search began."""
        return self.clock() - self.start_s

    def left_s(self) -> float:
        """Seconds of the budget left."""
        return self.budget_s - (self.clock() - self.start_s)

    def past(self, method: str | None, compiled: bool,
             engines: frozenset[str] | None = None) -> list[Trial]:
        """Trials measured (not reused) this way; those of the same engines where there are."""
        past = [t for t in self.trials if not t.reused and t.candidate.compiled == compiled
                and (method is None or t.method == method)]
        same = [t for t in past if t.candidate.engines == engines]
        return same or past

    def costs(self, method: str | None, compiled: bool,
              engines: frozenset[str] | None = None) -> list[float]:
        """The costs of the trials `past` returns."""
        return [t.cost_s for t in self.past(method, compiled, engines)]

    def expected_s(self, method: str, compiled: bool = False,
                   engines: frozenset[str] | None = None) -> float:
        """The expected cost of a trial: the mean of past ones measured the same way.

        Trials that build with torch.compile are counted apart: their build is most of their
        cost, and mixing them in would make every other trial look expensive. For the same
        reason a trial of given `engines` expects what trials of those engines cost, once there
        are any: a LiteRT build (a conversion, 15 s on two cores) is not what an ONNX Runtime
        trial costs.
        """
        costs = self.costs(method, compiled, engines)
        if costs:
            return sum(costs) / len(costs)
        if compiled:
            # Compiled, but not yet measured this way: the build the other way took, on top of
            # this way's own cost; before any compile, a cold build's.
            other = "engine" if method == "runtime" else "runtime"
            done = self.costs(other, True, engines)
            if done:
                build = sum(done) / len(done) - self.expected_s(other, engines=engines)
                return max(0.0, build) + self.expected_s(method, engines=engines)
            eager_costs = self.costs(None, False, engines)
            base = sum(eager_costs) / len(eager_costs) if eager_costs else 0.0
            return max(COMPILE_PRIOR_S, 3 * base) + (
                self.expected_s(method, engines=engines) if method == "runtime" else 0.0)
        # No trial of this kind yet. The runtime starts workers, so its measuring part is
        # assumed to cost three times the in-process one; the build is paid once either way.
        eager = self.past(None, False, engines)
        if not eager:
            return 0.0
        base = sum(t.cost_s for t in eager) / len(eager)
        if method != "runtime":
            return base
        build = min(base, sum(t.build_s or 0.0 for t in eager) / len(eager))
        return build + 3 * (base - build)
