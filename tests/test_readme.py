"""README's measured figures come from results files: every paragraph or table of README.md (outside code blocks)
that states a measured time, rate, size, ratio or interval names the results file under bench/results/ it comes
from, and every results file README names is there and says where its numbers came from (the command, commit, date
and machine lines bench/provenance.py writes), but for the older ones listed in LEGACY, written before benches
recorded that, whose figures wait to be measured again."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README = (ROOT / "README.md").read_text(encoding="utf-8")

# a measured figure: a time, a rate, a size, a speed ratio (1.46x), a share, or "±"; not a setting quoted in words
# ("waits 30 s", "every 30 s", a "95% interval"), nor a mesh size ("pp 2 x tp 2")
FIGURE = re.compile(r"(?<!waits )(?<!every )\b\d[\d,]*(?:\.\d+)?\s?(?:s|ms|min|h|tokens/s|tok/s|requests/s|items/s|GiB|"
                    r"MiB|GB|MB)(?![\w/])|\b\d+(?:\.\d+)?x\b|\b\d+(?:\.\d+)?%(?! (?:bootstrap |confidence )?interval)|±")
CITES = re.compile(r"bench/results/|\b[\w.*-]+\.(?:md|json)\b")
# results files README names that were written before benches recorded the command, commit, date and machine
LEGACY: set[str] = set()


def blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph, and of each table with the paragraph just above it (its
    caption), outside fenced code blocks and headings."""
    out, cur, fence = [], [], False

    def close():
        if cur:
            out.append((cur[0][0], " ".join(line for _, line in cur)))
            cur.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
            close()
        elif fence:
            continue
        elif line.startswith("#"):
            close()
        elif not line.strip():
            if cur and cur[-1][1].startswith("|"):
                close()
            elif cur:
                cur.append((number, ""))
        else:
            if cur and cur[-1][1] == "" and not line.startswith("|"):
                close()
            cur.append((number, line))
    close()
    return out


def named_results(text: str) -> set[str]:
    named = set(re.findall(r"bench/results/([\w.-]+\.(?:md|json))", text))
    return named | {n for n in re.findall(r"\b([\w.-]+\.(?:md|json))\b", text) if (RESULTS / n).is_file()}


def cited_files(text: str) -> list[Path]:
    """The results files a paragraph names, its patterns (``ladder_run*.md``, ``rlaif_run1.*``) expanded."""
    paths = {RESULTS / n for n in named_results(text) if (RESULTS / n).is_file()}
    for pattern in re.findall(r"\b([\w-]*\*[\w-]*\.(?:md|json)|[\w-]+\.\*)", text):
        paths |= {f for f in RESULTS.glob(pattern) if f.suffix in (".md", ".json")}
    return sorted(paths)


DECIMAL = re.compile(r"(?<![\w.])[-+]?\d[\d,]*\.\d+(?![\w.])")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
# decimals README quotes that are settings, versions or tolerances, not measurements, each with the words just
# before it in README: the figure check leaves exactly those alone
NOT_MEASURED = {("Python", "3.11"): "Python's version", ("torch", "2.13"): "torch's version",
                ("aux_loss (", "0.01"): "the aux-loss coefficient (a setting)",
                ("aux_free (", "0.001"): "the aux-free bias rate (a setting)",
                ("Q8_0 within", "0.05"): "the GGUF test's tolerance"}


def not_measured(prose: str, figure: str) -> bool:
    return any(value == figure.lstrip("+-") and re.search(re.escape(before) + r"\s*" + re.escape(value), prose)
               for before, value in NOT_MEASURED)


def in_results(figure: str, numbers: set[float]) -> bool:
    """``figure`` (a decimal as README writes it: 4.788, +1.23, 0.0346, 1,336.5) is some number of the results
    files rounded to its decimals, as itself or as a percentage (0.0123 is 1.23%)."""
    places = len(figure.split(".")[1])
    value = abs(float(figure.replace(",", "")))
    return any(abs(y - value) <= 0.5 * 10**-places + 1e-9 for x in numbers for y in (abs(x), abs(x) * 100))


def has_provenance(path: Path) -> bool:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError:
            return False
        return isinstance(data, dict) and all(data.get(k) for k in ("command", "commit", "date", "machine"))
    return all(re.search(rf"^- {k}: \S", text[:4000], re.M) for k in ("command", "commit", "date", "machine"))


def test_every_paragraph_with_a_measured_figure_names_its_results_file():
    unsourced = [f"README.md:{line}: {text[:100]}" for line, text in blocks(README)
                 if FIGURE.search(text) and not CITES.search(text)]
    assert unsourced == [], "\n".join(unsourced)


def test_every_results_file_readme_names_is_there_and_says_where_its_numbers_came_from():
    named = named_results(README)
    assert {"plan_presets.md", "fresh_clone_demo_2.md", "parity_smollm2_seed1234.md"} <= named
    missing = sorted(n for n in named if not (RESULTS / n).is_file())
    assert missing == [], f"README names results files that are not in bench/results: {missing}"
    without = sorted(n for n in named - LEGACY if not has_provenance(RESULTS / n))
    assert without == [], f"results files without the command, commit, date and machine lines: {without}"
    assert {n for n in LEGACY if has_provenance(RESULTS / n)} == set(), "measured again: take it out of LEGACY"


def test_every_decimal_figure_readme_quotes_is_in_a_results_file_its_paragraph_names():
    """A figure must come from its file: each decimal of a paragraph that names results files is one of their numbers
    (rounded as README writes it); code spans and NOT_MEASURED's settings are left out."""
    missing = []
    for line, text in blocks(README):
        files = cited_files(text)
        if not files:
            continue
        numbers = set()
        for f in files:
            for m in NUMBER.findall(f.read_text(encoding="utf-8", errors="replace")):
                try:
                    numbers.add(float(m.replace(",", "")))
                except ValueError:
                    continue
        prose = re.sub(r"`[^`]*`", "", text)
        missing += [f"README.md:{line}: {d} not in {', '.join(f.name for f in files)}" for d in DECIMAL.findall(prose)
                    if not not_measured(prose, d) and not in_results(d, numbers)]
    assert missing == [], "\n".join(missing)


def test_a_figure_is_found_rounded_or_as_a_percentage_and_patterns_are_expanded():
    assert in_results("4.788", {4.78812}) and in_results("+1.23", {0.01234}) and in_results("1.07", {1.065})
    assert not in_results("4.79", {4.78}) and not in_results("0.050", {0.0494})
    assert {f.name for f in cited_files("runs in `ladder_run*.md` and moe_seeds.md")} >= {"ladder_run1.md", "moe_seeds.md"}


def test_the_check_sees_figures_and_citations_and_leaves_settings_alone():
    assert FIGURE.search("took 18.4 s against 4.8") and FIGURE.search("1.46x faster") and FIGURE.search("0.44 ± 0.03")
    assert not FIGURE.search("waits 30 s for them, with 95% bootstrap intervals, on pp 2 x tp 2")
    (line, text), = [b for b in blocks("a\nb 3 s\n\n```\nc 4 s\n```\n\n| x | 5 s |\n") if "b 3 s" in b[1]]
    assert line == 1 and not CITES.search(text)
    assert [t for _, t in blocks("caption `bench/results/x.md`:\n\n| a | 2 s |\n")] == \
        ["caption `bench/results/x.md`:  | a | 2 s |"]
