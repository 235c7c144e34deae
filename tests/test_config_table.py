"""docs/configuration.md's config tables and docs/metrics.md's metrics table are exactly what
the config classes and the metrics catalog say."""

from __future__ import annotations

from pathlib import Path

import attrs

from kvo_core.config import config_keys
from kvo_tools.config_table import (
    CONFIGURATION,
    METRICS,
    METRICS_BEGIN,
    METRICS_END,
    SECTIONS,
    generated_part,
    render,
    render_metrics,
)

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_table_matches_the_config_classes() -> None:
    assert generated_part((ROOT / CONFIGURATION).read_text()) == render(), (
        "docs/configuration.md's config table is stale: "
        "run `python -m kvo_tools.config_table --write`")


def test_metrics_table_matches_the_catalog() -> None:
    text = (ROOT / METRICS).read_text()
    assert generated_part(text, METRICS_BEGIN, METRICS_END) == render_metrics(), (
        "docs/metrics.md's metrics table is stale: run `python -m kvo_tools.config_table --write`")


def test_every_field_is_documented_with_what_it_allows() -> None:
    for _, cls in SECTIONS:
        keys = config_keys(cls)
        assert [k.name for k in keys] == [f.name for f in attrs.fields(cls)]
        undescribed = [k.name for k in keys if k.allowed == "any value"]
        assert not undescribed, f"{cls.__name__}: validators without a description: {undescribed}"
