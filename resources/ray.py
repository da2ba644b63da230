"""The Ray cluster the clean step runs on when ``clean.executor`` is ray: its address, and how often a task whose
worker died is run again.

Set it in run config (``resources: {ray: {config: {address: 10.0.0.5:6379}}}``); start a cluster on this machine
with ``ray start --head --port=6379``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kiln.common.config import Domain
from resources.base import KilnResource


class RayResource(KilnResource):
    """Where ``clean.executor: ray`` submits the clean step: a running Ray cluster's head (``ray start --head``)."""

    address: str = Field(default="127.0.0.1:6379", description="host:port of the Ray head's GCS (what `ray start --head --port=PORT` prints), or 'auto' for the cluster started on this machine.")
    max_retries: Annotated[int, Domain(0)] = Field(default=3, description="Times Ray reruns a task whose worker died (killed, out of memory) before the step fails.")
    partitions: Annotated[int, Domain(0)] = Field(default=0, description="Hash partitions of the sharded dedup; 0: two per CPU of the cluster. The result does not depend on it.")

    def connect(self):
        """Connect this process to the cluster (kiln.clean.ray_run.RayInfo: job id, dashboard link, nodes, CPUs);
        RayClusterError naming the address and how to start a cluster when none answers."""
        from kiln.clean.ray_run import connect

        return connect(self.address)

    def disconnect(self) -> None:
        """Leave the cluster (it keeps running)."""
        import ray

        ray.shutdown()
