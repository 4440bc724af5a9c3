"""docs/grafana-sluice.json asks only for metrics Sluice exports.

The exported names come from the registries themselves (server/operations/metrics.py's
Metrics with its live gauges, and the watchdog's gauges registered on the same
registry as the app does), so a renamed or removed metric fails here rather
than leaving an empty panel on someone's wall.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from server.operations.metrics import Metrics
from server.operations.watchdog import WatchdogMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-sluice.json"

# What a scrape can show for each family type (prometheus_client's naming).
_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry can export, with or without samples yet
    (a labelled counter has none until its first label set is used)."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + s for s in _SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def sluice_registry() -> CollectorRegistry:
    metrics = Metrics()
    metrics.watch(lambda: defaultdict(float))
    WatchdogMetrics(metrics.registry)
    return metrics.registry


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL text in the dashboard: panel targets (rows included) and
    the template variables' queries."""
    out: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["query"]["query"])
    return out


def metric_names(promql: str) -> set[str]:
    return set(re.findall(r"\bsluice_[a-z0-9_]+", promql))


def test_the_registry_exports_what_the_dashboard_is_built_on() -> None:
    names = exported_names(sluice_registry())
    assert {"sluice_requests_total", "sluice_queue_requests", "sluice_admission_state"} <= names
    assert "sluice_time_to_first_token_seconds_bucket" in names


def test_every_query_names_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names(sluice_registry())
    found = queries(dashboard)
    assert len(found) >= 20
    for q in found:
        used = metric_names(q)
        assert used, f"query names no sluice_* metric: {q}"
        assert used <= exported, f"{sorted(used - exported)} not exported; in: {q}"


def test_the_dashboard_covers_every_family() -> None:
    """Each metric family Sluice exports has a panel (a new metric needs one)."""
    dashboard = json.loads(DASHBOARD.read_text())
    used = set().union(*(metric_names(q) for q in queries(dashboard)))
    families = {f.name for f in sluice_registry().collect()}
    missing = {f for f in families if not any(u.startswith(f) for u in used)}
    assert not missing


def test_panels_have_unique_ids_and_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
