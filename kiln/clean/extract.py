"""Main-text and title extraction from raw HTML, boilerplate (navigation, header, footer, sidebars) removed.

Used by kiln.clean.shard; try one page with
`python -c "import sys, kiln.clean.extract as e; print(e.html_to_text(open(sys.argv[1]).read()))" page.html`.

Why resiliparse (pinned `resiliparse==2.0.0`, Apache-2.0) and not hand-written rules or another library:
its Lexbor-based parser and `main_content` heuristics are what DCLM uses for Common Crawl; on real
documentation HTML here it was 17-28x faster than trafilatura 2.3.1 (27-33 MB/s against 1-2 MB/s on one
core) and kept the line breaks of code listings, which trafilatura flattened, while jusText dropped most
of the body.
We add only the selectors below, for landmarks its class-name heuristics miss.

Its extraction time grows with the square of the nesting depth and it has no limit of its own (a 1.1 MB page of
nested elements took 7 minutes), so ``html_depth`` measures the depth first with a scan of the tags, written here
because no parser offers a depth check cheaper than parsing; kiln.clean.shard skips a page deeper than its limit.
"""

from __future__ import annotations

import re

from resiliparse.extract.html2text import extract_plain_text
from resiliparse.parse.html import HTMLParserException, HTMLTree

# Boilerplate that resiliparse's main-content heuristics keep: ARIA landmark roles for site navigation,
# banner and footer, and DocBook's navigation tables (class "navheader"/"navfooter", e.g. abs-guide).
SKIP_SELECTORS = [
    '[role="navigation"]',
    '[role="banner"]',
    '[role="contentinfo"]',
    ".navheader",
    ".navfooter",
]


def _parse(html: str) -> HTMLTree | None:
    if not html:
        return None
    try:
        return HTMLTree.parse(html)
    except UnicodeEncodeError:  # lone surrogates (e.g. from surrogateescape decoding): replace them, retry
        return _parse(html.encode("utf-8", "replace").decode("utf-8"))
    except HTMLParserException:
        return None


def html_to_text(html: str) -> str:
    """Main text of an HTML page with boilerplate removed; "" when nothing is extractable."""
    return extract_and_title(html)[0]


def html_title(html: str) -> str:
    """The page's <title>, whitespace collapsed; "" when it has none."""
    tree = _parse(html)
    return " ".join((tree.title or "").split()) if tree is not None else ""


def extract_and_title(html: str) -> tuple[str, str]:
    """(main text, title) from a single parse; the clean pipeline uses this."""
    tree = _parse(html)
    if tree is None:
        return "", ""
    title = " ".join((tree.title or "").split())
    text = extract_plain_text(
        tree,
        main_content=True,  # drop nav, header, footer, sidebars and link lists
        alt_texts=False,  # image alt texts read as captions out of context
        links=False,
        list_bullets=True,
        skip_elements=SKIP_SELECTORS,
    )
    return text.strip(), title


# ---------------------------------------------------------------- nesting depth before parsing

# a comment, a raw-text element's content (tags in it are text), or a tag: (slash, name, self-closing slash); the
# page is lower-cased first. A self-closing slash matters only in SVG and MathML, so only such pages look for it.
_RAW = "script|style|textarea|title|xmp|iframe|noembed|noframes"
_SKIPPED = rf"<!--.*?(?:-->|\Z)|<(?:{_RAW})\b.*?(?:</(?:{_RAW})|\Z)"
_TAGS = re.compile(rf"{_SKIPPED}|<(/?)([a-z][^\s/>]*)()", re.S)
_TAGS_FOREIGN = re.compile(rf"{_SKIPPED}|<(/?)([a-z][^\s/>]*)(?:[^>]*(/)>)?", re.S)
VOID = frozenset("area base basefont bgsound br col embed frame hr image img input keygen link meta param source "
                 "track wbr".split())  # never have content, so never nest
# the HTML standard's "special" elements: an end tag of another element does not close one of these
_SPECIAL = VOID | frozenset("address applet article aside blockquote body button caption center colgroup dd details "
                            "dir div dl dt fieldset figcaption figure footer form frameset h1 h2 h3 h4 h5 h6 head "
                            "header hgroup html li listing main marquee menu nav noscript object ol p plaintext pre "
                            "search section select summary table tbody td template tfoot th thead tr ul".split())
_P_CLOSERS = frozenset("address article aside blockquote center details dialog dir div dl fieldset figcaption figure "
                       "footer form h1 h2 h3 h4 h5 h6 header hgroup hr main menu nav ol p pre section table ul li dd "
                       "dt".split())  # an open <p> ends where one of these starts
