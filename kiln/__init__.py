"""Kiln's ML core: sources, cleaning, tokenizer, shards, model, training, evaluation, release.

Runs under plain ``python`` or ``torchrun``; it never imports Dagster.
"""

__version__ = "0.1.0"
