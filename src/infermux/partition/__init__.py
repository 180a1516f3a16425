"""Pipeline partitioning: cut one network into stages across units, balanced and measured.

`graph` finds the valid cut points, `segments` builds each piece as a module, `profile` times
pieces and transfers on the units, `dp` balances them exactly, `pipeline` runs a plan with
bounded buffers and duplicated stages, `plan` is the YAML `stages:` contract, `search` puts it
all together.
"""

from infermux.partition.dp import Candidate, ProfileCost, StageChoice, brute_force, solve
from infermux.partition.graph import CutPoint, ModelGraph, TensorInfo, capture_graph
from infermux.partition.pipeline import Pipeline, PipelineMeasurement
from infermux.partition.plan import PipelinePlan, StageSpec
from infermux.partition.profile import Profile, profile_segments, time_transfer
from infermux.partition.search import PartitionConfig, PartitionReport, run_partition
from infermux.partition.segments import Segment, build_segment, split

__all__ = [
    "Candidate", "CutPoint", "ModelGraph", "PartitionConfig", "PartitionReport", "Pipeline",
    "PipelineMeasurement", "PipelinePlan", "Profile", "ProfileCost", "Segment", "StageChoice",
    "StageSpec", "TensorInfo", "brute_force", "build_segment", "capture_graph",
    "profile_segments", "run_partition", "solve", "split", "time_transfer",
]
