"""The manual stays true: README under 200 lines with its two commands first and its headline results table
rebuilt from docs/results/*.json, every tag the learner logs named in docs/metrics.md, and every relative
link in README.md, CHANGELOG.md, docs/ and benchmarks/README.md pointing at a file that exists; docs/README.md
indexing every manual page, a heading every 80 lines on long pages, no internal tracker numbers, and only
launcher flags that launch/run_local.sh parses."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAG = re.compile(r'f?"((?:loss|train|eval|lag|sync|actors|offpolicy|perf|buffer|wire)/[A-Za-z_/{}0-9]+)"')


def logged_tags() -> set[str]:
    """Tag names in the learner's logging code, ``{k}``-style parts written as ``<key>`` / ``<i>``."""
    tags = set()
    for path in (ROOT / "learner").glob("*.py"):
        for tag in TAG.findall(path.read_text()):
            tags.add(re.sub(r"\{i\}", "<i>", re.sub(r"\{k\}", "<key>", tag)))
    names = {"loss_policy": "policy", "value_loss": "value"}   # learner.py renames a few stats keys
    source = (ROOT / "learner" / "update_log.py").read_text()
    block = source[source.index("names = {"):source.index("}", source.index("names = {"))]
    tags |= {f"loss/{names.get(k, v)}" for k, v in re.findall(r'"(\w+)": "(\w+)"', block)}
    offpolicy = source[source.index('f"offpolicy/{k}"'):source.index("if k in stats}", source.index('f"offpolicy/{k}"'))]
    tags |= {f"offpolicy/{k}" for k in re.findall(r'"(\w+)"', offpolicy)}
    return {t for t in tags if not t.endswith("/") and "{" not in t and t != "offpolicy/<key>"}


def test_every_logged_tag_is_documented():
    page = (ROOT / "docs" / "metrics.md").read_text()
    tags = logged_tags()
    assert len(tags) > 40
    missing = sorted(t for t in tags if f"`{t}`" not in page)
    assert missing == [], f"docs/metrics.md does not name {missing}"


def test_readme_is_a_short_manual_with_the_two_commands_first():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    first = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    assert first[0].startswith("launch/run_local.sh") and first[1].startswith("launch/test.sh")


def test_relative_links_point_at_files_that_exist():
    broken = []
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md",
                 *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^(https?:|mailto:|#)", target):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_result_pages_are_rebuilt_from_their_json():
    import subprocess
    import sys
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "results.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_a_result_file_missing_its_provenance_is_refused(tmp_path):
    import json
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import results
    doc = json.loads((ROOT / "docs" / "results" / "inflight_latency.json").read_text())
    del doc["commit"]
    (tmp_path / "x.json").write_text(json.dumps(doc))
    try:
        results.build(tmp_path)
    except results.ResultError as e:
        assert "x.json: missing ['commit']" in str(e)
    else:
        raise AssertionError("a result without its commit was rendered")


def _results():
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import results
    return results


def test_readme_headline_table_is_generated_from_the_result_files():
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- results:headline -->", 1)[1].split("<!-- /results:headline -->", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| [")]
    assert 3 <= len(rows) <= 6, "the README's headline table has 3 to 6 rows"
    for row in rows:
        page = re.match(r"\| \[[^]]+\]\((docs/results/\w+\.md)\)", row).group(1)
        assert (ROOT / page).with_suffix(".json").is_file(), f"{page} has no JSON beside it"


def test_a_stale_headline_table_fails_the_check(tmp_path):
    import shutil
    results = _results()
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    args = ["--results-dir", str(tmp_path / "docs" / "results"), "--readme", str(readme)]
    readme.write_text(text)
    assert results.main(["--check", *args]) == 0
    block = text.split("<!-- results:headline -->", 1)[1].split("<!-- /results:headline -->", 1)[0]
    figure = re.search(r"\d+\.\d+×", block).group(0)
    readme.write_text(text.replace(figure, "9" + figure, 1))          # a figure typed over by hand
    assert results.main(["--check", *args]) == 1
    assert results.main(args) == 0 and readme.read_text() == text    # rebuilding restores it
    doc = tmp_path / "docs" / "results" / "vs_sb3_halfcheetah.json"
    doc.write_text(doc.read_text().replace('"train_s": 98.0', '"train_s": 198.0', 1))   # SB3's seed 1 slower
    assert results.main(["--check", *args]) == 1
    assert results.main(args) == 0 and readme.read_text() != text    # the headline follows the JSON


