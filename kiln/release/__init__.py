"""Step 10, release: the Hugging Face bundle, its model card and lineage, and the MLflow model registry."""
