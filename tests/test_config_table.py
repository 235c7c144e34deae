"""The README's table of config keys is exactly what the config classes say."""

from __future__ import annotations

import attrs
from config_table import (
    METRICS_BEGIN,
    METRICS_END,
    README,
    SECTIONS,
    readme_table,
    render,
    render_metrics,
)

from kvo_core.config import config_keys


def test_readme_table_matches_the_config_classes() -> None:
    assert readme_table(README.read_text()) == render(), (
        "README.md's config table is stale: run `python tools/config_table.py --write`")


def test_readme_metrics_table_matches_the_catalog() -> None:
    assert readme_table(README.read_text(), METRICS_BEGIN, METRICS_END) == render_metrics(), (
        "README.md's metrics table is stale: run `python tools/config_table.py --write`")


def test_every_field_is_documented_with_what_it_allows() -> None:
    for _, cls in SECTIONS:
        keys = config_keys(cls)
        assert [k.name for k in keys] == [f.name for f in attrs.fields(cls)]
        undescribed = [k.name for k in keys if k.allowed == "any value"]
        assert not undescribed, f"{cls.__name__}: validators without a description: {undescribed}"
