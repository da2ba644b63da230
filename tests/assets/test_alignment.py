"""assets.alignment: the rl_model config takes every RL setting (kiln.posttrain.rl.RlSettings) as a typed field of its
own, and gives the job fields, and so the run-folder key, that the same config gave before the settings were one
dataclass."""

import pytest
from pydantic import ValidationError

from assets.alignment import RlModelConfig
from kiln.common.config import field_docs
from kiln.common.files import stable_hash
from kiln.posttrain.rl import RL_SETTINGS, RlJob


def test_every_rl_setting_is_a_field_of_the_rl_model_config_with_its_job_doc() -> None:
    fields, docs = RlModelConfig.model_fields, field_docs(RlJob)
    assert set(RL_SETTINGS) <= set(fields), set(RL_SETTINGS) - set(fields)
    assert all(fields[name].description == docs[name] for name in RL_SETTINGS)
    assert fields["eps_high"].description.startswith("the ratio pi/pi_old is clipped to [1 - eps_low, 1 + eps_high]")


def test_the_rl_model_job_fields_and_their_key_are_as_recorded() -> None:
    fields = RlModelConfig().job_fields()
    assert fields == {
        "max_steps": 120, "eval_interval": 20, "seed": 1337, "reward": "arithmetic", "group_size": 8,
        "max_new_tokens": 16, "temperature": 0.7, "partial_credit": 0.2, "kl_coef": 0.1, "eval_items": 100,
        "algorithm": "grpo", "ppo_epochs": 1, "eps_low": None, "eps_high": None, "loss_aggregation": None,
        "dynamic_sampling": None, "max_sampling_rounds": 3, "overlong_buffer": None, "ptx_coef": 0.0,
        "preference_coef": 0.1, "preference_beta": 0.1, "prompts_per_step": 8,
        "optim": {"lr": 3e-05, "min_lr_ratio": 0.5, "warmup_steps": 5, "weight_decay": 0.0}, "lora": {}, "init_from": ""}
    assert stable_hash(fields) == "bee1fe2eda1e0ce7cf2e062290edc28f6d209307377c9a71c833abea90288fbb"
    dapo = RlModelConfig(algorithm="dapo").job_fields()
    assert stable_hash(dapo) == "44bc0282f13649736b86bc9cb404db8c16a340c8ffe8a0b803023cbd636de538"


@pytest.mark.parametrize("fields, message", [
    ({"group_size": 0}, "RlModelConfig.group_size is 0: give >= 2"),
    ({"kl_coef": -1.0}, "RlModelConfig.kl_coef is -1.0: give >= 0"),
    ({"eps_high": 0.0}, "RlModelConfig.eps_high is 0.0: give > 0 or None"),
])
def test_an_rl_setting_outside_its_domain_is_refused_naming_it(fields, message) -> None:
    with pytest.raises(ValidationError, match=message):
        RlModelConfig(**fields)
