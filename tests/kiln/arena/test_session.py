"""An arena with stand-in models: the open round survives a reload, answers are generated once per (model, prompt),
votes reveal names and move the ratings, a restart continues, pairs are balanced, and the web app answers only on
127.0.0.1 (served in a thread here; tests/ui/test_arena.py drives the page in a browser).

Run: python -m pytest tests/kiln/arena/test_session.py -q
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from ports import free_port

from kiln.arena.contestants import Contestant
from kiln.arena.prompts import BUILT_IN, load_prompts, read_prompts
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


def test_prompts_from_a_file_the_home_or_the_built_in_list(tmp_path):
    (tmp_path / "p.txt").write_text("one\n\ntwo\none\n")
    assert read_prompts(tmp_path / "p.txt") == ["one", "two"]
    (tmp_path / "p.yaml").write_text("prompts: [a, b]\n")
    assert read_prompts(tmp_path / "p.yaml") == ["a", "b"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "t", "split": "train"}\n{"prompt": "v", "split": "val"}\n')
    assert read_prompts(tmp_path / "p.jsonl") == ["v"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "t"}\n{"text": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: each line must be an object with a string 'prompt'"):
        read_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="no such prompts file"):
        read_prompts(tmp_path / "missing.yaml")
    home = tmp_path / "home"
    prompts, where = load_prompts(None, home)
    assert where == str(BUILT_IN) and len(prompts) >= 10
    pairs = home / "storage" / "instruction_data" / "abc" / "pairs.jsonl"
    pairs.parent.mkdir(parents=True)
    pairs.write_text('{"prompt": "held out", "split": "val"}\n{"prompt": "trained on", "split": "train"}\n')
    assert load_prompts(None, home) == (["held out"], str(pairs))


def test_each_vote_logs_counts_and_ratings_to_one_mlflow_run_per_arena(tmp_path):
    from mlflow.tracking import MlflowClient

    from kiln.arena.tracking import ArenaTracker, metric_name

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    people, _ = stand_ins()
    people[1].name = "models:/kiln-demo@candidate"
    make = lambda arena_id, members: ArenaTracker(uri, arena_id, members, tmp_path / "mlartifacts", "p.yaml")  # noqa: E731
    arena = Arena(people, PROMPTS, tmp_path / "arena", tracker_factory=make)
    for choice in ("A", "A", "tie"):
        r = arena.round()
        assert arena.vote(r.id, side_of(arena, r, choice) if choice in "AB" else choice)["tracking"] == "ok"
    arena.close()
    b = metric_name(people[1].name)
    assert b == "models_kiln-demo_candidate"
    client = MlflowClient(uri)
    run = client.get_run(arena.tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["kiln.arena_id"] == arena.id
    assert run.data.params[f"model.{b}"] == "models:/kiln-demo@candidate" and run.data.params["model.A.weights"] == "wAwAwAwA"
    assert run.data.metrics["votes"] == 3 and run.data.metrics["votes.tie"] == 1 and run.data.metrics["wins.A"] == 2
    assert run.data.metrics["rating.A"] > 1000 > run.data.metrics[f"rating.{b}"]
    assert run.data.metrics["low.A"] <= run.data.metrics["rating.A"] <= run.data.metrics["high.A"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "rating.A")] == [1, 2, 3]
    again = Arena(people, PROMPTS, tmp_path / "arena", tracker_factory=make)  # a restart reopens the same run
    assert again.tracker.run_id == arena.tracker.run_id and client.get_run(again.tracker.run_id).info.status == "RUNNING"
    again.close()


def request(url, body=None, host=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json", **({"Host": host} if host else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_app_serves_rounds_votes_and_ratings_on_127_0_0_1_only(tmp_path):
    from kiln.arena.app import bind, server

    with pytest.raises(ValueError, match="serves on 127.0.0.1 only"):
        bind("0.0.0.0", 0)
    people, _ = stand_ins()
    arena = Arena(people, PROMPTS, tmp_path, seed=2)
    sock = bind("127.0.0.1", free_port())
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv = server(arena)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.05)
        status, page = request(url + "/")
        assert status == 200 and "Model 1" in page and "Left is better" in page and "says" not in page
        status, body = request(url + "/api/round")
        rnd = json.loads(body)
        assert status == 200 and set(rnd) == {"round", "prompt", "answers", "votes"} and "A" not in body.replace("A says", "")
        assert json.loads(request(url + "/api/round")[1])["round"] == rnd["round"]  # a reload: the same round
        status, body = request(url + "/api/vote", {"round": rnd["round"], "vote": "maybe"})
        assert status == 422
        status, body = request(url + "/api/vote", {"round": rnd["round"], "vote": "left"})
        out = json.loads(body)
        assert status == 200 and out["left"] == rnd["answers"][0].split(" ")[0] and out["ratings"]["votes"] == 1
        assert request(url + "/api/vote", {"round": rnd["round"], "vote": "left"})[0] == 409
        assert request(url + "/api/vote", {"round": "gone", "vote": "left"})[0] == 404
        status, body = request(url + "/ratings?method=elo")
        assert status == 200 and json.loads(body)["method"] == "elo" and json.loads(body)["rows"][0]["model"] == out["left"]
        assert request(url + "/ratings", host="evil.example:80")[0] == 400  # a rebound DNS name is refused
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        sock.close()
    assert not thread.is_alive()


def test_a_port_in_use_is_named(tmp_path):
    from kiln.arena.app import bind

    first = bind("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(OSError, match=rf"arena: cannot listen on 127.0.0.1:{port} .*pick another --port"):
            bind("127.0.0.1", port)
    finally:
        first.close()
