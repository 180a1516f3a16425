"""`infermux serve --cluster`: the KServe v2 server's core in front of a cluster's runtime.

The server (`infermux.serve`) drives a `Runtime` (`infermux.runtime.api`); for a cluster that
is `cluster.runtime.ClusterRuntime` in serving mode:

- **Requests go to nodes.** A request's rows travel with its piece in the node's `submit`
  call (Ray passes large arrays through its object store); pieces are routed as a run routes
  them (`ClusterSUT`: whole batches to the node that would finish first, by measured rate and
  what it holds). Each node runs the rows through its own runtime and sends the outputs, with
  the sample indices they answer, in its poll answers; the server writes them into the
  request's arrays in order.
- **A lost node loses no request.** Its pieces go, rows and all, to another node serving the
  model (at most `route.max_retries` times), else the request is answered with an error; a
  node that fails a piece has it retried the same way. Nothing waits on a dead node.
- **A bad input fails its request alone.** A node's runtime tells an input's fault from a
  worker's as on one machine (the worker raised, then ran a batch of its own samples and serves
  on): the node reports the request rejected, and the server answers it 400 (gRPC
  INVALID_ARGUMENT) with the engine's message. It is not tried on another node (it would raise
  there too) and no worker restarts; a worker's fault is retried elsewhere as above.
- **Readiness.** A model is ready while a live worker of a live node serves it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from infermux.cluster.connect import ClusterHandle
from infermux.cluster.nodes import _start_nodes, _stop_nodes
from infermux.cluster.plan import ClusterPlan
from infermux.cluster.runtime import ClusterRuntime

__all__ = ["SERVE_SAMPLE_POOL", "start_cluster_runtime"]

#: Samples per model each node keeps for its own warm-up (a server's data comes in requests).
SERVE_SAMPLE_POOL = 4


def start_cluster_runtime(cluster_plan: ClusterPlan, handle: ClusterHandle, *,
                          base: Path | None = None, progress: Any = None,
                          max_restarts: int = 0, wait_when_idle: bool = False
                          ) -> ClusterRuntime:
    """Start every node's runtime for serving; the runtime the server's core drives.

    `max_restarts`: each node restarts its own failed workers that many times;
    `wait_when_idle`: idle workers wait out the queue delay for fuller batches (`--wait-when-idle`).
    """
    links = _start_nodes(cluster_plan, handle, base, progress, serving=True,
                         max_restarts=max_restarts, take_when_idle=not wait_when_idle)
    try:
        runtime = ClusterRuntime(cluster_plan, handle, links, base=base,
                                 max_restarts=max_restarts, take_when_idle=not wait_when_idle)
        runtime.start()
        return runtime
    except BaseException:
        with contextlib.suppress(Exception):
            _stop_nodes(handle.ray, links)
        raise
