"""The published headline figures each study is set beside, with the hardware they came from.

These are the papers' and MLPerf's numbers, quoted for context: a report shows them in a box of
their own, labelled with their hardware and software, and never mixes them into this
machine's tables or plots.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PUBLISHED"]

PUBLISHED: dict[str, dict[str, Any]] = {
    "multi-instance": {
        "source": "Multi-instance inference on several accelerators of one device (ResNet50)",
        "hardware": "NVIDIA Jetson AGX Orin: CUDA cores and Tensor Cores from PyTorch, DLAs "
                    "through ONNX → TensorRT",
        "figures": [
            ("best single unit", "CUDA cores alone: 415.2 images/s at batch 64"),
            ("large batch", "CUDA cores + Tensor Cores together beat either alone"),
            ("small batch", "DLA + CUDA cores helps: 40–50 images/s"),
            ("all three units", "lose to contention at large batch"),
        ],
        "also": [
            ("MLPerf Inference, ResNet50 offline, Jetson AGX Orin (TensorRT INT8)",
             "6,424 samples/s; NVIDIA's configuration: GPU ≈ 4,500 + each DLA ≈ 600, "
             "GPU + 2 DLAs ≈ 6,100"),
            ("MLPerf Inference, ResNet50 offline, H100 (TensorRT INT8)", "88,714 samples/s"),
        ],
    },
    "pipeline": {
        "source": "A TensorRT framework for heterogeneous processors: networks cut into "
                  "pipeline stages across GPU and DLAs",
        "hardware": "NVIDIA Jetson AGX Xavier: GPU + 2 DLAs, TensorRT",
        "figures": [
            ("throughput", "+101% to +680% over GPU-only, on nine benchmarks"),
            ("energy", "up to −55% over GPU-only"),
        ],
        "also": [],
    },
    "multi-tenancy": {
        "source": "AI multi-tenancy on edge devices for throughput",
        "hardware": "NVIDIA Jetson TX2, Jetson Nano, Jetson Xavier NX; Google EdgeTPUs",
        "figures": [
            ("batching", "more than 2.4× throughput on a GPU board"),
            ("CME and DMP", "up to 3× on GPU boards, up to 10× on EdgeTPUs"),
            ("clusters of accelerators", "add more throughput on top"),
        ],
        "also": [],
    },
}
