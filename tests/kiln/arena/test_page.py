"""Tests for kiln.arena.page: the arena's page is one self-contained HTML document (nothing loaded from elsewhere),
every element its script reaches exists once, its vote buttons are the votes the arena takes, and every field its
script reads is in what the app's /api/round and /api/vote answer (the app's own route functions over stand-in models).
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

from kiln.arena.page import PAGE
from kiln.arena.votes import VOTES
from tests.kiln.arena.test_session import PROMPTS, stand_ins

SCRIPT = PAGE[PAGE.index("<script>"):PAGE.index("</script>")]


class Elements(HTMLParser):
    """Every start tag of a page with its attributes, and the doctype."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.doctype = ""

    def handle_decl(self, decl: str) -> None:
        self.doctype = decl

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def parsed() -> Elements:
    page = Elements()
    page.feed(PAGE)
    page.close()
    return page


def read_fields(name: str) -> set[str]:
    """The properties the script reads of its variable ``name`` (``round.prompt`` -> "prompt")."""
    return set(re.findall(rf"\b{name}\.(\w+)", SCRIPT)) - {"toFixed"}


def test_the_page_is_one_document_that_loads_nothing_from_elsewhere():
    page = parsed()
    assert page.doctype == "doctype html" and PAGE.rstrip().endswith("</html>")
    assert [t for t, _ in page.tags][:4] == ["html", "head", "meta", "title"]
    assert not [(t, a) for t, a in page.tags if {"src", "href", "action"} & set(a)]
    assert not {"link", "img", "iframe", "form"} & {t for t, _ in page.tags}
    assert "http" not in PAGE and "//" not in PAGE  # no address, not even a protocol-relative one
    assert re.findall(r'fetch\("([^"]+)"', SCRIPT) == ["/api/round", "/api/vote"]


def test_every_element_the_script_reaches_is_on_the_page_once():
    ids = [a["id"] for _, a in parsed().tags if "id" in a]
    assert len(ids) == len(set(ids))
    named = set(re.findall(r'\$\("([\w-]+)"\)', SCRIPT))
    named |= {prefix + side for prefix in re.findall(r'\$\("([\w-]+-)" \+', SCRIPT) for side in ("left", "right")}
    named |= set(re.findall(r'querySelector(?:All)?\("#([\w-]+)', SCRIPT))
    assert {"prompt", "count", "status", "after", "next", "method", "name-left", "box-right", "answer-left",
            "buttons", "ratings"} <= named
    assert named <= set(ids)


def test_the_vote_buttons_are_the_votes_the_arena_takes():
    buttons = [a for t, a in parsed().tags if t == "button" and "data-vote" in a]
    assert sorted(b["data-vote"] for b in buttons) == sorted(VOTES)
    assert all(b["id"] == f"vote-{b['data-vote']}" for b in buttons)
    assert [b["data-vote"] for b in buttons] == ["left", "tie", "both_bad", "right"]  # left to right on the page


def test_the_fields_the_script_reads_are_in_the_apps_answers(tmp_path):
    from kiln.arena.app import VoteBody, make_app
    from kiln.arena.session import Arena

    people, _ = stand_ins()
    app = make_app(Arena(people, PROMPTS, tmp_path, seed=3))
    routes = {(r.path, m): r.endpoint for r in app.routes if hasattr(r, "methods") for m in r.methods}
    assert routes[("/", "GET")]() == PAGE
    current = routes[("/api/round", "GET")]()
    assert read_fields("round") == {"round", "prompt", "answers", "votes"} <= set(current)
    assert len(current["answers"]) == 2  # answers[0] on the left, answers[1] on the right
    out = routes[("/api/vote", "POST")](VoteBody(round=current["round"], vote="left"))
    assert read_fields("out") == {"left", "right", "ratings", "tracking"} <= set(out)
    assert out["tracking"] == "off"  # the page shows the tracking state only when it is neither "ok" nor "off"
    assert read_fields("ratings") == {"method", "votes", "rows"} <= set(out["ratings"])
    assert out["ratings"]["method"] in ("bt", "elo")
    fields = read_fields("row")
    assert fields == {"model", "rating", "low", "high", "votes", "wins", "losses", "ties"}
    assert all(fields <= set(row) for row in out["ratings"]["rows"]) and len(out["ratings"]["rows"]) == 2
