"""One module per ``kiln`` subcommand, in the order ``kiln --help`` lists them: each has ``add_parser(sub)``, which
adds its verb and options and sets its function, and that function (args -> exit code)."""

from jobs.commands import (ablate, arena, chat, config, generate, lineage, logbook, plan, run, status, sweep,
                           verify)

COMMANDS = (run, sweep, ablate, generate, chat, status, verify, config, plan, lineage, logbook, arena)
