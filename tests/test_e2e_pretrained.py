"""End to end from released weights: a tiny random transformers Qwen3-MoE (a mixture of experts whose router runs in
every stage, generation included), saved to a folder, goes through continued pretraining, SFT, DPO, RL and release;
transformers reloads the release with Kiln's logits. (GPT-2 and llama imports are checked at the unit level:
tests/kiln/pretrained/test_source.py gives transformers' logits on import for both families,
tests/kiln/release/test_release.py and test_hf.py reload their releases in transformers.)"""

import copy
from pathlib import Path

import pytest
import torch
from dagster import DagsterInstance

from hfmodels import save_tiny
from jobs.presets import load_preset
from jobs.definitions import ALL_ASSETS, make_definitions
from kiln.model.config import ModelConfig
from kiln.pretrained.source import folder_hash
from kiln.release.lineage import checkpoint_lineage, lineage_tree, read_release_info
from kiln.tokens.tokenizer import load_encoding
from kiln.train.checkpoint import load_for_inference

pytestmark = pytest.mark.slow

# the smoke preset, fewer steps; the architecture comes from the imported model, so training_plan.model goes
SHORTER = {"training_plan": {"batch": {"seq_len": 64, "global_batch": 16, "max_steps": 12}},
           "base_model": {"eval_interval": 6, "ckpt_interval": 12, "log_interval": 6},
           "sft_model": {"max_steps": 6, "eval_interval": 3}, "dpo_model": {"max_steps": 3, "eval_interval": 3},
           "rl_model": {"max_steps": 2, "eval_interval": 2}}


# the AI judge's template does not fit the tiny import's 64-token context under its near-byte-level tokenizer;
# judged_preferences is tested on Kiln's own models (tests/test_e2e.py, tests/kiln/posttrain/test_judge.py). The RLHF
# side branch (reward_model, ppo_model) starts from sft_model as DPO does and is not on the released chain: it runs on
# a llama in tests/test_e2e.py's smoke run, and tests/kiln/posttrain/test_reward.py reloads its models in transformers.
UNJUDGED = {"judged_preferences", "reward_model", "ppo_model"}


def pretrained_config(folder: Path) -> dict:
    conf = copy.deepcopy(load_preset("smoke"))
    del conf["ops"]["training_plan"]["config"]["model"]
    for op, fields in SHORTER.items():
        conf["ops"][op]["config"].update(fields)
    conf["ops"]["pretrained_model"] = {"config": {"path": str(folder)}}
    return conf


def run_from(tmp_path_factory, source_cache: Path, arch: str):
    folder = save_tiny(tmp_path_factory.mktemp(f"hf-{arch}") / "tiny", arch, extra_rows=0, license="mit")
    home = tmp_path_factory.mktemp("kiln-home")
    defs = make_definitions(home, str(source_cache))
    instance = DagsterInstance.ephemeral()
    conf = pretrained_config(folder)
    conf["ops"] = {k: v for k, v in conf["ops"].items() if k not in UNJUDGED}
    result = defs.resolve_job_def("kiln_pipeline_job").execute_in_process(
        run_config=conf, instance=instance, raise_on_error=True,
        asset_selection=[a.key for a in ALL_ASSETS if a.key.to_user_string() not in UNJUDGED])
    return folder, result


@pytest.fixture(scope="module")
def imported_run(tmp_path_factory, source_cache):
    return run_from(tmp_path_factory, source_cache, "qwen3_moe")


def test_every_asset_materialized_from_the_imported_model(imported_run):
    folder, result = imported_run
    assert result.success
    assert {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()} >= {
        a.key.to_user_string() for a in ALL_ASSETS} - UNJUDGED
    pm = result.output_for_node("pretrained_model")
    assert pm["sha256"] == folder_hash(folder) and pm["license"] == "mit" and pm["model_type"] == "qwen3_moe"
    assert ModelConfig(**result.output_for_node("training_plan")["model"]) == ModelConfig(**pm["model"])


def test_tokenizer_is_the_imported_one_with_identical_ids(imported_run):
    from tokenizers import Tokenizer

    folder, result = imported_run
    tok = result.output_for_node("tokenizer")
    assert tok["kind"] == "pretrained"
    enc, hf = load_encoding(tok["path"]), Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "The shell reads a command line, 42 times.\n\nThen it runs, and   prints: ok!"
    assert enc.encode_ordinary(text) == hf.encode(text).ids
    [user] = enc.encode("<|user|>", allowed_special="all")
    assert user >= hf.get_vocab_size()  # the chat tokens are appended after every imported id


def test_continued_pretraining_started_from_the_imported_weights(imported_run):
    _, result = imported_run
    pm, base = result.output_for_node("pretrained_model"), result.output_for_node("base_model")
    assert base["pretrained"]["sha256"] == pm["sha256"]
    info = checkpoint_lineage(base["checkpoint"])
    assert info["init_from"]["checkpoint"] == pm["checkpoint"] and info["init_from"]["pretrained"]["license"] == "mit"
    assert "fine-tuned from:" in lineage_tree(info)
    assert base["final_val_loss"] < base["initial_val_loss"]
    # the mixture's routing: token slots per expert per layer, its balance, shown on the asset page
    load = base["expert_load"]
    assert len(load["by_layer"]) == 2 and all(len(row) == 4 for row in load["by_layer"])
    assert sum(map(sum, load["by_layer"])) == 12 * 16 * 64 * 2 * 2  # 12 steps x 16 x 64 tokens x 2 experts x 2 layers
    assert load["params"]["active"] < load["params"]["total"]
    meta = next(e.materialization.metadata for e in result.get_asset_materialization_events()
                if e.asset_key.to_user_string() == "base_model")
    assert meta["expert_load"].value.startswith("![expert load (aux_loss balancing)](data:image/png;base64,")
    assert "| layer | token_slots | max_over_mean | entropy | busiest | idlest |" in meta["expert_balance"].value
    assert meta["load_max_over_mean"].value == pytest.approx(load["balance"]["moe/load_max_over_mean"], rel=1e-3)


def test_release_reloads_in_transformers_with_kilns_logits_and_names_its_start(imported_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, result = imported_run
    bundle = Path(result.output_for_node("release_bundle")["dir"])
    trained, _, _ = load_for_inference(result.output_for_node("rl_model")["checkpoint"])
    hf = AutoModelForCausalLM.from_pretrained(str(bundle)).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(bundle))
    text = "<|user|>What does ls do?<|assistant|>It lists files.<|endoftext|>"
    ids = torch.tensor([hf_tok(text)["input_ids"]])
    assert ids[0].tolist() == load_encoding(bundle / "tokenizer.kiln.json").encode(text, allowed_special="all")
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), trained(ids), atol=1e-4, rtol=1e-4)
    pm = result.output_for_node("pretrained_model")
    card = (bundle / "README.md").read_text()
    assert "## Starting weights" in card and pm["sha256"] in card and "licence mit" in card
    info = read_release_info(bundle)
    assert info["pretrained"]["base_model"]["sha256"] == pm["sha256"]
    assert info["pretrained"]["base_model"]["model_type"] == "qwen3_moe"
    assert result.output_for_node("training_plan")["model"]["family"] == "moe"
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.num_experts == 4
