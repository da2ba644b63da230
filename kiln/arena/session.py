"""One arena: its models, prompts, rounds, votes and ratings, with no web code (kiln.arena.app serves it).

``Arena(contestants, prompts, home / "arena", seed=0, tracker=...)``; ``round()`` gives the open round (a prompt,
two answers, no names), ``vote(round_id, "left")`` records the vote and reveals the names, ``ratings()`` rates.
The arena id is the hash of the models' weights digests, so restarting with the same models continues its votes.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kiln.arena.contestants import Contestant
from kiln.arena.ratings import ratings_table
from kiln.arena.votes import VOTES, VoteLog, append_line, read_lines, score_of_left
from kiln.common.files import stable_hash


@dataclass
class Round:
    id: str
    prompt: str
    left: int  # index of the contestant shown on the left (Model 1)
    right: int  # ... on the right (Model 2)
    answers: tuple[str, str]  # (left answer, right answer)
    vote: str | None = None


def arena_id(contestants: Sequence[Contestant]) -> str:
    digests = [c.weights for c in contestants]
    if len(set(digests)) < len(digests):
        same = [c.name for c in contestants if digests.count(c.weights) > 1]
        raise ValueError(f"arena: {same} load the same weights; give models that differ")
    return stable_hash(sorted(digests))[:12]


class Arena:
    """Rounds between pairs of contestants; votes in ``<root>/<arena id>/votes.jsonl``, answers cached beside them."""

    def __init__(self, contestants: Sequence[Contestant], prompts: Sequence[str], root: str | Path, seed: int = 0,
                 sampling_key: str = "", tracker_factory=None, rating_method: str = "bt", bootstrap_rounds: int = 200):
        if len(contestants) < 2:
            raise ValueError(f"arena: give at least two models, got {len(contestants)}")
        if not prompts:
            raise ValueError("arena: no prompts to show")
        self.contestants, self.prompts, self.seed = list(contestants), list(prompts), seed
        self.id = arena_id(self.contestants)
        self.dir = Path(root) / self.id
        self.log = VoteLog(self.dir / "votes.jsonl")
        self.answers_path = self.dir / "answers.jsonl"
        self.sampling_key, self.method, self.bootstrap_rounds = sampling_key, rating_method, bootstrap_rounds
        self._lock = threading.RLock()
        self._by_weights = {c.weights: i for i, c in enumerate(self.contestants)}
        self._cache = self._read_cache()
        self._history = [self._comparison(n, v) for n, v in enumerate(self.log.read(), 1)]
        self._open: Round | None = None
        self._rounds: dict[str, Round] = {}
        self._made = len(self._history)  # rounds made so far (seeds each round's draws)
        self.tracker = tracker_factory(self.id, self.contestants) if tracker_factory else None

    # -------------------------------------------------------------------------------------------- records
    def _comparison(self, n: int, vote: dict[str, Any]) -> tuple[int, int, float, str, str]:
        """(left index, right index, left's score, prompt, vote) of a recorded vote."""
        sides = []
        for side in ("left", "right"):
            i = self._by_weights.get(vote[side]["weights"])
            if i is None:
                raise ValueError(f"{self.log.path}: vote {n} names weights {vote[side]['weights']} ({vote[side]['name']}), "
                                 f"which is not one of this arena's models; move that file aside to start afresh")
            sides.append(i)
        return sides[0], sides[1], score_of_left(vote["vote"]), vote["prompt"], vote["vote"]

    def _read_cache(self) -> dict[tuple[str, str, str], str]:
        return {(r["weights"], r["sampling"], r["prompt"]): r["answer"] for _, r in read_lines(self.answers_path)}

    def answer(self, i: int, prompt: str) -> str:
        """Contestant i's answer to ``prompt``, generated once per (weights, sampling settings, prompt)."""
        c = self.contestants[i]
        key = (c.weights, self.sampling_key, prompt)
        if key not in self._cache:
            self._cache[key] = c.answer(prompt)
            append_line(self.answers_path, {"weights": c.weights, "sampling": self.sampling_key, "prompt": prompt,
                                            "model": c.name, "answer": self._cache[key]})
        return self._cache[key]

    # -------------------------------------------------------------------------------------------- rounds
    def _next_pairing(self) -> tuple[str, int, int]:
        """(prompt, left, right): the prompt and the pair with the fewest votes so far (ties drawn by a generator
        seeded by the arena seed and the round number), sides by a coin flip."""
        rng = random.Random(f"{self.seed}:{self._made}")
        per_prompt = {p: 0 for p in self.prompts}
        per_pair = {pair: 0 for pair in itertools.combinations(range(len(self.contestants)), 2)}
        for a, b, _, prompt, _ in self._history:
            per_prompt[prompt] = per_prompt.get(prompt, 0) + 1
            per_pair[tuple(sorted((a, b)))] += 1
        fewest = min(per_prompt[p] for p in self.prompts)
        prompt = rng.choice([p for p in self.prompts if per_prompt[p] == fewest])
        low = min(per_pair.values())
        pair = list(rng.choice([q for q, v in per_pair.items() if v == low]))
        rng.shuffle(pair)
        return prompt, pair[0], pair[1]

    def round(self) -> Round:
        """The open round (the same one until it is voted on, so a reload shows it again), else a new one."""
        with self._lock:
            if self._open is None:
                prompt, left, right = self._next_pairing()
                self._made += 1
                answers = (self.answer(left, prompt), self.answer(right, prompt))
                self._open = Round(uuid.uuid4().hex[:12], prompt, left, right, answers)
                self._rounds[self._open.id] = self._open
            return self._open

    def _side(self, i: int) -> dict[str, str]:
        c = self.contestants[i]
        return {"name": c.name, "path": c.path, "weights": c.weights}

    def vote(self, round_id: str, vote: str) -> dict[str, Any]:
        """Record ``vote`` on a round; returns the names of both sides and the ratings. KeyError for an unknown
        round, ValueError for a second vote on one or a vote outside VOTES."""
        if vote not in VOTES:
            raise ValueError(f"vote {vote!r}: choose one of {list(VOTES)}")
        with self._lock:
            r = self._rounds.get(round_id)
            if r is None:
                raise KeyError(f"no round {round_id!r} in this arena (the server restarted?); load the page again")
            if r.vote is not None:
                raise ValueError(f"round {round_id} has its vote ({r.vote}) already")
            record = {"arena": self.id, "round": r.id, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "prompt": r.prompt, "left": self._side(r.left), "right": self._side(r.right), "vote": vote,
                      "winner": {"left": self.contestants[r.left].name, "right": self.contestants[r.right].name}.get(vote),
                      "sampling": self.sampling_key}
            self.log.append(record)
            r.vote = vote
            self._history.append((r.left, r.right, score_of_left(vote), r.prompt, vote))
            if self._open is r:
                self._open = None
            ratings = self.ratings()
            tracking = self._track(ratings)
            return {"left": self.contestants[r.left].name, "right": self.contestants[r.right].name, "vote": vote,
                    "ratings": ratings, "tracking": tracking}

    # -------------------------------------------------------------------------------------------- ratings
    def counts(self) -> dict[str, int]:
        votes = [h[4] for h in self._history]
        return {"votes": len(votes), **{f"votes.{v}": votes.count(v) for v in VOTES}}

    def ratings(self, method: str | None = None) -> dict[str, Any]:
        """{arena, method, votes, counts, rows}: rows from kiln.arena.ratings.ratings_table, best first."""
        with self._lock:
            names = [c.name for c in self.contestants]
            comparisons = [(names[a], names[b], s) for a, b, s, _, _ in self._history]
            rows = ratings_table(names, comparisons, method or self.method, self.seed, self.bootstrap_rounds)
            return {"arena": self.id, "method": method or self.method, "votes": len(comparisons),
                    "counts": self.counts(), "rows": rows, "votes_file": str(self.log.path)}

    def _track(self, ratings: dict[str, Any]) -> str:
        """Log the counts and ratings to MLflow; 'ok', 'off', or the error (the vote is on disk either way)."""
        if self.tracker is None:
            return "off"
        try:
            self.tracker.log_vote(ratings["votes"], ratings["counts"], ratings["rows"])
            return "ok"
        except Exception as e:  # a tracking server that went away must not lose the person's vote
            return f"MLflow logging failed: {type(e).__name__}: {e}"

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
