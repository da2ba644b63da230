"""An arena with stand-in models: the open round survives a reload, answers are generated once per (model, prompt),
votes reveal names and move the ratings, a restart continues, pairs are balanced, and the web app answers only on
127.0.0.1 (served in a thread here; tests/ui/test_arena.py drives the page in a browser).

Run: python -m pytest tests/kiln/arena/test_session.py -q
"""

from __future__ import annotations

import json

import pytest

from kiln.arena.contestants import Contestant
from kiln.arena.session import Arena

PROMPTS = ["What is 2 + 2?", "Explain logging.", "Name a river."]


def stand_ins(n: int = 2):
    """Contestants answering '<name>: <prompt>' and counting the answers they generate."""
    calls: dict[str, int] = {}

    def answerer(name):
        def answer(prompt):
            calls[name] = calls.get(name, 0) + 1
            return f"{name} says: {prompt}"
        return answer

    names = "ABCD"[:n]
    return [Contestant(m, f"w{m}" * 4, f"/models/{m}", answerer(m)) for m in names], calls


def side_of(arena, r, name):
    return "left" if arena.contestants[r.left].name == name else "right"


def test_rounds_votes_and_a_restart(tmp_path):
    people, calls = stand_ins()
    arena = Arena(people, PROMPTS, tmp_path / "arena", seed=1)
    r = arena.round()
    assert arena.round() is r and calls == {"A": 1, "B": 1}  # a reload shows the same round, nothing regenerated
    assert r.prompt in PROMPTS and sorted(a.split(":")[0] for a in r.answers) == ["A says", "B says"]
    out = arena.vote(r.id, side_of(arena, r, "A"))
    assert {out["left"], out["right"]} == {"A", "B"} and out["tracking"] == "off"
    with pytest.raises(ValueError, match="has its vote"):
        arena.vote(r.id, "tie")
    with pytest.raises(KeyError, match="no round 'nope'"):
        arena.vote("nope", "tie")
    for choice in ("A", "A", "tie", "both_bad", "B"):
        r = arena.round()
        arena.vote(r.id, side_of(arena, r, choice) if choice in "AB" else choice)
    ratings = arena.ratings()
    rows = {row["model"]: row for row in ratings["rows"]}
    assert ratings["votes"] == 6 and ratings["counts"]["votes.tie"] == 1 and ratings["counts"]["votes.both_bad"] == 1
    assert (rows["A"]["wins"], rows["A"]["losses"], rows["A"]["ties"]) == (3, 1, 2) and rows["A"]["rating"] > rows["B"]["rating"]
    assert calls == {"A": 3, "B": 3}  # six rounds over three prompts: each answer generated once
    lines = [json.loads(x) for x in (tmp_path / "arena" / arena.id / "votes.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(v["prompt"] in PROMPTS and v["arena"] == arena.id for v in lines)
    assert {v["left"]["weights"] for v in lines} | {v["right"]["weights"] for v in lines} == {"wAwAwAwA", "wBwBwBwB"}
    again, calls2 = stand_ins()
    again[0].name = "models:/a/1"  # the same weights under another reference: the same arena, named afresh
    restarted = Arena(again, PROMPTS, tmp_path / "arena", seed=1)
    assert restarted.id == arena.id and restarted.ratings()["votes"] == 6
    assert {row["model"]: row["rating"] for row in restarted.ratings()["rows"]}["models:/a/1"] == rows["A"]["rating"]
    restarted.round()
    assert calls2 == {}  # answers come from answers.jsonl


def test_three_models_are_paired_evenly_and_bad_input_is_refused(tmp_path):
    people, _ = stand_ins(3)
    arena = Arena(people, PROMPTS, tmp_path, seed=0)
    pairs = []
    for _ in range(6):
        r = arena.round()
        pairs.append(tuple(sorted((r.left, r.right))))
        arena.vote(r.id, "left")
    assert sorted(pairs) == [(0, 1), (0, 1), (0, 2), (0, 2), (1, 2), (1, 2)]
    twins, _ = stand_ins()
    twins[1].weights = twins[0].weights
    with pytest.raises(ValueError, match=r"\['A', 'B'\] load the same weights"):
        Arena(twins, PROMPTS, tmp_path)
    with pytest.raises(ValueError, match="at least two models"):
        Arena(people[:1], PROMPTS, tmp_path)
    with pytest.raises(ValueError, match="vote 'meh'"):
        arena.vote(arena.round().id, "meh")
    stray = tmp_path / arena.id / "votes.jsonl"
    foreign = json.loads(stray.read_text().splitlines()[0])
    foreign["left"]["weights"] = "stranger"
    stray.write_text(stray.read_text() + json.dumps(foreign) + "\n")
    with pytest.raises(ValueError, match=rf"{stray}: vote 7 names weights stranger"):
        Arena(people, PROMPTS, tmp_path)
