"""Rebuild the result pages in docs/results/, and README.md's headline table, from the JSON files in docs/results/.

    .venv/bin/python benchmarks/results.py            # rewrite docs/results/*.md, the index and README's headline table
    .venv/bin/python benchmarks/results.py --check    # exit 1 if a page or the headline table differs from the JSON

A result file ``docs/results/<name>.json`` holds the measurement and where it came from; the page
``<name>.md`` is rendered from it and never edited by hand::

    {"title": "...", "question": "what the measurement answers",
     "date": "2026-11-24", "machine": "2-core VM, no GPU (details)", "command": "python benchmarks/...",
     "commit": "e066296", "source": "where the records were taken from",
     "records": [{"setting": "step", "seed": 1, "mean_lag": 2.27, ...}, ...],
     "group_by": ["setting"],
     "columns": [{"key": "mean_lag", "label": "mean lag", "agg": "mean_sd", "fmt": ".2f"}, ...],
     "ratios": [{"label": "...", "numerator": {"setting": "rollout"}, "denominator": {"setting": "step"},
                 "key": "mean_lag", "agg": "mean"}],
     "notes": ["..."],
     "headline": [{"rank": 1, "label": "...", "text": "{0} fresher data at {1} the speed",
                   "values": [{"ratio": "<a ratio's label>"}, {"match": {...}, "key": "sps", "agg": "mean", "fmt": ".0f"}]}]}

Rows are the records grouped by ``group_by`` (in first-seen order); each column aggregates its key
over a group: ``mean_sd`` (mean ± sample std), ``mean``, ``median``, ``min``, ``max``, ``count``,
``first`` or ``list`` (every value, `` / ``-separated). A record may hold ``null`` for a key it has no
figure for; aggregates skip it, and a cell with none is ``–``. Ratios divide one group's mean (or
median) by another's, so a table states its comparison too (``"as": "percent"`` shows one in %). ``headline`` entries become rows of the
table between ``<!-- results:headline -->`` and ``<!-- /results:headline -->`` in README.md, each
value computed from the records (a spec's ``scale`` multiplies it), ranked by ``rank``, linked to its page with its machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
README = ROOT / "README.md"
REQUIRED = ("title", "question", "date", "machine", "command", "commit", "records", "group_by", "columns")
AGGREGATES = ("mean_sd", "mean", "median", "min", "max", "count", "first", "list")
BEGIN, END = "<!-- results:headline -->", "<!-- /results:headline -->"


class ResultError(ValueError):
    """A result file that cannot be rendered; the message names the file and the key."""


def _check(doc: dict, where: str) -> None:
    missing = [k for k in REQUIRED if k not in doc]
    if missing:
        raise ResultError(f"{where}: missing {missing}")
    if not isinstance(doc["records"], list) or not doc["records"] or not all(isinstance(r, dict) for r in doc["records"]):
        raise ResultError(f"{where}: records must be a non-empty list of objects")
    for i, col in enumerate(doc["columns"]):
        if col.get("agg", "first") not in AGGREGATES:
            raise ResultError(f"{where}: columns[{i}].agg {col.get('agg')!r} is not one of {AGGREGATES}")
        absent = [j for j, r in enumerate(doc["records"]) if col["key"] not in r]
        if absent:
            raise ResultError(f"{where}: columns[{i}].key {col['key']!r} is missing from records {absent[:5]}")


def _groups(doc: dict) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for record in doc["records"]:
        groups.setdefault(tuple(record.get(k) for k in doc["group_by"]), []).append(record)
    return groups


def _aggregate(values: list, agg: str):
    if agg == "median":
        return statistics.median(values)
    if agg in ("min", "max"):
        return (min if agg == "min" else max)(values)
    return statistics.fmean(values)


def _cell(values: list, agg: str, fmt: str) -> str:
    if agg == "count":
        return str(sum(v is not None for v in values))
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    f = (lambda x: format(x, fmt)) if fmt else str
    if agg == "first":
        return f(values[0])
    if agg == "list":
        return " / ".join(f(v) for v in values)
    if agg == "mean_sd" and len(values) > 1:
        return f"{f(statistics.fmean(values))} ± {f(statistics.stdev(values))}"
    return f(_aggregate(values, "mean" if agg == "mean_sd" else agg))


def _of(doc: dict, match: dict, key: str, agg: str, where: str) -> float:
    values = [r[key] for r in doc["records"] if all(r.get(k) == v for k, v in match.items()) and r.get(key) is not None]
    if not values:
        raise ResultError(f"{where}: no record matches {match} with a value for {key!r}")
    return _aggregate(values, agg)


def _ratio(doc: dict, r: dict, where: str) -> float:
    agg = r.get("agg", "mean")
    return _of(doc, r["numerator"], r["key"], agg, where) / _of(doc, r["denominator"], r["key"], agg, where)


def _show_ratio(value: float, ratio: dict, fmt: str) -> str:
    """A ratio as ``0.740×``, or with ``"as": "percent"`` as ``0.23 %``."""
    return f"{100 * value:.2f} %" if ratio.get("as") == "percent" else f"{value:{fmt}}×"


def render(doc: dict, where: str) -> str:
    """The markdown page of one result file."""
    _check(doc, where)
    lines = [f"# {doc['title']}", "",
             f"<!-- Generated by benchmarks/results.py from {Path(where).name}: do not edit by hand. -->", "",
             doc["question"], "",
             "| | |", "|---|---|",
             f"| date | {doc['date']} |", f"| machine | {doc['machine']} |", f"| command | `{doc['command']}` |",
             f"| commit | `{doc['commit']}` |"]
    if doc.get("source"):
        lines.append(f"| data | {doc['source']} |")
    lines += ["", "| " + " | ".join([*doc["group_by"], "n", *(c["label"] for c in doc["columns"])]) + " |",
              "|" + "---|" * (len(doc["group_by"]) + 1 + len(doc["columns"]))]
    for key, records in _groups(doc).items():
        cells = ["" if k is None else str(k) for k in key] + [str(len(records))]
        cells += [_cell([r[c["key"]] for r in records], c.get("agg", "first"), c.get("fmt", "")) for c in doc["columns"]]
        lines.append("| " + " | ".join(cells) + " |")
    if doc.get("ratios"):
        lines += ["", "| ratio | value |", "|---|---|"]
        for r in doc["ratios"]:
            lines.append(f"| {r['label']} | {_show_ratio(_ratio(doc, r, where), r, '.3f')} |")
    if doc.get("notes"):
        lines += [""] + [f"- {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


def _headline_value(doc: dict, spec: dict, where: str) -> str:
    if "ratio" in spec:
        ratios = [r for r in doc.get("ratios", []) if r["label"] == spec["ratio"]]
        if not ratios:
            raise ResultError(f"{where}: headline names no ratio {spec['ratio']!r}")
        return _show_ratio(_ratio(doc, ratios[0], where), ratios[0], spec.get("fmt", ".2f"))
    if spec.get("agg") == "list":
        values = [r[spec["key"]] for r in doc["records"] if all(r.get(k) == v for k, v in spec["match"].items())]
        return _cell(values, "list", spec.get("fmt", ""))
    value = _of(doc, spec["match"], spec["key"], spec.get("agg", "mean"), where) * spec.get("scale", 1)
    return format(value, spec.get("fmt", ""))


def headline(docs: list[tuple[str, dict]], readme_dir: Path, results_dir: Path) -> str:
    """The README's headline table: one row per ``headline`` entry of the result files, by rank."""
    rows = []
    for name, doc in docs:
        where = str(results_dir / f"{name}.json")
        for h in doc.get("headline", []):
            try:
                text = h["text"].format(*(_headline_value(doc, v, where) for v in h.get("values", [])))
            except (KeyError, IndexError) as e:
                raise ResultError(f"{where}: headline {h.get('label')!r}: {e!r}") from None
            link = Path(os.path.relpath(results_dir / f"{name}.md", readme_dir)).as_posix()
            rows.append((h.get("rank", 99), f"| [{h['label']}]({link}) | {text} | {doc['machine'].split(' (')[0]} | "
                                            f"{doc['date'].split(' (')[0]} |"))
    lines = ["<!-- Generated by benchmarks/results.py from docs/results/*.json: do not edit by hand. -->",
             "| result | measured | machine | date |", "|---|---|---|---|"]
    return "\n".join(lines + [row for _, row in sorted(rows, key=lambda r: r[0])])


