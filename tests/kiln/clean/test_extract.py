"""Tests for kiln.clean.extract: boilerplate removal, titles, empty pages, the nesting depth measured before parsing.

Run: python -m pytest tests/kiln/clean/test_extract.py -q
"""

from __future__ import annotations

import pytest

from kiln.clean.extract import extract_and_title, html_depth, html_title, html_to_text, too_deep

BODY = (
    "<p>The river runs slowly through the valley, carrying silt from the mountains to the sea.</p>"
    "<p>Farmers along its banks have relied on the spring floods for thousands of years.</p>"
)
MENU = '<ul><li><a href="/">Home</a></li><li><a href="/about">About us</a></li><li><a href="/blog">Blog</a></li></ul>'

PAGE = f"""<!DOCTYPE html><html><head><title>  Rivers of
  the Valley </title><style>p {{ color: red }}</style></head><body>
<header><div class="logo">ACME Travel</div><nav>{MENU}</nav></header>
<div role="navigation"><a href="/next">Next page</a> | <a href="/prev">Previous page</a></div>
<main><article><h1>Rivers</h1>{BODY}</article></main>
<aside class="sidebar"><h3>Popular posts</h3><ul><li><a href="/p1">Ten tips for hikers</a></li></ul></aside>
<footer><nav>{MENU}</nav><p>Copyright 2024 ACME Inc. All rights reserved.</p></footer>
<script>var tracking = "pixel";</script></body></html>"""

# DocBook's navigation tables (as in the abs-guide package), which resiliparse alone keeps.
DOCBOOK = f"""<HTML><HEAD><TITLE>Arrays</TITLE></HEAD><BODY>
<DIV CLASS="NAVHEADER"><TABLE><TR><TH>Advanced Bash-Scripting Guide</TH></TR>
<TR><TD><A HREF="a.html">Prev</A></TD><TD><A HREF="b.html">Next</A></TD></TR></TABLE></DIV>
<DIV CLASS="CHAPTER"><H1>Chapter 27. Arrays</H1>{BODY}</DIV>
<DIV CLASS="NAVFOOTER"><TABLE><TR><TD><A HREF="a.html">Prev</A></TD><TD><A HREF="index.html">Home</A></TD>
<TD>List Constructs</TD></TR></TABLE></DIV></BODY></HTML>"""


def test_body_kept_and_navigation_footer_sidebar_removed() -> None:
    text = html_to_text(PAGE)
    assert "The river runs slowly through the valley, carrying silt from the mountains to the sea." in text
    assert "Farmers along its banks have relied on the spring floods for thousands of years." in text
    assert "Rivers" in text
    boilerplate_words = ("Home", "About us", "Blog", "Next page", "Popular posts", "Copyright", "ACME", "tracking", "color")
    for boilerplate in boilerplate_words:
        assert boilerplate not in text, boilerplate
    # paragraphs stay separate
    assert "sea.\n\nFarmers" in text


def test_docbook_navigation_tables_removed() -> None:
    text = html_to_text(DOCBOOK)
    assert text.startswith("Chapter 27. Arrays")
    assert "Farmers along its banks" in text
    for boilerplate in ("Prev", "Next", "Home", "Advanced Bash-Scripting Guide", "List Constructs"):
        assert boilerplate not in text, boilerplate


def test_title() -> None:
    assert html_title(PAGE) == "Rivers of the Valley"
    assert html_title(DOCBOOK) == "Arrays"
    assert html_title("<p>no head</p>") == ""
    assert extract_and_title(PAGE)[1] == "Rivers of the Valley"


def test_entities_and_empty_pages() -> None:
    assert html_to_text("<p>caf&eacute; &amp; cr&egrave;me</p>") == "café & crème"
    assert html_to_text("") == ""
    assert html_title("") == ""
    assert html_to_text(f"<html><body><nav>{MENU}</nav><script>x = 1</script></body></html>") == ""
    assert extract_and_title("   ") == ("", "")
    assert html_to_text("<p>bad \udcff byte</p>") == "bad ? byte"  # lone surrogate replaced, page kept


N = 3000  # elements per page below; the parser's own depth of each is in the comment


@pytest.mark.parametrize("page, depth", [
    (PAGE, 7), (DOCBOOK, 7),  # parser: 7, 8
    ("<body>" + "<p>para " * N, 2),  # an unclosed <p> ends at the next (parser: 3)
    ("<ul>" + "<li>item " * N + "</ul>", 2),  # so does an <li> (4)
    ("<table>" + "<tr><td>a<td>b<th>c" * N + "</table>", 3),  # and cells and rows (6)
    ("<select>" + "<option>x" * N + "</select>", 2),  # (4)
    ("<h1>a<h2>b" * N, 1),  # a heading right inside another (3)
    ("<svg>" + '<path d="M0 0"/>' * N + "</svg>", 1),  # self-closing in SVG (4)
    ("<script>" + "<div>" * N + "</script><!--" + "<div>" * N + "--><p>x</p>", 1),  # text, not tags (3)
    ("<ul><li>" * N, 2 * N),  # lists in list items do nest (6002)
    ("<span><div></span>" * N, 2 * N),  # an end tag does not close past a <div> (6002)
    ("<div/>" * N, N),  # "/>" means nothing on an HTML element (3002)
    ("<B>x" * N, N),  # unclosed formatting elements nest, upper case or not (3002)
])
def test_html_depth_is_the_parsers_within_a_few_levels(page: str, depth: int) -> None:
    assert html_depth(page) == depth


def test_too_deep_stops_early_and_counts_start_tags_first() -> None:
    page = "<div>" * 100_000
    assert html_depth(page, 512) == 513 and too_deep(page, 512)
    assert not too_deep("<br>" * 400, 512)  # fewer start tags than the limit: no scan
    assert not too_deep("<br>" * 4000 + "<div>" * 500, 512) and too_deep("<br>" * 4000 + "<div>" * 513, 512)
