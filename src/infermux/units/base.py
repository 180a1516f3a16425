"""The Unit record and the discovery result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from infermux.errors import UsageError

__all__ = ["CPU_MODES", "CUDA_MODES", "DLA_MODES", "Discovery", "Unit", "parse_core_set"]

#: Numeric modes of a CUDA GPU unit and the compute capability each needs on the hardware.
CUDA_MODES: dict[str, tuple[int, int]] = {
    "fp32": (3, 5),  # CUDA cores, TF32 off
    "tf32": (8, 0),  # Tensor Cores, Ampere and newer
    "fp16": (7, 0),  # Tensor Cores, Volta and newer
    "bf16": (8, 0),  # Tensor Cores, Ampere and newer
}
DLA_MODES = ("fp16", "int8")
#: Numeric modes of a CPU unit: fp32 (the default, no suffix) and int8 (`cpu:0-1/int8`), which runs
#: a Q/DQ model on the ONNX Runtime and OpenVINO engines (infermux.quantize).
CPU_MODES = ("fp32", "int8")


@dataclass(frozen=True)
class Unit:
    """One execution unit.

    `id` is the string users type; `device` is what the engines address (`cpu`, `cuda:0`,
    `dla:0`, `openvino:CPU`); `mode` the numeric mode (`fp32`, `fp16`, ...). `available` is
    False for a unit the hardware has but cannot use (the reason says why).
    """

    id: str
    kind: str
    device: str
    mode: str
    name: str
    contention_domain: str
    available: bool = True
    reason: str = ""
    cores: tuple[int, ...] = ()
    details: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def index(self) -> int:
        """The device index (`cuda:1` → 1); 0 for devices without one."""
        _, _, rest = self.device.partition(":")
        return int(rest) if rest.isdigit() else 0

    @property
    def telemetry_device(self) -> str:
        """The telemetry device that observes this unit (`cuda:0`, `cpu`, `dla:1`)."""
        if self.kind == "cpu" or self.device.upper().startswith("OPENVINO:CPU"):
            return "cpu"
        return self.device

    @property
    def torch_dtype_name(self) -> str:
        """The compute dtype's name in torch (`float32`, `float16`, `bfloat16`)."""
        return {"fp16": "float16", "bf16": "bfloat16"}.get(self.mode, "float32")

    def to_dict(self) -> dict[str, Any]:
        """A plain dict for JSON output and the store."""
        data = asdict(self)
        data["cores"] = list(self.cores)
        return data


@dataclass
class Discovery:
    """What a machine has: its units, the runtimes found, and notes on what is missing and why."""

    units: list[Unit]
    runtimes: dict[str, dict[str, Any]]
    notes: list[str]
    cpu: dict[str, Any]
    jetson: dict[str, Any] | None = None

    def get(self, unit_id: str) -> Unit | None:
        """The discovered unit with this exact id, or None."""
        return next((u for u in self.units if u.id == unit_id), None)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict for JSON output and the store."""
        return {
            "units": [u.to_dict() for u in self.units],
            "runtimes": self.runtimes,
            "notes": self.notes,
            "cpu": self.cpu,
            "jetson": self.jetson,
        }


def parse_core_set(text: str) -> tuple[int, ...]:
    """`"0-3"` → (0, 1, 2, 3); `"0-1+4-5"` and `"2"` also work (`+` joins ranges).

    A unit's mode suffix (`"0-1/int8"`) is not part of the core set and is ignored.
    """
    text = text.partition("/")[0]
    cores: list[int] = []
    for part in text.split("+"):
        lo, sep, hi = part.partition("-")
        try:
            start = int(lo)
            stop = int(hi) if sep else start
        except ValueError:
            raise UsageError(
                f"core set {text!r} is not a range of core numbers: write e.g. cpu:0-3 or cpu:0-1+4-5"
            ) from None
        if start < 0 or stop < start:
            raise UsageError(f"core set {text!r} has an empty or negative range: write e.g. cpu:0-3")
        cores.extend(range(start, stop + 1))
    return tuple(sorted(set(cores)))
