"""docs/reference/config.md is generated from shared/config.py and must not go stale."""

from __future__ import annotations

import dataclasses

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
