"""The storage root every asset writes under (local folder by default)."""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field


class KilnStorageResource(ConfigurableResource):
    """Where Kiln keeps source caches, corpora, shards, checkpoints and releases."""

    root: str = Field(default=".kiln/storage", description="Storage root folder; relative paths resolve from the working directory.")

    source_cache: str = Field(default="", description="Folder for downloaded source packages; empty means <root>/cache/sources.")

    def path(self, *parts: str) -> Path:
        p = Path(self.root).expanduser().resolve().joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        return p

    @property
    def cache_dir(self) -> Path:
        if self.source_cache:
            p = Path(self.source_cache).expanduser().resolve()
            p.mkdir(parents=True, exist_ok=True)
            return p
        return self.path("cache", "sources")