_HEADINGS = frozenset("h1 h2 h3 h4 h5 h6".split())  # a heading ends where another one starts right inside it
_SCOPE = frozenset("html table td th caption marquee object applet template button".split())
_LISTS = frozenset("ul ol dl table td th tr select body html".split())
_TABLE = frozenset("table tbody thead tfoot template html".split())
# start tag -> (open elements it ends, elements that stop the search for them): the implied end tags that keep the
# unclosed <li>, <td>, <option> ... of ordinary pages from counting as nesting
_IMPLIED: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "li": (frozenset({"li"}), _LISTS), "dd": (frozenset({"dd", "dt"}), _LISTS), "dt": (frozenset({"dd", "dt"}), _LISTS),
    "option": (frozenset({"option"}), frozenset({"select", "datalist", "optgroup"})),
    "optgroup": (frozenset({"option", "optgroup"}), frozenset({"select"})),
    "tr": (frozenset({"tr"}), _TABLE), "td": (frozenset({"td", "th"}), _TABLE | {"tr"}),
    "th": (frozenset({"td", "th"}), _TABLE | {"tr"}), "a": (frozenset({"a"}), _SCOPE),
    **dict.fromkeys(("tbody", "thead", "tfoot"), (frozenset({"tbody", "thead", "tfoot"}), frozenset({"table"}))),
}
_WALK = 64  # open elements searched for an implied end (one further down stays open: the depth is over-counted)


class _OpenElements:
    """The stack of open elements as far as a scan of the tags can tell it, with a count per tag name."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.count: dict[str, int] = {}

    def find(self, targets: frozenset[str] | tuple[str, ...], stops: frozenset[str], walk: int = _WALK) -> int:
        """Index of the nearest open element in ``targets`` with none of ``stops`` above it, else -1."""
        names = self.names
        for i in range(len(names) - 1, max(len(names) - walk, 0) - 1, -1):
            if names[i] in targets:
                return i
            if names[i] in stops:
                break
        return -1

    def pop_to(self, i: int) -> None:
        for name in self.names[i:]:
            self.count[name] -= 1
        del self.names[i:]

    def open(self, name: str) -> None:
        if name in _IMPLIED:
            targets, stops = _IMPLIED[name]
            if any(self.count.get(t) for t in targets) and (i := self.find(targets, stops)) >= 0:
                self.pop_to(i)
        if name in _P_CLOSERS and self.count.get("p") and (i := self.find(("p",), _SCOPE)) >= 0:
            self.pop_to(i)
        if name in _HEADINGS and self.names and self.names[-1] in _HEADINGS:
            self.pop_to(len(self.names) - 1)
        self.names.append(name)
        self.count[name] = self.count.get(name, 0) + 1

    def close(self, name: str) -> None:
        """An end tag: a special element's closes it and all above it (the search costs what the pops do); another
        one's closes the nearest of its name unless a special element is above it, else it is ignored."""
        if self.count.get(name):
            special = name in _SPECIAL
            i = self.find((name,), frozenset() if special else _SPECIAL, len(self.names) if special else _WALK)
            if i >= 0:
                self.pop_to(i)


def html_depth(html: str, stop_above: int | None = None) -> int:
    """How deeply the page's elements nest, from its tags alone, without parsing (about 15 MB/s); the scan stops
    once the depth exceeds ``stop_above``. Within a few levels of the parser's depth on ordinary pages (the
    abs-guide pages: 7-17 against 8-20); an unclosed element without an implied end counts as still open."""
    html = html.lower()
    tags = _TAGS_FOREIGN if "<svg" in html or "<math" in html else _TAGS
    stack, deepest = _OpenElements(), 0
    for slash, name, self_closing in tags.findall(html):
        if not name or name in VOID:
            continue
        if slash:
            stack.close(name)
            continue
        if self_closing and (stack.count.get("svg") or stack.count.get("math")):
            continue  # <path/> in SVG or MathML has no content
        stack.open(name)
        if len(stack.names) > deepest:
            deepest = len(stack.names)
            if stop_above is not None and deepest > stop_above:
                break
    return deepest


def too_deep(html: str, max_depth: int) -> bool:
    """Whether the page nests deeper than ``max_depth`` (``html_depth``; a page with fewer start tags is not)."""
    if html.count("<") - html.count("</") <= max_depth:  # C-speed bound: depth <= start tags
        return False
    return html_depth(html, max_depth) > max_depth
