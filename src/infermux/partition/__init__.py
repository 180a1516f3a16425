"""Pipeline partitioning: cut one network into stages across units, balanced and measured.

The graph and its pieces live beside the models (`infermux.models.graph`, `.segments`: the
valid cut points, each piece as a module), the executor in the runtime (`infermux.runtime.stages`).
Here `profile` times pieces and transfers on the units, `dp` balances them exactly,
`pipeline_file` writes and reads the runtime Plan a pipeline is (a model entry with `stages:`),
and `search` puts it all together, measuring the top candidates through `run_plan`.
"""

from infermux.models.graph import CutPoint, ModelGraph, TensorInfo, capture_graph
from infermux.models.segments import Segment, build_segment, split
from infermux.partition.dp import Candidate, ProfileCost, StageChoice, brute_force, solve
from infermux.partition.pipeline_file import load_pipeline, pipeline_plan, save_pipeline
from infermux.partition.profile import Profile, profile_segments, time_transfer
from infermux.partition.search import PartitionConfig, PartitionReport, run_partition

__all__ = [
    "Candidate", "CutPoint", "ModelGraph", "PartitionConfig", "PartitionReport", "Profile",
    "ProfileCost", "Segment", "StageChoice", "TensorInfo", "brute_force", "build_segment",
    "capture_graph", "load_pipeline", "pipeline_plan", "profile_segments", "run_partition",
    "save_pipeline", "solve", "split", "time_transfer",
]
