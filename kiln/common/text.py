"""Text helpers shared by the filters, dedup and the cleaning stages: normalisation and stable word and n-gram hashes.

``python -c "from kiln.common.text import *; print(normalize_text('a\\u00a0b\\r\\n\\r\\n\\r\\nc'), word_hashes(['a', 'b']))"``
"""

from __future__ import annotations

import re
import unicodedata
import zlib

import numpy as np

_LINE_BREAKS = {"\x85": "\n", "\u2028": "\n", "\u2029": "\n"}
_SPACES = {chr(c): " " for c in (0x0B, 0x0C, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x202F, 0x205F, 0x3000)}
_DROPPED = {chr(c): "" for c in (*range(0, 9), *range(14, 32), 0x7F, 0x200B, 0xFEFF)}
_REPLACE = {**_LINE_BREAKS, **_SPACES, **_DROPPED}
_ODD_CHARS = re.compile("[" + "".join(re.escape(c) for c in _REPLACE) + "]")  # a regex: fast when none occur
_BLANK_RUNS = re.compile(r"\n{3,}")


def normalize_text(text: str) -> str:
    """NFC; unify line breaks and odd spaces; drop control and zero-width chars; trim lines; <=1 blank line.

    Indentation is kept so code blocks survive.
    """
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _ODD_CHARS.sub(lambda m: _REPLACE[m.group()], text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANK_RUNS.sub("\n\n", text).strip()


def word_hashes(words: list[str]) -> np.ndarray:
    """(len(words),) uint64: crc32 in the high and adler32 in the low 32 bits of each word's UTF-8 (the same in
    every process, unlike Python's salted ``hash``)."""
    data = [w.encode("utf-8", "surrogatepass") for w in words]
    high = np.fromiter(map(zlib.crc32, data), dtype=np.uint64, count=len(data))
    low = np.fromiter(map(zlib.adler32, data), dtype=np.uint64, count=len(data))
    return (high << np.uint64(32)) | low


def ngram_hashes(h: np.ndarray, n: int) -> np.ndarray:
    """(len(h) - n + 1,) uint64 rolling hashes of the n-grams of the word hashes ``h`` (wrapping arithmetic)."""
    m = len(h) - n + 1
    out = np.zeros(m, dtype=np.uint64)
    mult = np.uint64(0x100000001B3)  # FNV-64 prime: mixes the word hashes order-dependently
    for k in range(n):
        out = out * mult + h[k : k + m]
    return out