def test_a_readme_without_the_headline_markers_is_refused(tmp_path):
    results = _results()
    readme = tmp_path / "README.md"
    readme.write_text("# Tandem\n")
    try:
        results.build(ROOT / "docs" / "results", readme)
    except results.ResultError as e:
        assert "results:headline" in str(e)
    else:
        raise AssertionError("a README without the headline markers was accepted")


def test_no_internal_issue_numbers_where_a_user_reads():
    """What a user reads names what a measurement is ("the inference server's 3x target"), never the
    tracker's numbers ("issue 47", "done-when 3")."""
    pattern = re.compile(r"issue [0-9]+|done-when", re.I)
    hits = []
    for top in ("docs", "benchmarks", "launch", "configs", "README.md"):
        path = ROOT / top
        for f in sorted(path.rglob("*") if path.is_dir() else [path]):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".png", ".pyc"):
                for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                    if pattern.search(line):
                        hits.append(f"{f.relative_to(ROOT)}:{n}")
    assert hits == [], f"internal issue numbers in {hits}"


def _headings_and_lines(page: Path) -> tuple[int, int]:
    """Headings (lines starting with '#' outside fenced code blocks) and lines of a markdown page."""
    lines = page.read_text().splitlines()
    fenced, headings = False, 0
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            headings += 1
    return headings, len(lines)


def test_long_pages_have_a_heading_every_80_lines():
    """A page over 150 lines is read by its headings: at least one per 80 lines."""
    thin = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        headings, n = _headings_and_lines(page)
        if n > 150 and headings * 80 < n:
            thin.append(f"{page.relative_to(ROOT)}: {headings} headings in {n} lines")
    assert thin == []


def test_every_manual_page_is_in_the_index():
    """docs/README.md links every page of the manual (results pages are indexed by docs/results/README.md)."""
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.split("#")[0]).resolve() for t in re.findall(r"\]\(([^)\s]+)\)", index.read_text())}
    pages = [p for p in sorted((ROOT / "docs").rglob("*.md"))
             if p != index and (ROOT / "docs" / "results") not in p.parents]
    assert len(pages) > 10
    missing = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in linked]
    assert missing == [], f"docs/README.md does not link {missing}"


def launcher_flags() -> set[str]:
    """The options launch/run_local.sh parses: the patterns of its argument loop's case statement."""
    script = (ROOT / "launch" / "run_local.sh").read_text()
    loop = script[script.index('while [[ $# -gt 0 ]]; do'):script.index("done", script.index('while [[ $# -gt 0 ]]; do'))]
    flags = set()
    for patterns in re.findall(r"^\s*([-|\w]+)\)", loop, re.M):
        flags |= {f for f in patterns.split("|") if f.startswith("-")}
    return flags


def test_launcher_flags_in_the_manual_are_flags_the_launcher_takes():
    """Every `launch/run_local.sh --flag` in README.md and docs/ is one the script parses (its --help is the list)."""
    flags = launcher_flags()
    assert {"--config", "--actors", "--out", "--resume", "--set", "--help"} <= flags
    unknown = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text().replace("\\\n", " ")          # a command continued on the next line
        for m in re.finditer(r"run_local\.sh", text):
            rest = text[m.end():].split("\n", 1)[0]
            rest = re.split(r"`|\s#|;|&&|\s\|\s|\)\.?\s", rest, maxsplit=1)[0]   # the command ends there
            for flag in re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", rest):
                if flag not in flags:
                    unknown.append(f"{page.relative_to(ROOT)}: run_local.sh {flag}")
    assert unknown == [], f"not flags of launch/run_local.sh: {unknown}"
