"""What Kiln's resources share: their base class, whose numbers stay inside the Domain each field declares
(``n: Annotated[int, Domain(1)] = Field(...)``, kiln.common.config.Domain), checked when Dagster builds the resource
(``kiln run``'s preflight checks a run's resource config before the first asset: jobs.preflight.check_numbers); and
the two ways an error becomes a step's Failure without a retry: a config error (failing_on_config_errors, the one
helper the assets and the torchrun launcher use) and a stored file found damaged, which is set aside
(failing_on_damage). ``resource_of(Spec)`` makes a resource's fields from a core settings dataclass, so a resource
declares none of the core's settings a second time."""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from typing import Any, Iterator

from dagster import ConfigurableResource, Failure
from pydantic import Field, create_model, model_validator

from kiln.common.config import ConfigError, check_model_domains, field_docs
from kiln.plan.memory import PlanError


class KilnResource(ConfigurableResource):
    @model_validator(mode="after")
    def _numbers_in_their_domains(self):
        check_model_domains(self, type(self).__name__)
        return self


def resource_of(spec: type, defaults: dict[str, Any] | None = None, docs: dict[str, str] | None = None) -> type:
    """A KilnResource base class with one field per field of dataclass ``spec``: its type (with its Domain), its
    default (or ``defaults``'), and its ``# comment`` as the description the launchpad shows (or ``docs``'). The
    resource subclasses it and adds only what is its own; ``spec_of(resource, spec)`` turns it back."""
    hints, comment = typing.get_type_hints(spec, include_extras=True), field_docs(spec)
    defaults, docs = defaults or {}, docs or {}
    unknown = sorted((set(defaults) | set(docs)) - {f.name for f in dataclasses.fields(spec)})
    if unknown:
        raise TypeError(f"resource_of({spec.__name__}): {unknown} are not its fields")
    fields = {f.name: (hints[f.name], Field(default=defaults.get(f.name, f.default),
                                            description=docs.get(f.name) or comment[f.name]))
              for f in dataclasses.fields(spec)}
    return create_model(f"{spec.__name__}Fields", __base__=KilnResource, __module__=spec.__module__, **fields)


def spec_of(resource: Any, spec: type) -> Any:
    """The ``spec`` dataclass holding a resource's values of its fields (the inverse of ``resource_of``)."""
    return spec(**{f.name: getattr(resource, f.name) for f in dataclasses.fields(spec)})


@contextlib.contextmanager
def failing_on_damage() -> Iterator[None]:
    """Turn a stored file found damaged while read (kiln.common.files.DamagedFileError: a checkpoint failing its
    checksum, an encoding file its fingerprint) into ``dagster.Failure`` naming it, after setting it aside: the next
    run's reuse check finds it missing and recomputes the output that holds it (training resumes from its newest
    good checkpoint), where it would otherwise fail on the same file run after run. No retry: the same read fails."""
    from kiln.common.files import DamagedFileError, set_aside

    try:
        yield
    except DamagedFileError as e:
        aside = ""
        if e.path.is_file():
            aside = f"; set aside as {set_aside(e.path).name}"
        raise Failure(description=f"{type(e).__name__}: {e}{aside}: run again, and the output that holds it is "
                                  "recomputed (training resumes from its newest good checkpoint)",
                      allow_retries=False) from e


# Errors in the run config (a wrong key or value, a plan that cannot fit): the same config fails the same way again.
CONFIG_ERRORS = (ConfigError, PlanError)


@contextlib.contextmanager
def failing_on_config_errors() -> Iterator[None]:
    """Turn a config error raised inside into ``dagster.Failure(allow_retries=False)``, so the asset's retry policy
    does not rerun a typo; its message becomes the failure's description (the error stays its ``__cause__``)."""
    try:
        yield
    except CONFIG_ERRORS as e:
        raise Failure(description=f"{type(e).__name__}: {e}", allow_retries=False) from e
