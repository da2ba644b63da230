"""The ``kiln`` command line: run the pipeline with a preset; sample from, plan or trace the lineage of a model.

Run ``kiln --help`` (or ``python -m jobs.cli --help``) for the commands; USAGE below shows examples. Each command is
one module of jobs.commands; presets are jobs.presets'.
"""

from __future__ import annotations

import argparse
import sys

from jobs.commands import COMMANDS

USAGE = """Kiln: raw public text -> a released language model, every step a Dagster asset (see README.md).

Start with `kiln run --preset smoke` (two minutes), then `kiln status --preset smoke` after changing a setting to see
what the next run would redo and why. Examples:

  kiln run --preset demo                      materialize every asset with conf/presets/demo.yaml
  kiln run --preset smoke --select eval_scores,release_bundle
  kiln status --preset demo                   each asset: reused, resumed or recomputed next run, why, how long
  kiln verify                                 hash every recorded output; set aside what is damaged (a scrub)
  kiln generate .kiln/storage/release_bundle/<version> --prompt "The"
  kiln chat .kiln/storage/release_bundle/<version>   a conversation in the model's chat template (or a GGUF file)
  kiln lineage .kiln/storage/release_bundle/<version>      (or models:/kiln-demo@candidate; --json for JSON)
  kiln plan --preset gpt2-124m-8gpu  the training plan a preset gets on its hardware, without running anything
  kiln sweep --preset sweep-demo      a hyper-parameter sweep: every point a short training run, then the ranking
  kiln ablate --preset ablation-demo  a data ablation: each rule's proxies over seeds, verdicts against the baseline
  kiln logbook RUN_OR_RELEASE                 every attempt of a training run (or each stage of a release), how it ended
  kiln arena RELEASE_A models:/kiln-demo/2    a blind side-by-side vote between models in the browser, with ratings
"""


class VerbHelp(argparse.ArgumentDefaultsHelpFormatter):
    """A verb's --help: its description, and each option's default where it has one its help does not state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default in ("", argparse.SUPPRESS)
        if unset or "default" in text or not action.option_strings:
            return text
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description=USAGE, formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(
        prog, width=120, max_help_position=16))
    sub = parser.add_subparsers(title="commands", dest="command", required=True)
    add_parser = sub.add_parser

    def verb(name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002 - argparse's own word
        return add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".", formatter_class=VerbHelp)

    sub.add_parser = verb  # every verb: its help line doubles as the description of its own --help
    for command in COMMANDS:
        command.add_parser(sub)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
