"""Stand-in engines for the characterization tests: real Engine subclasses, one noisy per build.

`noisy-standin` runs the model's torch module on the CPU and adds a fixed perturbation to the
logits, drawn once per build from a generator seeded by the build's index
(`INFERMUX_BUILD_INDEX`, which every characterization build process gets): like an engine
that picks other kernels each time it is built, its builds disagree while each build is
repeatable. `steady-standin` is the same engine without the perturbation.

Imported by the tests (registering both engines there) and by each build process
(`CharacterizeConfig.imports`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from infermux.engines.base import BatchTiming, Engine, Runner, register_engine
from infermux.models import LoadedModel
from infermux.units import Unit


class StandInRunner(Runner):
    """The torch module on the CPU, plus a per-build perturbation of its first output."""

    def __init__(self, engine: str, module: Any, unit: Unit, batch: int,
                 input_shape: tuple[int, ...], noise: float) -> None:
        self.engine = engine
        self.unit = unit
        self.batch = batch
        self.input_shape = input_shape
        self.options = {"noise": noise, "precision": "fp32"}
        self._module = module
        self._x = np.zeros((batch, *input_shape), dtype=np.float32)
        self._y: list[np.ndarray] = []
        build = int(os.environ.get("INFERMUX_BUILD_INDEX", "0"))
        self._noise = noise
        self._rng_seed = 1000 + build
        self._offset: np.ndarray | None = None

    def set_input(self, batch: np.ndarray) -> None:
        self._x[...] = batch

    def run(self) -> BatchTiming:
        start = time.perf_counter_ns()
        with torch.inference_mode():
            y = self._module(torch.from_numpy(self._x)).numpy().copy()
        if self._noise:
            if self._offset is None:  # drawn once: the build's own "kernel choice"
                rng = np.random.default_rng(self._rng_seed)
                self._offset = (self._noise * rng.standard_normal(y.shape[1:])).astype(np.float32)
            y += self._offset
        self._y = [y]
        latency = time.perf_counter_ns() - start
        return BatchTiming(latency_ns=latency, compute_ns=latency)

    def outputs(self) -> list[np.ndarray]:
        return [y.astype(np.float32, copy=True) for y in self._y]


@register_engine
class NoisyStandIn(Engine):
    """Adds logit noise seeded per build."""

    name = "noisy-standin"
    unit_kinds = ("cpu",)
    noise = 0.05

    def accepts(self, model: LoadedModel) -> bool:
        return model.module is not None

    def _build(self, model: LoadedModel, unit: Unit, batch: int, opts: dict[str, Any],
               data: str, instance: int) -> Runner:
        return StandInRunner(self.name, model.module, unit, batch, model.input_shape,
                             float(opts.get("noise", self.noise)))


@register_engine
class SteadyStandIn(NoisyStandIn):
    """The same engine without the noise: every build computes the same."""

    name = "steady-standin"
    noise = 0.0
