"""``kiln arena`` refuses what it cannot serve before it starts: a missing folder, a folder with no model, one model,
or two references to the same weights, each named with what to give instead (tests/ui/test_arena.py serves one).

Run: python -m pytest tests/jobs/test_cli_arena.py -q
"""

from __future__ import annotations

from dataclasses import asdict

import pytest

from jobs.cli import main


@pytest.fixture
def bundle_and_checkpoint(tmp_path, tiny_tokenizer):
    import torch

    from kiln.model.config import ModelConfig
    from kiln.model.gpt2.model import GPT
    from kiln.release.bundle import write_release
    from kiln.train.checkpoint import save_checkpoint

    cfg = ModelConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "run" / "checkpoints", 3, {"model": GPT(cfg).state_dict()},
                           {"model": asdict(cfg), "task": "sft"}, extra_files={"tokenizer.json": tiny_tokenizer[1]})
    write_release(ckpt, tmp_path / "release", card="# card\n", extra={"name": "arena-cli"})
    return tmp_path / "release", ckpt


def test_bad_references_are_named_with_what_to_give(tmp_path, bundle_and_checkpoint):
    bundle, ckpt = bundle_and_checkpoint
    home = ["--home", str(tmp_path / "home")]
    with pytest.raises(SystemExit, match=rf"kiln arena: {tmp_path / 'nowhere'}: no such folder; give a release bundle "
                                         r"folder, a checkpoint \(or run folder\), or models:/NAME/VERSION"):
        main(["arena", str(bundle), str(tmp_path / "nowhere"), *home])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=rf"kiln arena: cannot load {tmp_path / 'empty'} .*no checkpoint found.*give a "
                                         "release bundle folder"):
        main(["arena", str(bundle), str(tmp_path / "empty"), *home])
    with pytest.raises(SystemExit, match="give two or more different models"):
        main(["arena", str(bundle), *home])
    with pytest.raises(SystemExit, match="give two or more different models"):
        main(["arena", str(bundle), str(bundle), *home])
    with pytest.raises(SystemExit, match=r"load the same weights; give models that differ"):
        main(["arena", str(bundle), str(ckpt), *home])  # a release and the checkpoint it came from are one model
    assert not (tmp_path / "home").exists()  # nothing written for an arena that never started


def test_models_are_named_for_people_not_by_their_machine_paths(tmp_path, bundle_and_checkpoint):
    from jobs.commands.arena import display_name, unique_name

    bundle, ckpt = bundle_and_checkpoint
    assert display_name(str(bundle), bundle) == "arena-cli"  # the name in the release's kiln.json
    assert display_name(str(ckpt), ckpt) == "run@3"  # a checkpoint: its run folder and step
    assert display_name(str(ckpt.parents[1]), ckpt.parents[1]) == "run"
    assert display_name("models:/kiln/2", tmp_path) == "models:/kiln/2"
    assert unique_name("run", ["run", "run (2)"]) == "run (3)" and unique_name("a", []) == "a"