def with_headline(readme_text: str, table: str, where: str) -> str:
    """README text with the block between the markers replaced by ``table``."""
    if readme_text.count(BEGIN) != 1 or readme_text.count(END) != 1 or readme_text.index(BEGIN) > readme_text.index(END):
        raise ResultError(f"{where}: needs one {BEGIN} line followed by one {END} line")
    head, rest = readme_text.split(BEGIN, 1)
    return head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1]


def index(docs: list[tuple[str, dict]]) -> str:
    lines = ["# Results", "", "<!-- Generated by benchmarks/results.py: do not edit by hand. -->", "",
             "Each page is rebuilt from the JSON file beside it (`.venv/bin/python benchmarks/results.py`), and "
             "states its date, machine, command and commit. How to run each benchmark and read its output: "
             "[benchmarks/README.md](../../benchmarks/README.md). Measurements from before these pages existed, "
             "and those superseded since, are in the [results notebook](notebook.md).", "",
             "| result | date | machine |", "|---|---|---|"]
    for name, doc in docs:
        lines.append(f"| [{doc['title']}]({name}.md) | {doc['date']} | {doc['machine']} |")
    return "\n".join(lines) + "\n"


def build(results_dir: Path = RESULTS, readme: Path | None = README) -> dict[Path, str]:
    """Every page's path and text; with ``readme``, also that file with its headline table rebuilt."""
    docs = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            docs.append((path.stem, json.loads(path.read_text())))
        except ValueError as e:
            raise ResultError(f"{path}: not JSON: {e}") from None
    pages = {results_dir / f"{name}.md": render(doc, str(results_dir / f"{name}.json")) for name, doc in docs}
    pages[results_dir / "README.md"] = index(docs)
    if readme is not None:
        pages[readme] = with_headline(readme.read_text(), headline(docs, readme.parent, results_dir), str(readme))
    return pages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if any page differs from what its JSON renders")
    ap.add_argument("--results-dir", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    ap.add_argument("--readme", type=Path, default=README, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        pages = build(args.results_dir, args.readme)
    except ResultError as e:
        print(e, file=sys.stderr)
        return 2
    stale = [p for p, text in pages.items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p} is stale: run .venv/bin/python benchmarks/results.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(pages[p])
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
