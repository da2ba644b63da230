"""Tests of kiln/arena/app.py: the web app serves rounds, votes and ratings on 127.0.0.1 only (served in a thread here;
tests/ui/test_arena.py drives the page in a browser), and a port in use is named."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from kiln.arena.session import Arena
from ports import free_port
from tests.kiln.arena.test_session import PROMPTS, stand_ins


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
