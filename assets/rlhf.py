"""RLHF as assets: a reward model trained on the preference pairs, then the SFT model trained by PPO against it.

Neither runs by default (jobs.definitions.OPT_IN): ``kiln run --preset rlhf`` runs them and releases the PPO model
(release_bundle.stage = ppo_model); ``kiln run --select reward_model,ppo_model`` adds them to a materialized home.
"""


from typing import Annotated, Optional

from dagster import AssetExecutionContext, Output, asset
from pydantic import Field

from assets._common import report_metadata
from assets._config import block_defaults, schema_of
from assets.alignment import Feedback, Lora, align, feedback_field, init_from_field, start_weights
from kiln.common.config import Domain
from kiln.posttrain.measures import heldout_suite, suite_key
from kiln.posttrain.ppo import PpoJob
from kiln.posttrain.report import ppo_report, reward_report
from kiln.posttrain.reward import RewardJob, write_hf_reward
from kiln.train.launch import RunSpec
from kiln.train.optim import OptimConfig
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource

RewardOptim = schema_of(OptimConfig, defaults=block_defaults(RewardJob, "optim"), name="RewardOptim")
PpoOptim = schema_of(OptimConfig, defaults=block_defaults(PpoJob, "optim"), name="PpoOptim")

REWARD_FIELDS = ("pair_kinds", "max_steps", "micro_batch", "eval_interval", "eval_pairs", "seed")


class RewardModelConfig(schema_of(RewardJob, include=REWARD_FIELDS, name="RewardJobFields")):
    optim: RewardOptim = Field(default_factory=RewardOptim, description="AdamW and its schedule for the reward model.")
    feedback: str = feedback_field()


@asset(code_version="1", group_name="rlhf")
def reward_model(context: AssetExecutionContext, config: RewardModelConfig, sft_model: dict, preference_data: dict,
                 training_plan: dict, tokenizer: dict, storage: KilnStorageResource, torchrun: TorchrunResource,
                 mlflow: MlflowResource, judged_preferences: Optional[dict] = None) -> Output[dict]:
    """The SFT model with a scalar head (the last response token's final hidden state -> one number) trained on the preference pairs with the Bradley-Terry loss by a torchrun job; held-out pair accuracy and margin over steps; saved as a Kiln checkpoint and as a Hugging Face *ForSequenceClassification folder. The pairs are preference_data's, judged_preferences' (RLAIF) or both (feedback); held out are always preference_data's."""
    feedback = Feedback("reward_model", config.feedback, preference_data, judged_preferences)  # None: never materialized
    fields = {**config.job_fields(), **feedback.files, "ckpt_interval": config.max_steps, "keep_last": 1,
              "log_interval": 20}
    del fields["feedback"]  # the job's pairs are feedback.files
    spec = RunSpec("reward", fields, {**training_plan, "micro_batch": config.micro_batch},
                   {"sft_model": sft_model["version"], "preference_data": preference_data["version"], **feedback.inputs},
                   tokenizer["path"], init=sft_model["checkpoint"])
    with torchrun.training_run(context, spec, storage, mlflow) as job:
        if job.reused is not None:
            return job.reused
        result = job.launch()
        hf_dir = write_hf_reward(result["checkpoint"], job.out_dir / "hf")
        final = result["final_val"] or {}
        context.log.info(f"reward model: held-out accuracy {final.get('accuracy', float('nan')):.3f}, margin "
                         f"{final.get('margin', float('nan')):.3f} on {result['pairs']['val']} pairs")
        report = {**reward_report(result, job.out_dir), "hf_folder": str(hf_dir), **feedback.metadata(result)}
        return job.output(report_metadata(report, job.run), hf_dir=str(hf_dir), **feedback.record(result))


PPO_FIELDS = ("prompt_kinds", "max_steps", "max_new_tokens", "temperature", "kl_coef", "gamma", "lam", "clip_range", "value_clip",
              "ppo_epochs", "value_lr", "eval_interval", "eval_items", "seed")


class PpoModelConfig(schema_of(PpoJob, include=PPO_FIELDS, name="PpoJobFields")):
    prompts_per_step: Annotated[int, Domain(1)] = Field(default=PpoJob.micro_batch, description="Prompts per rank per rollout (the job's micro_batch).")
    optim: PpoOptim = Field(default_factory=PpoOptim, description="AdamW and its schedule for the policy.")
    lora: Lora = Field(default_factory=Lora, description="{enabled: true} trains policy adapters only.")
    init_from: str = init_from_field()


@asset(code_version="2", group_name="rlhf")
def ppo_model(context: AssetExecutionContext, config: PpoModelConfig, sft_model: dict, reward_model: dict,
              instruction_data: dict, preference_data: dict, training_plan: dict, tokenizer: dict,
              storage: KilnStorageResource, torchrun: TorchrunResource, mlflow: MlflowResource) -> Output[dict]:
    """The SFT model trained by PPO against reward_model (value model started from it, per-token KL penalty to the frozen SFT model, GAE, clipped policy and value losses) by a torchrun job; reward, KL, value loss and clip fraction over steps; held-out measures before and after."""
    start, start_key, extra = start_weights("ppo_model", config.init_from, sft_model, training_plan, tokenizer, storage)
    fields = {**config.job_fields(), "train_files": [instruction_data["path"]], "ckpt_interval": config.max_steps,
              "keep_last": 1, "log_interval": 10, "reward_model": reward_model["checkpoint"]}
    fields["micro_batch"] = fields.pop("prompts_per_step")
    del fields["init_from"]  # the job's start is RunSpec.init
    suite = heldout_suite(instruction_data, preference_data)
    spec = RunSpec("ppo", fields, {**training_plan, "micro_batch": config.prompts_per_step},
                   {**(start_key or {"sft_model": sft_model["version"]}), "reward_model": reward_model["version"],
                    "instruction_data": instruction_data["version"]},
                   tokenizer["path"], init=start["checkpoint"], reuse={"suite": suite_key(suite)})
    return align(context, spec, start, suite, storage, torchrun, mlflow, ppo_report,
                 {**extra, "reward_model": reward_model["version"]})
