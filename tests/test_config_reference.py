"""docs/reference/config.md is generated from shared/config.py and must not go stale."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from shared import config as schema
from shared.config_reference import PAGE, blocks, field_docs, render


def test_the_config_reference_is_up_to_date():
    assert PAGE.read_text() == render(), "docs/reference/config.md is stale: run python -m shared.config_reference"


def test_every_key_of_every_block_is_documented():
    undocumented = [f"{path or 'Config'}.{f.name}" for path, cls in blocks() for f in dataclasses.fields(cls)
                    if f.name != "source" and not dataclasses.is_dataclass(f.default_factory if f.default_factory
                                                                              is not dataclasses.MISSING else None)
                    and f.name not in field_docs(cls) and path]
    assert undocumented == []


def test_blocks_cover_the_schema():
    names = {cls for _, cls in blocks()}
    assert {schema.TrainerConfig, schema.VideoConfig, schema.VLAConfig, schema.LoRAConfig, schema.PPOConfig,
            schema.GRPOConfig} <= names


def schema_field_docs() -> list[tuple[str, str]]:
    """(``Class.field``, docstring) for every field of shared/config.py and shared/envs/options.py: an
    annotated assignment in a class body followed by a string literal."""
    root = Path(__file__).resolve().parents[1]
    found = []
    for path in (root / "shared" / "config.py", root / "shared" / "envs" / "options.py"):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for node, after in zip(cls.body, cls.body[1:]):
                if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                        and isinstance(after.value.value, str)):
                    found.append((f"{cls.name}.{node.target.id}", after.value.value))
    return found


def test_field_docstrings_are_short_and_carry_no_measurements():
    """A field's docstring says what the key does, its values and what null/auto means, in at most 6
    lines; how a mode works and what was measured belong on the docs page it points to."""
    docs = schema_field_docs()
    assert len(docs) > 100
    too_long = [name for name, doc in docs if len(doc.strip().splitlines()) > 6]
    measured = [name for name, doc in docs if "measured" in doc.lower()]
    assert too_long == [], f"field docstrings over 6 lines: {too_long}"
    assert measured == [], f"field docstrings that report measurements: {measured}"
