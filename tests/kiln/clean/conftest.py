"""Fixtures of the clean tests: ``ray_cluster``, a real Ray cluster on 127.0.0.1 (a head node and a second worker
node, one CPU and a small object store each) started once per session by the first test that asks for it."""

from __future__ import annotations

import pytest

from ray_cluster import RayCluster


@pytest.fixture(scope="session")
def ray_cluster():
    cluster = RayCluster(workers=1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
