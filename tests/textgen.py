"""Deterministic English-like documents that pass every default rule, for the cleaning tests."""

from __future__ import annotations

import random

ADJ = ("quiet green northern ancient narrow golden wooden gentle stormy bright heavy distant hidden famous early "
       "careful patient sudden silver crowded").split()
NOUNS = ("harbour village market river garden teacher doctor station window kitchen letter bridge forest "
         "mountain island castle library museum painter farmer sailor engine orchard valley tower").split()
VERBS = ("visited painted built found remembered carried opened watched repaired described measured "
         "planted crossed guarded followed").split()
PLACES = ("coast border square chapel mill quay meadow ridge canal abbey").split()


def sentence(rng: random.Random) -> str:
    return (f"{rng.choice(ADJ).capitalize()} {rng.choice(NOUNS)}s {rng.choice(VERBS)} {rng.choice(NOUNS)}s near "
            f"the {rng.choice(PLACES)} with {rng.choice(ADJ)} {rng.choice(NOUNS)}s and {rng.choice(NOUNS)}s.")


def prose(seed: int, sentences: int = 8) -> str:
    """About 13 words a sentence; two paragraphs; every default rule keeps it."""
    rng = random.Random(seed)
    lines = [sentence(rng) for _ in range(sentences)]
    half = sentences // 2
    return " ".join(lines[:half]) + "\n\n" + " ".join(lines[half:])
