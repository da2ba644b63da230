"""The model card from a smoke run's upstream outputs (tests/data/card_upstream.json): every task's primary score with
its standard error and chance on all and on clean items, settings as a table of what differs from the defaults, plots."""

import json
from pathlib import Path

import pytest

from kiln.release.card import CHECKPOINT_PLOT, CONFIG_FILE, LOSS_PLOT, _feedback, card_figures, model_card, settings_rows, task_score
from kiln.posttrain.measures import stage_rows
from kiln.release.records import JudgedPreferences

UPSTREAM = Path(__file__).resolve().parents[2] / "data" / "card_upstream.json"


@pytest.fixture(scope="module")
def up() -> dict:
    return json.loads(UPSTREAM.read_text())


def card(up, settings=None, figures=None) -> str:
    return model_card("kiln-test", "Apache-2.0", up, stage_rows(up["sft_model"], up["dpo_model"], up["rl_model"]),
                      settings, figures)


def evaluation_rows(text: str) -> dict[str, list[str]]:
    section = text.split("## Evaluation", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| kiln_")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


def test_every_task_has_one_row_with_its_primary_score_stderr_and_chance_on_all_and_clean_items(up):
    text = card(up)
    rows = evaluation_rows(text)
    scores = up["eval_scores"]
    assert set(rows) == set(scores["tasks"])  # the accuracy tasks too, not only the perplexity one
    for task, row in scores["tasks"].items():
        full, clean = task_score(task, row), task_score(task, scores["tasks_clean"][task])
        metric, all_items, clean_items, chance, contaminated = rows[task]
        assert metric == full["metric"]
        assert all_items.startswith(f"{full['value']:.3f}") and f"({row['items']})" in all_items
        if full["stderr"] is not None:
            assert f"± {full['stderr']:.3f}" in all_items
        assert clean_items.startswith(f"{clean['value']:.3f}")
        assert chance == ("-" if full["chance"] is None else f"{full['chance']:.2f}")
        assert contaminated == f"{row['contaminated_share']:.0%}"
    acc = {t: task_score(t, r)["value"] for t, r in scores["tasks"].items()}
    assert rows["kiln_mmlu"][0] == "acc" and rows["kiln_continuation"][0] == "acc_norm"
    assert rows["kiln_mmlu"][1].startswith(f"{acc['kiln_mmlu']:.3f} ± ")


def test_settings_are_a_table_of_what_differs_from_the_defaults_with_a_link_to_the_whole_config(up):
    config = {"clean_corpus": {"clean": {"min_words": 80, "max_words": 100000}}, "tokenizer": {"vocab_size": 512, "kind": "bpe"}}
    defaults = {"clean_corpus": {"clean": {"min_words": 50, "max_words": 100000}}, "tokenizer": {"vocab_size": 8192, "kind": "bpe"}}
    rows = settings_rows(config, defaults)
    assert rows == [{"asset": "clean_corpus", "field": "clean.min_words", "value": 80, "default": 50},
                    {"asset": "tokenizer", "field": "vocab_size", "value": 512, "default": 8192}]
    text = card(up, rows)
    assert "| clean_corpus | clean.min_words | 80 | 50 |" in text and "| tokenizer | vocab_size | 512 | 8192 |" in text
    assert f"[`{CONFIG_FILE}`]({CONFIG_FILE})" in text
    assert max(len(line) for line in text.splitlines()) < 400  # no filter settings dumped as one long JSON line
    assert "Every setting is at its default." in card(up, [])


def test_training_line_says_where_it_trained_in_words(up):
    text = card(up)
    assert "Trained on 1 CPU process: 60 steps of 1,024 tokens" in text
    assert "none on" not in text
    plan = {**up["training_plan"], "world_size": 8, "parallelism": "ddp", "hardware": {"device": "cuda", "nnodes": 1}}
    assert "Trained on 8 CUDA devices with DDP (data parallel): " in card({**up, "training_plan": plan})


def test_plots_are_images_in_the_bundle_referenced_from_the_card(up):
    figures = card_figures(up)
    # no checkpoint was scored one by one: no "scores by checkpoint" figure (it was the validation loss again)
    assert set(figures) == {LOSS_PLOT}
    assert all(png.startswith(b"\x89PNG") and len(png) > 5_000 for png in figures.values())
    assert card_figures(up) == figures  # the same outputs give the same bytes
    text = card(up, figures=figures)
    assert f"]({LOSS_PLOT})" in text and f"]({CHECKPOINT_PLOT})" not in text
    assert f"]({LOSS_PLOT})" not in card(up)


def test_post_training_shows_each_stage_change_with_its_paired_error(up):
    import copy

    up = copy.deepcopy(up)
    row = next(r for r in up["rl_model"]["before_after"] if r["measure"] == "arithmetic_exact_match")
    row.update(stderr=0.01, beyond_noise=abs(row["change"]) >= 0.02)
    text = card(up).split("## Post-training", 1)[1].split("\n## ", 1)[0]
    line = next(x for x in text.splitlines() if x.startswith("| arithmetic_exact_match |") and "±" in x)
    sft, dpo, rl = (c.strip() for c in line.strip("|").split("|")[1:])
    assert rl == f"{row['change']:+.3f} ± 0.010" + (" *" if row["beyond_noise"] else "")
    first = next(r for r in up["sft_model"]["before_after"] if r["measure"] == "arithmetic_exact_match")
    assert sft == f"{first['change']:+.3f}"  # recorded without item scores: the change alone
    assert "at least\n2 standard errors from zero" in text


def test_the_ai_feedback_section_names_the_judge_and_principles_without_machine_paths(up):
    judged = {"version": "jp1", "rule": "majority", "judge": {"family": "llama", "kind": "release bundle",
                                                               "path": "/home/someone/.kiln/storage/judge/abc123",
                                                               "params": 1_000_000, "sha256": "ab" * 8},
              "principles": {"path": "/home/someone/kiln/conf/judge/principles.md", "sha256": "cd" * 8},
              "summary": {"agreement": {"n": 40, "agreement": 0.725, "stderr": 0.07, "ties": 3},
                          "position_bias": {"checkable": 0.1}, "pairs_labelled": 120, "ties": 4}}
    text = card({**up, "judged_preferences": judged}).split("## AI feedback", 1)[1].split("\n## ", 1)[0]
    assert "`abc123` (1,000,000 parameters, sha256 `abababababababab`)" in text
    assert "principles in\n`principles.md` (sha256 `cdcdcdcdcdcdcdcd`)" in text and "/home/someone" not in text
    checkpoint_judge = {**judged, "judge": {**judged["judge"], "kind": "checkpoint"}}  # its digest is no sha256
    assert "(1,000,000 parameters, weights digest `abababababababab`)" in _feedback(JudgedPreferences.from_dict(checkpoint_judge), {})


def test_the_base_checkpoint_is_named_by_its_folders_under_the_storage_not_by_its_data_version(up):
    text = card(up)
    base = up["base_model"]
    parts = base["checkpoint"].split("/")
    assert f"Base model version `{base['version']}`: checkpoint\n`{'/'.join(parts[-4:])}` in the Kiln home's storage" in text
    assert parts[-4] == "base_model" and parts[-2] == "checkpoints" and parts[-1].startswith("step_")
    assert "Base checkpoint `" not in text and base["checkpoint"] not in text  # no machine path
