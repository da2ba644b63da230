"""Tests for kiln.posttrain.judge: a hand-built judge whose verdict is a known function of its input, both orders,
ties, agreement, the principles schema, the labelled file's format, and loading a judge from each kind of folder.

Run: python -m pytest -q tests/kiln/posttrain/test_judge.py   (tiny models, CPU, seconds)
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch

from kiln.common.config import ConfigError
from kiln.model.config import ModelConfig, model_dict
from kiln.model.families import build_model
from kiln.posttrain import judge as kj
from kiln.posttrain.dpo import encode_preferences
from kiln.posttrain.instructions import write_jsonl
from kiln.posttrain.preferences import build_preferences
from kiln.posttrain.sft import read_pairs

ROOT = Path(__file__).resolve().parents[3]
PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MARKER = "@"  # the token whose share of the context the hand-built judge's yes - no logit grows with
THETA = 0.05  # its verdict logit is negative below this (scaled) share
EPS = 1e-5  # RMSNorm epsilon of the tiny model


def byte_encoding() -> tiktoken.Encoding:
    """One token per byte, plus Kiln's chat tokens (so the judge wraps its template in the chat layout)."""
    ranks = {bytes([i]): i for i in range(256)}
    return tiktoken.Encoding(name="bytes", pat_str=PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 256, "<|user|>": 257, "<|assistant|>": 258})


def counting_model() -> torch.nn.Module:
    """A one-block llama whose log p("Y") - log p("N") after a row is a known function of the marker's share k/T.

    Every token embeds as e0 except the marker (e1), all of norm 1, so the first RMSNorm scales each to norm 2.
    Queries are zero, so attention is uniform over the T positions the last one sees; values keep only the marker
    coordinate and the output projection is the identity, so attention adds (k/T) * 2 e1 to the last position; the
    MLP's down projection is zero. The last token (<|assistant|>) embeds as e0, so the final RMSNorm sees
    [1, m] with m = 2k/T (scaled by the norm's epsilon), and the head's "Y" row is [-THETA, 1]: the verdict logit is
    (m - THETA) / rms([1, m, 0, 0]) (see expected_logit)."""
    cfg = ModelConfig(family="llama", vocab_size=260, block_size=512, n_layer=1, n_head=1, n_kv_head=1, n_embd=4,
                      intermediate_size=4, tie_embeddings=False)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        block = model.model.layers[0]
        block.input_layernorm.weight.fill_(1.0)
        block.post_attention_layernorm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight  # (V, C)
        emb[:, 0] = 1.0
        emb[ord(MARKER)] = torch.tensor([0.0, 1.0, 0.0, 0.0])
        block.self_attn.v_proj.weight[1, 1] = 1.0
        block.self_attn.o_proj.weight.copy_(torch.eye(4))
        model.lm_head.weight[ord("Y")] = torch.tensor([-THETA, 1.0, 0.0, 0.0])  # "N" stays zero
    return model.eval()


def expected_logit(text_len: int, markers: int) -> float:
    """The counting model's yes - no logit for a row of ``text_len`` bytes between <|user|> and <|assistant|>."""
    T = text_len + 2
    m = (markers / T) / math.sqrt(0.25 + EPS)  # the attended marker coordinate
    return (m - THETA) / math.sqrt((1.0 + m * m) / 4 + EPS)


PRINCIPLES = kj.Principles(principles=[kj.Principle("clear", "The answer is clear.", 1.0),
                                       kj.Principle("short", "The answer is short and to the point.", 0.5)])


def expected_score(question: str, answer: str) -> float:
    """The weighted sum over PRINCIPLES of expected_logit for the yes_no template, computed by hand."""
    total = 0.0
    for p in PRINCIPLES.principles:
        text = kj.RULES["yes_no"].template.format(principle=p.text, question=question, answer=answer)
        total += p.weight * expected_logit(len(text.encode()), answer.count(MARKER))
    return total


@pytest.fixture(scope="module")
def judge() -> kj.Judge:
    return kj.Judge(counting_model(), byte_encoding(), {"path": "counting"})


PAIRS = [("What is 2 + 2?", "@@@ four", "four"), ("Name a shell.", "bash", "@ bash"),
         ("Explain pipes.", "@ a pipe joins two commands", "@@ pipes"), ("Why?", "because @", "because @ so"),
         ("What is 7 - 3?", "it is 4", "it is 4 @@@@")]


