"""Which units a study runs on: `--units auto` picks the ones that make its comparison here.

A study's comparison needs several units: on a CPU-only host the one `cpu` unit gives none, so
`auto` splits the cores into sets (one per model for multi-tenancy, two halves otherwise); a
baseline that needs the whole CPU (each model alone) runs one worker on each set. On a GPU host
it takes the first GPU's modes and the CPU. The choice and the reason for it are stored with
the study and printed in its header.
"""

from __future__ import annotations

from dataclasses import dataclass

from infermux.units import Discovery, Unit, select_units
from infermux.units.cpu import split_cores

__all__ = ["UnitChoice", "choose_units", "core_set_id"]


@dataclass
class UnitChoice:
    """The study's units and why they were chosen."""

    units: list[Unit]
    why: str = ""

    @property
    def ids(self) -> list[str]:
        """The study's unit ids."""
        return [u.id for u in self.units]


def core_set_id(cores: tuple[int, ...] | list[int]) -> str:
    """`cpu:0-3` for cores 0..3, `cpu:0+2` for scattered ones."""
    ordered = sorted(cores)
    ranges: list[str] = []
    start = prev = ordered[0]
    for core in [*ordered[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
        if core is not None:
            start = prev = core
    return "cpu:" + "+".join(ranges)


def choose_units(name: str, spec: str, found: Discovery, models: int) -> UnitChoice:
    """The units of study `name` for `--units spec` (`auto`, or ids and globs) on this machine."""
    if spec.strip() != "auto":
        units = select_units(spec, found)
        return UnitChoice(units, why="as given by --units")
    usable = tuple(found.cpu["usable_cores"])
    whole = select_units(["cpu"], found)[0]
    gpus = [u for u in found.units if u.kind == "cuda" and u.available]
    if gpus:
        device = sorted({u.device for u in gpus})[0]
        modes = {u.mode: u for u in gpus if u.device == device}
        fast = modes.get("fp16") or modes.get("fp32") or next(iter(modes.values()))
        if name == "multi-instance":
            # The study's CUDA cores and Tensor Cores; the CPU stands in for its DLA.
            picked = [m for m in (modes.get("fp32"), modes.get("fp16")) if m is not None]
            return UnitChoice([*picked, whole], why=(
                f"a GPU host: {device}'s CUDA cores (fp32) and Tensor Cores (fp16) and the CPU "
                "as the third unit, where the study used a DLA"))
        return UnitChoice([fast, whole], why=(
            f"a GPU host: {device} in {fast.mode} and the CPU"
            + (" (CME on the GPU, static placement and DMP over GPU and CPU)"
               if name == "multi-tenancy" else "")))
    if len(usable) < 2:
        return UnitChoice([whole], why=(
            "a CPU-only host with one usable core: there are no core sets to split, so only "
            "what runs on that core is compared"))
    parts = min(len(usable), max(2, models) if name == "multi-tenancy" else 2)
    sets = [select_units([core_set_id(c)], found)[0] for c in split_cores(usable, parts)]
    if name == "multi-tenancy":
        why = (f"a CPU-only host ({len(usable)} cores) split into {parts} core sets: each model "
               "alone and CME on all of them (one worker per set; CME's models share the "
               "cores), static placement and DMP one model per set")
    elif name == "pipeline":
        why = (f"a CPU-only host ({len(usable)} cores): the pipeline and data-parallel replicas "
               "on two core sets, against each set alone")
    else:
        why = (f"a CPU-only host ({len(usable)} cores): two core sets, each alone and both "
               "together")
    return UnitChoice(sets, why=why)
