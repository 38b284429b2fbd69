"""Where observations go: Prometheus, OpenTelemetry, and a JSON-lines journal with repro captures.

The exporters load on first use (PEP 562): importing the package loads none of them, and so no torch (a journal's
repro captures need it). What they export is the metric contract's samples (:mod:`shadow.core.model.contract`)."""

from __future__ import annotations

from typing import Any

__all__ = ["JsonlExporter", "OTelExporter", "PrometheusExporter"]

_WHERE = {
    "JsonlExporter": "exporters.journal",
    "OTelExporter": "exporters.otel",
    "PrometheusExporter": "exporters.prometheus",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'exporters' has no attribute {name!r}")
