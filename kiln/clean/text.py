"""Unicode repair of extracted text with ftfy, run only on texts that show what ftfy repairs (it is ~10x slower than
the check); normalisation itself is kiln.common.text.normalize_text.

Try: ``python -c "from kiln.clean.text import fix_unicode; print(fix_unicode('cafÃ© â€™'))"``
"""

from __future__ import annotations

import re

# What ftfy repairs shows up as a Latin-1 lead byte read as a character followed by a continuation byte or a
# cp1252 punctuation mark ("Ã©", "â€™"), terminal escapes, ligatures or lone surrogates. Only such texts are
# passed to ftfy (it runs at ~35 MB/s; the check at several hundred).
_NEEDS_FIX = re.compile(
    "[\u00c2-\u00f4][\u0080-\u00bf\u0152\u0153\u0160\u0161\u0178\u017d\u017e\u0192\u02c6\u02dc"
    "\u2013-\u2026\u2030\u2039\u203a\u20ac\u2122]|[\x1b\ufb00-\ufb06\ud800-\udfff]"
)


def needs_fix(text: str) -> bool:
    """Whether ``text`` shows something ftfy repairs; of ASCII text, only a terminal escape (ESC is ASCII)."""
    if text.isascii():
        return "\x1b" in text
    return _NEEDS_FIX.search(text) is not None


def fix_unicode(text: str) -> str:
    """ftfy's repair (mojibake, terminal escapes, ligatures, broken surrogates), typographic quotes kept."""
    import ftfy

    if not needs_fix(text):
        return text

    return ftfy.fix_text(text, ftfy.TextFixerConfig(uncurl_quotes=False, fix_character_width=False,
                                                     unescape_html=False, explain=False))
