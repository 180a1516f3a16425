"""Past one machine: a cluster plan run on Ray, one infermux runtime per node.

A `ClusterPlan` names per node the local plan to run there (or `tune: auto`); `open_cluster`
connects to Ray (`ray://HOST:PORT`, `auto`) or starts `local:N` nodes on this machine;
`run_cluster` places a runtime in a Ray actor on each node, routes the plan's LoadGen load by
each node's measured capacity and queue, survives lost nodes and stores the trial tagged by
node. `serve.start_cluster_runtime` puts `infermux serve`'s v2 front in front of the same driver
(`infermux serve PLAN --cluster ...`). `sim` predicts the policy on 10–1,000 nodes from measured
service times.
Ray is optional (`pip install 'infermux[cluster]'`) and imported only when a cluster is opened.
"""

from infermux.cluster.connect import ClusterHandle, open_cluster, parse_address
from infermux.cluster.driver import ClusterReport, run_cluster
from infermux.cluster.plan import (
    EXAMPLE_CLUSTER_PLAN,
    ClusterPlan,
    NodeEntry,
    is_cluster_plan,
    load_cluster_plan,
    parse_cluster_plan,
)
from infermux.cluster.router import ClusterSUT

__all__ = [
    "EXAMPLE_CLUSTER_PLAN",
    "ClusterHandle",
    "ClusterPlan",
    "ClusterReport",
    "ClusterSUT",
    "NodeEntry",
    "is_cluster_plan",
    "load_cluster_plan",
    "open_cluster",
    "parse_address",
    "parse_cluster_plan",
    "run_cluster",
]
