"""Shared by every step: strict config parsing, atomic files and hashes, MLflow metric batching."""
