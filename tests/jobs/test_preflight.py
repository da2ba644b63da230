"""kiln run and kiln status make one decision before anything runs (jobs.preflight): what the run would refuse, the
dry run refuses in the same words, and neither touches an output."""

import pytest
import torch

from jobs.cli import main


def both(preset, home, capsys) -> tuple[str, str]:
    """(kiln status's one line, kiln run's one line) for ``preset``; both refuse with exit status 2."""
    assert main(["status", "--preset", str(preset), "--home", str(home)]) == 2
    status = capsys.readouterr().err.strip()
    assert main(["run", "--preset", str(preset), "--home", str(home)]) == 2
    run = capsys.readouterr().err.strip()
    assert "\n" not in status and "\n" not in run
    assert status.removeprefix(f"kiln: fix preset {preset} first: ") == run.removeprefix(f"kiln: preset {preset}: ")
    assert not (home / "storage").exists()  # refused before any asset ran
    return status, run


@pytest.fixture
def preset(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))

    def write(ops: str, top: str = "") -> object:
        path = tmp_path / "p.yaml"
        path.write_text(f"extends: smoke\n{top}ops:\n{ops}")
        return path

    return write


def test_a_probes_file_that_is_not_yaml_is_refused_by_status_as_by_run(tmp_path, preset, capsys):
    probes = tmp_path / "probes.yaml"
    probes.write_text("intended_use: [unclosed\n")
    _, run = both(preset(f"  red_team_report:\n    config:\n      probes: {probes}\n"), tmp_path / "home", capsys)
    assert f"red_team_report: {probes}" in run and "YAML" in run, run


def test_an_unknown_opt_in_and_a_bad_principles_file_are_refused_by_both(tmp_path, preset, capsys):
    status, _ = both(preset("  tokenizer: {}\n", top="opt_in: [reward_modle]\n"), tmp_path / "home", capsys)
    assert "opt_in may name" in status and "['reward_modle']" in status
    principles = tmp_path / "principles.yaml"
    principles.write_text("principles: 3\n")
    status, _ = both(preset(f"  judged_preferences:\n    config:\n      principles: {principles}\n",
                            top="opt_in: [judged_preferences]\n"), tmp_path / "home", capsys)
    assert status.startswith(f"kiln: fix preset {tmp_path / 'p.yaml'} first: judged_preferences: ") and \
        str(principles) in status


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU: a cuda preset may run")
def test_a_gpu_preset_on_a_machine_without_one_is_refused_before_anything_runs(tmp_path, preset, capsys):
    status, run = both(preset("  training_plan:\n    config:\n      hardware: {device: cuda}\n"), tmp_path / "home",
                       capsys)
    assert "training_plan.hardware.device is cuda, but this machine has no CUDA device" in run
    status, run = both(preset("  training_plan:\n    config:\n      hardware: {device: tpu}\n"), tmp_path / "home",
                       capsys)
    assert run.endswith("training_plan.hardware.device is 'tpu': give cpu, cuda or auto")


def test_a_number_outside_its_domain_anywhere_in_the_run_is_refused_by_both_naming_the_key(tmp_path, preset, capsys):
    """Not only the plan's numbers: any step's (here the tokenizer's, and a block of the RL step's) and a
    resource's, each the one line its field's Domain gives."""
    status, run = both(preset("  tokenizer:\n    config:\n      vocab_size: 0\n"), tmp_path / "home", capsys)
    assert run.endswith("tokenizer.vocab_size is 0: give >= 259"), run
    status, run = both(preset("  rl_model:\n    config:\n      optim: {lr: -0.001}\n"), tmp_path / "home", capsys)
    assert run.endswith("rl_model.optim.lr is -0.001: give > 0"), run
    path = tmp_path / "r.yaml"
    path.write_text("extends: smoke\nresources:\n  torchrun:\n    config: {pg_timeout_s: 0}\n")
    status, run = both(path, tmp_path / "home", capsys)
    assert run.endswith("resources.torchrun.pg_timeout_s is 0: give >= 1"), run


def test_a_plan_the_hardware_cannot_run_is_refused_by_both_before_anything_runs(tmp_path, preset, capsys):
    """The planner's own decision, made before the first asset: 16 sequences a step over 3 processes, a layout block
    on a CPU plan; the same words the training_plan asset would fail with after every asset above it ran."""
    _, run = both(preset("  training_plan:\n    config:\n      hardware: {nproc_per_node: 3}\n"), tmp_path / "home",
                  capsys)
    assert run.endswith("training_plan: batch.global_batch=16 is not divisible by 3 ranks; use a multiple of 3"), run
    _, run = both(preset("  training_plan:\n    config:\n      layout: {}\n"), tmp_path / "home", capsys)
    assert "training_plan.layout plans GPU clusters: set training_plan.hardware.device to cuda" in run, run
