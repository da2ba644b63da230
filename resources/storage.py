"""The storage root every asset writes under: a local folder, or an fsspec URL (s3://bucket/prefix) for the durable copy.

Set it in run config (``resources: {storage: {config: {root: s3://bucket/kiln}}}``) or in jobs/definitions.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dagster import ConfigurableResource, FilesystemIOManager, InputContext, IOManager, OutputContext
from pydantic import Field

from kiln.tokens import store
from kiln.common.files import remove_stale_staging
from kiln.tokens.shards import SPLITS


class KilnStorageResource(ConfigurableResource):
    """Where Kiln keeps source caches, corpora, shards, checkpoints and releases.

    With a local ``root`` everything lives in that folder. With a URL ``root`` (``s3://``, ``gs://``,
    any fsspec protocol) assets work in a local copy under ``cache`` and publish their finished,
    content-addressed folders to the URL; training reads shards from the local copy, fetched from the
    URL and verified against the manifest's checksums whenever it is missing or stale.
    """

    root: str = Field(default=".kiln/storage", description="Storage root: a local folder, or an fsspec URL (s3://bucket/prefix) for the durable copy; s3:// uses s3fs, with credentials from the usual AWS variables or storage_options.")
    cache: str = Field(default=".kiln/cache", description="Local working copy and hot-shard cache, used when root is a URL (a local root is its own cache).")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for a URL root, e.g. {endpoint_url: http://127.0.0.1:9000} for an S3-compatible server.")
    source_cache: str = Field(default="", description="Folder for downloaded source packages; empty means <local folder>/cache/sources.")

    def setup_for_execution(self, context) -> None:
        """At the start of a run: remove the staging folders that killed runs left in the asset folders."""
        for p in self.remove_stale_staging():
            context.log.info(f"removed {p}: a staging folder left by a run that was killed")

    def remove_stale_staging(self) -> list[Path]:
        """Staging folders (kiln.common.files.staging_dir's, nothing else) whose process has ended, removed from
        the local folder and the asset folders directly under it; the folders removed."""
        base = Path(self.cache if self.durable else self.root).expanduser().resolve()
        if not base.is_dir():
            return []
        folders = [base, *sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))]
        return [p for folder in folders for p in remove_stale_staging(folder)]

    @property
    def durable(self) -> bool:
        """True when ``root`` is a URL, so finished outputs are also published there."""
        return store.is_url(self.root)

    def local_base(self) -> Path:
        """The local folder outputs are written under: ``root`` when it is local, else ``cache``."""
        return Path(self.cache if self.durable else self.root).expanduser().resolve()

    def path(self, *parts: str) -> Path:
        """The local folder for ``parts`` (created): under ``root`` when it is local, else under ``cache``."""
        p = self.local_base().joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        return p

    def url(self, *parts: str) -> str:
        """Where the durable copy of ``parts`` lives: a URL under ``root``, or the local folder itself."""
        return store.join(self.root, *parts) if self.durable else str(Path(self.root).expanduser().resolve().joinpath(*parts))

    def publish(self, local_dir: Path, *parts: str, last: str = "manifest.json") -> store.PublishResult:
        """Upload a finished folder to ``url(*parts)`` (``last`` after everything else); a no-op for a local root."""
        if not self.durable:
            return store.PublishResult(str(local_dir), 0, 0)
        return store.publish_dir(local_dir, self.url(*parts), self.storage_options, last=last)

    def local_dir(self, *parts: str, last: str = "manifest.json") -> Path:
        """The local copy of the published folder ``parts``, fetched from the URL root if this machine lacks it."""
        if not self.durable:
            return self.path(*parts)
        return store.fetch_dir(self.url(*parts), self.path(*parts), self.storage_options, last=last)

    def fetch_shards(self, *parts: str, splits: tuple[str, ...] = SPLITS) -> store.FetchResult:
        """The verified local copy of the shard folder ``parts`` (fetched from the URL root where needed)."""
        return store.fetch_shards(self.url(*parts), self.path(*parts), self.storage_options, splits)

    def local_shards(self, token_shards: dict) -> dict[str, list[str]]:
        """{split: local shard paths} of a ``token_shards`` output on this machine, fetched and verified first.

        Call this where a job needs the shard files (e.g. before launching training) instead of trusting
        the paths recorded when the shards were written, which may be on another machine's cache.
        """
        got = self.fetch_shards("token_shards", token_shards["version"])
        return {s: [str(got.dir / sh["file"]) for sh in got.manifest["shards"] if sh["split"] == s] for s in SPLITS}

    @property
    def cache_dir(self) -> Path:
        """Downloaded source packages."""
        if self.source_cache:
            p = Path(self.source_cache).expanduser().resolve()
            p.mkdir(parents=True, exist_ok=True)
            return p
        return self.path("cache", "sources")



class HandleIOManager(FilesystemIOManager):
    """The assets' handles on disk (Dagster's filesystem IO manager); an optional upstream asset that was never
    materialized in this home loads as None instead of failing on a missing file.

    Optional means listed in ``optional``: ``pretrained_model``, which tokenizer and training_plan read (a home made
    before that asset existed, or a run whose selection leaves it out, then trains from scratch: the asset's own
    meaning of "no path set"); ``ppo_model`` and ``reward_model``, which release_bundle reads only when told to
    release the PPO model; and
    ``judged_preferences``, which release_bundle reads only to report the judge in the card and lineage;
    ``sweep_results`` and ``scaling_ladder``, which training_plan uses only when told to (from_sweep, sizing: law)
    or to predict its run's loss. Every other missing handle is an error.
    """

    optional: list[str] = Field(default_factory=lambda: ["pretrained_model", "ppo_model", "reward_model",
                                                          "judged_preferences", "sweep_results", "scaling_ladder"],
                                description="Assets whose missing handle loads as None (never materialized here).")

    def create_io_manager(self, context) -> IOManager:
        return _OptionalInputs(super().create_io_manager(context), set(self.optional))


class _OptionalInputs(IOManager):
    def __init__(self, inner: IOManager, optional: set[str]):
        self.inner, self.optional = inner, optional

    def handle_output(self, context: OutputContext, obj: Any) -> None:
        self.inner.handle_output(context, obj)

    def load_input(self, context: InputContext) -> Any:
        try:
            return self.inner.load_input(context)
        except FileNotFoundError:
            name = context.asset_key.to_user_string() if context.has_asset_key else ""
            if name not in self.optional:
                raise
            context.log.info(f"{name} was never materialized in this home: treated as not set")
            return None
