"""Execution units: a device plus a numeric mode, addressed by one string everywhere.

`cpu`, `cpu:0-3` (a core set), `cpu:0-3/int8` (a Q/DQ model on those cores),
`cuda:0/fp32` (CUDA cores, TF32 off), `cuda:0/tf32`,
`cuda:0/fp16`, `cuda:0/bf16` (Tensor Cores), `dla:0/fp16`, `dla:1/int8` (TensorRT on Jetson),
`openvino:CPU`, `edgetpu:0` (a Coral Edge TPU, int8). Every unit names its contention domain:
what it shares with other units (the SMs of one GPU, a board's DRAM, a socket's cores, an Edge
TPU's USB or PCIe link). Discovery never crashes on a machine that lacks something; it records
what it found and why something is missing.
"""

from infermux.units.base import Discovery, Unit, parse_core_set
from infermux.units.discover import discover, select_units

__all__ = ["Discovery", "Unit", "discover", "parse_core_set", "select_units"]
