"""Step 10, release: the Hugging Face bundle (bundle, hf), its model card (card) and lineage, the MLflow model registry.

Written by the release_bundle asset (``kiln run``); ``kiln generate`` and ``kiln lineage`` read a bundle back.
"""
