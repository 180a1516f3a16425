"""Reaching a Ray cluster: an existing one (`ray://HOST:PORT`, `HOST:PORT`, `auto`) or a local one.

`local:N` starts N Ray nodes on this machine (one CPU each, a custom resource
`infermux-local-I` each, so plans can name them), for trying a cluster plan and for the tests.
Ray is imported here only, lazily, with its usage reporting switched off first.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from infermux.errors import RunError, UsageError

__all__ = ["ClusterHandle", "import_ray", "open_cluster", "parse_address"]

_LOCAL = re.compile(r"^local:(\d+)$")
_HELP = "ray://HOST:PORT (Ray client), HOST:PORT (a Ray head's address), auto, or local:N"
#: Failure detection of a local cluster: a removed node is seen dead within about 1.5 s
#: instead of Ray's default of several seconds to a minute.
LOCAL_SYSTEM_CONFIG = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 500,
                       "health_check_failure_threshold": 3}


def import_ray() -> ModuleType:
    """Ray, imported with its usage statistics off (it reports over the network otherwise)."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    try:
        import ray
    except ImportError:
        raise UsageError("a cluster needs Ray: pip install 'infermux[cluster]' "
                         "(or pip install ray)") from None
    return ray


def parse_address(address: str) -> tuple[str, int]:
    """('ray', 0) for an address Ray connects to, ('local', N) for `local:N`; else a UsageError."""
    text = address.strip()
    m = _LOCAL.match(text)
    if m:
        n = int(m.group(1))
        if not 1 <= n <= 16:
            raise UsageError(f"--cluster {address!r}: a local cluster has 1 to 16 nodes "
                             "(local:2 starts two)")
        return "local", n
    if text == "auto" or text.startswith("ray://") or re.match(r"^[\w.\-]+:\d+$", text):
        return "ray", 0
    raise UsageError(f"--cluster {address!r} is not a cluster address; use {_HELP}")


@dataclass
class ClusterHandle:
    """A connected cluster: its live nodes, and for a local one the means to stop a node."""

    address: str
    ray: ModuleType
    local: Any = None  # ray.cluster_utils.Cluster for local:N
    local_nodes: dict[str, Any] = field(default_factory=dict)  # node id -> its local handle
    started_s: float = 0.0

    def nodes(self) -> list[dict[str, Any]]:
        """Alive Ray nodes (`ray.nodes()` rows), the head first."""
        rows = [n for n in self.ray.nodes() if n.get("Alive")]
        return sorted(rows, key=lambda n: (not (n.get("Resources") or {}).get(
            "node:__internal_head__"), n.get("NodeID", "")))

    def kill_node(self, node_id: str) -> None:
        """Stop one node of a local cluster at once (its raylet and every process on it).

        A machine that dies takes its processes with it; Ray's own removal stops the raylet
        and leaves its workers to notice, so their processes are killed here as well.
        """
        import signal

        if self.local is None:
            raise UsageError("only a local cluster's nodes can be stopped from here")
        node = self.local_nodes.get(node_id)
        if node is None:
            raise UsageError(f"node {node_id[:12]} is not a node of this local cluster")
        pids = _worker_pids(self.ray, node_id)
        self.local.remove_node(node, allow_graceful=False)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        del self.local_nodes[node_id]

    def add_node(self, num_cpus: int = 1, resources: dict[str, float] | None = None) -> str:
        """Start one more node in a local cluster (resource `infermux-local-I`, and `resources`).

        What a machine joining a real cluster is: a plan entry with `count: all` that matches
        it takes it while the plan runs (`cluster.nodes.NodeWatcher`). Its id is returned.
        Ray starts the node's processes with signal handlers: call it from the main thread.
        """
        if self.local is None:
            raise UsageError("only a local cluster can be given a node from here; join a real "
                             "cluster with `ray start --address HEAD:PORT` on the new machine")
        index = len(self.local.list_all_nodes())
        while any(f"infermux-local-{index}" in (n.get("Resources") or {}) for n in self.nodes()):
            index += 1
        node = self.local.add_node(num_cpus=num_cpus,
                                   resources={f"infermux-local-{index}": 1, **(resources or {})})
        self.local.wait_for_nodes()
        self.local_nodes[node.node_id] = node
        return str(node.node_id)

    def close(self) -> None:
        """Disconnect; a local cluster is shut down."""
        self.ray.shutdown()
        if self.local is not None:
            self.local.shutdown()

    def __enter__(self) -> ClusterHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _worker_pids(ray: ModuleType, node_id: str) -> list[int]:
    """Process ids of Ray actors alive on a node (this machine's local cluster)."""
    try:
        from ray.util.state import list_actors

        actors = list_actors(filters=[("node_id", "=", node_id), ("state", "=", "ALIVE")],
                             raise_on_missing_output=False)
    except Exception:  # noqa: BLE001  (state API unreachable: removing the raylet still stops it)
        return []
    return [int(pid) for a in actors if (pid := getattr(a, "pid", None))]


def open_cluster(address: str, *, local_cpus: int = 1) -> ClusterHandle:
    """Connect to a Ray cluster, or start `local:N`; close it with `.close()` (or `with`)."""
    kind, n = parse_address(address)
    ray = import_ray()
    started = time.perf_counter()
    if ray.is_initialized():
        ray.shutdown()
    if kind == "local":
        from ray.cluster_utils import Cluster

        try:
            local = Cluster(initialize_head=True, head_node_args={
                "num_cpus": local_cpus, "resources": {"infermux-local-0": 1},
                "include_dashboard": False, "_system_config": LOCAL_SYSTEM_CONFIG})
            nodes = {}
            for i in range(1, n):
                local.add_node(num_cpus=local_cpus, resources={f"infermux-local-{i}": 1})
            ray.init(address=local.address, log_to_driver=False)
            local.wait_for_nodes()
        except Exception as exc:
            raise RunError(f"a local Ray cluster of {n} nodes did not start: {exc}") from exc
        for node in [local.head_node, *local.worker_nodes]:
            nodes[node.node_id] = node
        return ClusterHandle(address, ray, local, nodes, time.perf_counter() - started)
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:
        raise UsageError(f"--cluster {address!r}: no Ray cluster answered ({exc}); start one "
                         "with `ray start --head` or use --cluster local:2") from None
    except Exception as exc:
        raise RunError(f"--cluster {address!r}: could not connect to Ray: {exc}") from exc
    return ClusterHandle(address, ray, started_s=time.perf_counter() - started)
