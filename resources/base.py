"""The base of Kiln's configurable resources: each number inside the Domain its field declares
(``n: Annotated[int, Domain(1)] = Field(...)``, kiln.common.config.Domain), checked when Dagster builds the resource;
``kiln run``'s preflight checks a run's resource config before the first asset (jobs.preflight.check_numbers)."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import model_validator

from kiln.common.config import check_model_domains


class KilnResource(ConfigurableResource):
    @model_validator(mode="after")
    def _numbers_in_their_domains(self):
        check_model_domains(self, type(self).__name__)
        return self
