"""Failures as one line for the command line: the error an asset raised under Dagster's wrappers, and Dagster's
refusal of a run config (the first key, where it is, the closest allowed key). Used by ``kiln run``, ``kiln sweep``
and ``kiln ablate`` (jobs.cli, jobs.sweeps)."""

from __future__ import annotations

import difflib
from typing import Any


# Dagster's own exceptions wrap the error raised in an asset body (as its cause); they are not what went wrong.
WRAPPERS = ("RetryRequested", "RetryRequestedFromPolicy")


def innermost_error(error) -> tuple[str, str]:
    """(class name, message) of the deepest error in a SerializableErrorInfo's cause / context chain that is not a
    Dagster wrapper: the error the asset raised (a dagster.Failure counts when nothing is beneath it)."""
    found, seen = error, error
    while seen is not None:
        if not seen.cls_name or not (seen.cls_name.startswith("Dagster") or seen.cls_name in WRAPPERS):
            found = seen
        seen = seen.cause or seen.context
    message = found.message.strip()
    head = message.split(":", 1)
    if len(head) == 2 and head[0].rsplit(".", 1)[-1] == found.cls_name:  # "pkg.mod.Cls: text" -> "text"
        message = head[1].strip()
    return found.cls_name, " ".join(line.strip() for line in message.splitlines() if line.strip())


def config_error_line(error, job) -> str:
    """Dagster's refusal of a run config as one line: the first error's key and where it is (dotted, as in the
    preset), with the closest allowed key for a typo, and how many errors follow."""
    first, more = error.errors[0], len(error.errors) - 1
    path = [str(getattr(e, "field_name", getattr(e, "list_index", "?"))) for e in first.stack.entries]
    where = ".".join(path) or "the top level"
    names = getattr(first.error_data, "field_names", None) or [getattr(first.error_data, "field_name", "")]
    if first.reason.name in ("FIELD_NOT_DEFINED", "FIELDS_NOT_DEFINED"):
        close = difflib.get_close_matches(names[0], allowed_keys(job.run_config_schema.config_type, path), n=1)
        line = f"unknown key '{names[0]}' in {where}" + (f"; did you mean '{close[0]}'?" if close else "")
    else:
        line = first.message.split(" Expected")[0].rstrip(".") + f" ({where})"
    return line + (f" (and {more} more error{'s' * (more > 1)})" if more else "")


def unknown_name_line(run_config: dict[str, Any], job) -> str | None:
    """The ops and resources a preset names that ``job`` does not have, as one line (the first, with the closest
    known name, and how many more); None when every name is known."""
    schema = job.run_config_schema.config_type
    found = []
    for section, what in (("ops", "op"), ("resources", "resource")):
        allowed = allowed_keys(schema, [section])
        block = run_config.get(section) or {}
        for name in (block if isinstance(block, dict) else {}):
            if name not in allowed:
                close = difflib.get_close_matches(name, allowed, n=1)
                hint = f"did you mean '{close[0]}'?" if close else f"{what}s are: {', '.join(sorted(allowed))}"
                found.append(f"unknown {what} '{name}' in {section}; {hint}")
    if not found:
        return None
    more = len(found) - 1
    return found[0] + (f" (and {more} more error{'s' * (more > 1)})" if more else "")


def allowed_keys(config_type, path: list[str]) -> list[str]:
    """The field names of the config block at ``path`` in a Dagster config type ([] when it is not a block)."""
    for name in [*path, None]:
        while getattr(config_type, "inner_type", None) is not None:  # Noneable / Array wrappers
            config_type = config_type.inner_type
        fields = getattr(config_type, "fields", None) or {}
        if name is None:
            return list(fields)
        if name not in fields:
            return []
        config_type = fields[name].config_type
    return []