def test_the_judge_prefers_what_its_known_function_prefers(judge):
    pairs = [{"prompt": q, "a": a, "b": b} for q, a, b in PAIRS]
    verdicts = kj.judge_pairs(judge, PRINCIPLES, pairs, "yes_no", tie_margin=1e-6)
    margins = [expected_score(q, a) - expected_score(q, b) for q, a, b in PAIRS]
    assert [v["margin"] for v in verdicts] == pytest.approx(margins, abs=1e-5)
    assert [v["verdict"] for v in verdicts] == ["a" if m > 0 else "b" for m in margins]
    assert [v["verdict"] for v in verdicts] == ["a", "b", "b", "a", "b"]  # more markers per token wins


def test_swapping_the_order_gives_the_mirrored_verdict(judge):
    pairs = [{"prompt": q, "a": a, "b": b} for q, a, b in PAIRS]
    swapped = [{"prompt": q, "a": b, "b": a} for q, a, b in PAIRS]
    one, two = (kj.judge_pairs(judge, PRINCIPLES, p, "yes_no") for p in (pairs, swapped))
    mirror = {"a": "b", "b": "a", "tie": "tie"}
    assert [mirror[v["verdict"]] for v in one] == [v["verdict"] for v in two]
    assert [v["margin"] for v in one] == pytest.approx([-v["margin"] for v in two], abs=1e-6)
    assert not any(v["flipped"] for v in one + two) and kj.position_bias(one) == 0.0


def test_equal_answers_under_the_known_function_are_ties(judge):
    pairs = [{"prompt": "Say it.", "a": "x@y", "b": "xy@"}, {"prompt": "Say it.", "a": "no", "b": "on"},
             {"prompt": "Say it.", "a": "@@", "b": "@"}]
    verdicts = kj.judge_pairs(judge, PRINCIPLES, pairs, "yes_no", tie_margin=1e-5)
    assert [v["verdict"] for v in verdicts] == ["tie", "tie", "a"]
    assert abs(verdicts[0]["margin"]) <= 1e-5
    assert verdicts[2]["margin"] == pytest.approx(expected_score("Say it.", "@@") - expected_score("Say it.", "@"), abs=1e-6)
    assert kj.labelled_rows([{**p, "row": {"id": "r", "prompt": p["prompt"], "kind": "k", "split": "train",
                                           "source_id": "s"}} for p in pairs], verdicts)[0]["chosen"] == "@@"


def test_a_judge_blind_to_order_is_fully_position_biased_and_ties_when_both_orders_are_combined(judge):
    """The counting model sees a bag of tokens: with both answers shown (compare), swapping them changes nothing,
    so each order prefers whichever answer is first; the two orders cancel to a tie."""
    pairs = [{"prompt": q, "a": a, "b": b} for q, a, b in PAIRS]
    verdicts = kj.judge_pairs(judge, PRINCIPLES, pairs, "compare", tie_margin=1e-5)
    assert [v["ab"] for v in verdicts] == pytest.approx([v["ba"] for v in verdicts], abs=1e-6)
    assert all(v["verdict"] == "tie" for v in verdicts)
    assert kj.position_bias(verdicts) == 1.0  # every ab > 0: each order alone says "the first one"


