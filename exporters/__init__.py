"""Where observations go: Prometheus, OpenTelemetry, and a JSON-lines journal with repro captures."""

from exporters.journal import JsonlExporter
from exporters.otel import OTelExporter
from exporters.prometheus import PrometheusExporter

__all__ = ["JsonlExporter", "OTelExporter", "PrometheusExporter"]
