"""Discovery of a machine's units and selection of units by id, glob or core set."""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path

from infermux.errors import UsageError
from infermux.units.base import CPU_MODES, DLA_MODES, Discovery, Unit, parse_core_set
from infermux.units.cpu import read_cpu_info
from infermux.units.cuda import cuda_units
from infermux.units.edgetpu import edgetpu_units
from infermux.units.jetson import read_jetson
from infermux.units.runtimes import probe_runtimes

__all__ = ["discover", "select_units"]


def _cpu_unit(cpu: dict, cores: tuple[int, ...] | None = None, mode: str = "fp32") -> Unit:
    usable = tuple(cpu["usable_cores"])
    chosen = cores if cores is not None else usable
    unit_id = "cpu" if cores is None else f"cpu:{_format_cores(chosen)}"
    if mode != "fp32":
        unit_id += f"/{mode}"
    return Unit(
        id=unit_id,
        kind="cpu",
        device="cpu",
        mode=mode,
        name=cpu["model"],
        contention_domain="cpu:host",
        cores=chosen,
        details={"isa": cpu["isa"], "arch": cpu["arch"], "sockets": cpu["sockets"]},
    )


def _format_cores(cores: tuple[int, ...]) -> str:
    ranges: list[str] = []
    start = prev = cores[0]
    for core in cores[1:]:
        if core != prev + 1:
            ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = core
        prev = core
    ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
    return "+".join(ranges)


def discover(sysfs_root: Path = Path("/"), *, with_runtimes: bool = True) -> Discovery:
    """Find every execution unit of this machine; never raises for missing hardware."""
    notes: list[str] = []
    cpu = read_cpu_info(sysfs_root / "proc/cpuinfo")
    units = [_cpu_unit(cpu)]
    units.extend(cuda_units(notes))
    runtimes = probe_runtimes() if with_runtimes else {}
    jetson = read_jetson(sysfs_root)
    if jetson is not None:
        # On a Jetson the GPU, the DLAs and the CPU share one DRAM: that is the contention domain.
        units = [
            Unit(**{**u.__dict__, "contention_domain": "jetson:dram"}) for u in units
        ]
        trt = runtimes.get("tensorrt", {})
        dla_cores = jetson["dla_cores"] or list(range(int(trt.get("dla_cores", 0))))
        for core in dla_cores:
            for mode in DLA_MODES:
                usable = bool(trt.get("available"))
                units.append(
                    Unit(
                        id=f"dla:{core}/{mode}",
                        kind="dla",
                        device=f"dla:{core}",
                        mode=mode,
                        name=f"DLA core {core}",
                        contention_domain="jetson:dram",
                        available=usable,
                        reason="" if usable else "DLA needs TensorRT: install the tensorrt package",
                    )
                )
        if not dla_cores:
            notes.append(f"dla: {jetson['model']} shows no DLA cores")
    else:
        notes.append("dla: not a Jetson board (no /etc/nv_tegra_release), so no DLA units")
    ov = runtimes.get("openvino", {})
    for device in ov.get("devices", []):
        units.append(
            Unit(
                id=f"openvino:{device}",
                kind="openvino",
                device=f"openvino:{device}",
                mode="auto",
                name=f"OpenVINO {device}",
                contention_domain="cpu:host" if device.startswith("CPU") else f"openvino:{device}",
            )
        )
    units.extend(edgetpu_units(notes, sysfs_root))
    for name, info in runtimes.items():
        if not info.get("available"):
            notes.append(f"{name}: {info.get('reason', 'not available')}")
    return Discovery(units=units, runtimes=runtimes, notes=notes, cpu=cpu, jetson=jetson)


def _auto_units(found: Discovery) -> list[Unit]:
    """`auto`: the CPU and, per GPU, its fastest generally safe mode (fp16, else fp32)."""
    chosen = [u for u in found.units if u.id == "cpu"]
    gpus = sorted({u.device for u in found.units if u.kind == "cuda"})
    for device in gpus:
        modes = {u.mode: u for u in found.units if u.device == device and u.available}
        chosen.append(modes.get("fp16") or modes["fp32"])
    return chosen


def select_units(spec: str | list[str], found: Discovery) -> list[Unit]:
    """Resolve `"cuda:*/fp16,cpu:0-3"` (or `auto`) to units; each must be usable here."""
    parts = spec if isinstance(spec, list) else [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise UsageError("no unit given: pass --units with e.g. cpu or cuda:0/fp16")
    if parts == ["auto"]:
        return _auto_units(found)
    chosen: list[Unit] = []
    known = ", ".join(u.id for u in found.units if u.available)
    for part in parts:
        if part == "cpu" or part.startswith(("cpu:", "cpu/")):
            where, _, mode = part.partition("/")
            mode = mode or "fp32"
            if mode not in CPU_MODES:
                raise UsageError(f"unit {part!r}: a CPU unit computes in {' or '.join(CPU_MODES)}"
                                 f", not {mode!r}: write e.g. cpu:0-1/int8 or cpu:0-1")
            if where == "cpu":  # the discovered unit (its contention domain), in that mode
                whole = found.get("cpu") or _cpu_unit(found.cpu)
                chosen.append(whole if mode == "fp32" else dataclasses.replace(
                    whole, id=f"cpu/{mode}", mode=mode))
                continue
            cores = parse_core_set(where[4:])
            usable = set(found.cpu["usable_cores"])
            missing = [c for c in cores if c not in usable]
            if missing:
                raise UsageError(
                    f"unit {part!r} names cores {missing} that this process cannot use "
                    f"(usable: {_format_cores(tuple(sorted(usable)))}): pick cores from that set"
                )
            chosen.append(_cpu_unit(found.cpu, cores, mode))
            continue
        matches = [u for u in found.units if fnmatch.fnmatchcase(u.id, part)]
        if not matches:
            hint = ""
            if part.startswith(("cuda", "dla", "edgetpu")):
                hint = " (" + "; ".join(n for n in found.notes if n.startswith(part[:3])) + ")"
            raise UsageError(f"unit {part!r} is not on this machine{hint}; units here: {known}")
        usable_matches = [u for u in matches if u.available]
        if not usable_matches:
            raise UsageError(
                f"unit {part!r} exists but cannot be used: {matches[0].reason}; units here: {known}"
            )
        chosen.extend(u for u in usable_matches if u not in chosen)
    return chosen
