"""Dagster resources: storage root, MLflow tracking, hardware-aware torchrun launcher.

Import the submodules directly; this package file imports nothing so a torchrun worker
(``resources.pipes_worker``) never loads Dagster.
"""