def test_agreement_on_a_set_whose_truth_is_known(judge):
    verdicts = [{"verdict": v} for v in ("a", "a", "b", "tie", "b")]
    got = kj.agreement(verdicts, ["a", "b", "b", "a", "a"])
    scores = np.array([1.0, 0.0, 1.0, 0.5, 0.0])
    assert got == {"agreement": pytest.approx(0.5), "stderr": pytest.approx(scores.std() / math.sqrt(5)), "n": 5, "ties": 1}
    # preference rows whose chosen answer carries more markers: the judge agrees with every one, whichever side
    # the seeded coin shows it on; rows built the other way round it gets all wrong
    rows = [{"prompt": q, "chosen": a, "rejected": b} for q, a, b in PAIRS if expected_score(q, a) > expected_score(q, b)]
    rows += [{"prompt": q, "chosen": b, "rejected": a} for q, a, b in PAIRS if expected_score(q, a) < expected_score(q, b)]
    checks = kj.checkable_pairs(rows, 10, seed=3)
    assert {c["truth"] for c in checks} == {"a", "b"}  # both sides used
    assert kj.agreement(kj.judge_pairs(judge, PRINCIPLES, checks), [c["truth"] for c in checks])["agreement"] == 1.0
    flipped = [{"prompt": r["prompt"], "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows]
    checks = kj.checkable_pairs(flipped, 10, seed=3)
    assert kj.agreement(kj.judge_pairs(judge, PRINCIPLES, checks), [c["truth"] for c in checks])["agreement"] == 0.0


def test_only_two_logits_are_computed_and_they_match_the_full_head():
    torch.manual_seed(0)
    model = build_model(ModelConfig(family="llama", vocab_size=260, block_size=64, n_layer=2, n_head=2, n_embd=16))
    j = kj.Judge(model.eval(), byte_encoding(), {})
    rows = [[257, 72, 105, 258], [257, 65, 258], [257, 1, 2, 3, 4, 5, 6, 258]]
    got = kj.verdict_logits(j, rows, 89, 78, batch_size=2)
    with torch.no_grad():
        full = [torch.log_softmax(model(torch.tensor([r]))[0, -1], -1) for r in rows]
    assert got == pytest.approx([float(f[89] - f[78]) for f in full], abs=1e-5)
    assert isinstance(model.lm_head, torch.nn.Linear)  # the head is put back


def test_long_answers_are_cut_to_fit_and_the_principle_is_kept():
    enc = byte_encoding()
    ids = kj.render_ids(enc, kj.RULES["compare"].template, "Be kind.", {"question": "q" * 50, "first": "a" * 500,
                                                                         "second": "b" * 20}, max_len=200)
    text = enc.decode(ids[1:-1])
    room = 200 - (len(ids) - 20 - text.count("a") - text.count("q"))  # what the template and principle leave
    # the question keeps a quarter of the room; the long answer is cut to what is left; the short one is whole
    assert len(ids) == 200 and "Principle: Be kind." in text and "b" * 20 + "\n" in text
    assert text.count("q") == room // 4 and text.count("a") == room - room // 4 - 20
    assert ids[0] == 257 and ids[-1] == 258  # the chat layout
    with pytest.raises(ConfigError, match="no room for the answer"):
        kj.render_ids(enc, kj.RULES["yes_no"].template, "x" * 200, {"question": "q", "answer": "a"}, max_len=100)


def test_the_bundled_principles_file_loads():
    p = kj.read_principles(ROOT / "conf" / "judge" / "principles.yaml")
    assert [x.name for x in p.principles] == ["correct_arithmetic", "answers_the_question", "on_topic", "concise",
                                              "no_repetition"]
    assert all(x.weight > 0 and x.text for x in p.principles) and (p.yes_word, p.no_word) == ("Yes", "No")
    assert len(kj.file_sha256(ROOT / "conf" / "judge" / "principles.yaml")) == 64


@pytest.mark.parametrize("text, match", [
    ("principles: [{name: a, text: b}]\nyes_wrd: Y\n", r"p\.yaml: unknown key 'yes_wrd'\. Did you mean 'yes_word'"),
    ("principles:\n  - {name: a, text: b}\n  - {name: c, txt: d}\n", r"p\.yaml: principles\[1\]: unknown key 'txt'"),
    ("principles: [{name: a, text: b, weight: 0}]\n", r"principles\[0\]\.weight must be > 0"),
    ("principles: [{name: a, text: b}, {name: a, text: c}]\n", "names must be unique"),
    ("principles: []\n", "non-empty list"),
    ("yes: Y\nprinciples: [{name: a, text: b}]\n", "string keys.*booleans"),
    ("principles: [{name: a, text: b}]\nyes_word: 'Yes'\nno_word: ' Yes'\n", "two different words"),
])
def test_a_bad_principles_file_is_an_error_naming_the_file_and_key(tmp_path, text, match):
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(ConfigError, match=match):
        kj.read_principles(tmp_path / "p.yaml")


def test_labelled_rows_have_preference_datas_format_and_train_dpo(tmp_path):
    pairs_in = [{"id": f"i{n}", "prompt": f"What is {n} + 1?", "response": f"{n} + 1 = {n + 1}.", "kind": "arithmetic",
                 "source_id": "arithmetic/0", "answer": str(n + 1), "split": "train"} for n in range(4)]
    prefs = build_preferences(pairs_in)
    pairs = [{"prompt": p["prompt"], "a": p["chosen"], "b": p["rejected"], "row": p} for p in prefs]
    verdicts = [{"verdict": v, "margin": m} for v, m in (("a", 1.5), ("b", -0.25), ("tie", 0.0), ("a", 0.1))]
    rows = kj.labelled_rows(pairs, verdicts)
    assert len(rows) == 3  # the tie is left out
    keys = {"id", "prompt", "kind", "split", "source_id", "chosen", "rejected", "error"}  # every preference row's
    assert keys <= set.intersection(*(set(p) for p in prefs))
    assert all(keys <= set(r) for r in rows) and {r["error"] for r in rows} == {"judge"}
    assert rows[1]["chosen"] == prefs[1]["rejected"] and rows[1]["judge_margin"] == 0.25
    write_jsonl(rows, tmp_path / "preferences.jsonl")
    back = read_pairs(tmp_path / "preferences.jsonl", "train")
    assert back == rows
    tokens, mask = encode_preferences(byte_encoding(), back, 64)  # what the DPO stage reads
    assert tokens.shape[:2] == (3, 2) and mask.sum() > 0


def save_counting_checkpoint(folder: Path) -> Path:
    from kiln.tokens.tokenizer import save_encoding
    from kiln.train.checkpoint import save_checkpoint, weights_digest

    model = counting_model()
    save_encoding(byte_encoding(), folder / "tokenizer.json")
    state = model.state_dict()
    meta = {"model": model_dict(model.config), "task": "sft", "val_loss": None, "weights_digest": weights_digest(state)}
    return save_checkpoint(folder / "checkpoints", 5, {"model": state}, meta,
                           extra_files={"tokenizer.json": folder / "tokenizer.json"}, keep_last=1)


def test_a_judge_loads_from_a_checkpoint_and_a_release_bundle(tmp_path, judge):
    from kiln.release.bundle import write_release

    ckpt = save_counting_checkpoint(tmp_path / "run")
    pairs = [{"prompt": q, "a": a, "b": b} for q, a, b in PAIRS]
    want = [v["margin"] for v in kj.judge_pairs(judge, PRINCIPLES, pairs)]
    loaded = kj.load_judge(tmp_path / "run")  # a run folder resolves to its checkpoint
    assert loaded.identity["kind"] == "checkpoint" and loaded.identity["path"] == str(ckpt.resolve())
    assert loaded.identity["family"] == "llama" and loaded.identity["params"] == 260 * 4 * 2 + 4 * 4 * 4 + 3 * 16 + 12
    assert loaded.identity["sha256"] == kj.judge_fingerprint(ckpt)["sha256"]
    assert [v["margin"] for v in kj.judge_pairs(loaded, PRINCIPLES, pairs)] == pytest.approx(want, abs=1e-6)
    write_release(ckpt, tmp_path / "bundle", "# card\n")
    bundle = kj.load_judge(tmp_path / "bundle")
    assert bundle.identity["kind"] == "release"
    assert bundle.identity["sha256"] == kj.file_sha256(tmp_path / "bundle" / "SHA256SUMS")
    assert [v["margin"] for v in kj.judge_pairs(bundle, PRINCIPLES, pairs)] == pytest.approx(want, abs=1e-5)


def test_a_judge_loads_from_a_hugging_face_folder(tmp_path):
    from hfmodels import save_tiny  # tests/ is on the path (tests/conftest.py)
    from kiln.pretrained.source import folder_hash

    folder = save_tiny(tmp_path / "hf", "llama")
    j = kj.load_judge(folder)
    assert j.identity["kind"] == "hf_folder" and j.identity["sha256"] == folder_hash(folder)
    assert j.identity["family"] == "llama" and j.identity["params"] == sum(p.numel() for p in j.model.parameters())
    yes, no = kj.answer_tokens(j.enc, kj.read_principles(ROOT / "conf" / "judge" / "short.yaml"))
    rows = [j.enc.encode_ordinary("the model reads text"), j.enc.encode_ordinary("tokens")]
    with torch.no_grad():
        full = [torch.log_softmax(j.model(torch.tensor([r]))[0, -1], -1) for r in rows]
    assert kj.verdict_logits(j, rows, yes, no) == pytest.approx([float(f[yes] - f[no]) for f in full], abs=1e-5)


def test_a_missing_judge_or_rule_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="judged_preferences.judge: .*does not exist"):
        kj.load_judge(tmp_path / "nowhere", where="judged_preferences.judge")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a Hugging Face folder, a release bundle or a Kiln checkpoint"):
        kj.judge_fingerprint(tmp_path / "empty")
    with pytest.raises(ConfigError, match="unknown scoring rule 'best'.*compare"):
        kj.rule_of("best", "judged_preferences.rule")


def test_sampled_candidates_are_seeded_and_identical_pairs_skipped():
    torch.manual_seed(0)
    model = build_model(ModelConfig(family="llama", vocab_size=260, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    enc = byte_encoding()
    prompts = ["What is 1 + 1?", "Name a tool."]
    one = kj.sample_candidates(model, enc, prompts, 3, 6, 1.0, seed=4)
    assert one == kj.sample_candidates(model, enc, prompts, 3, 6, 1.0, seed=4)
    assert [len(c) for c in one] == [3, 3]
    rows = [{"prompt": p} for p in prompts]
    pairs, same = kj.candidate_pairs(rows, [["x", "x", "y"], ["u", "v", "w"]])
    assert same == 1 and [(p["a"], p["b"]) for p in pairs] == [("x", "y"), ("x", "y"), ("u", "v"), ("u", "w"), ("v", "w")]
