"""Jobs, schedules and the one Definitions object (``jobs.definitions:defs``)."""
