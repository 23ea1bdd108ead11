"""Prometheus metrics: the view of the present (data, `view`) apart from its exposition (rendering)."""

from forewarn.metrics.events import MAX_LABEL_CHARS
from forewarn.metrics.exposition import DocumentFamilies, LiveFamilies, Metrics, SharedRendering
from forewarn.metrics.view import View, ViewHolder

__all__ = ["MAX_LABEL_CHARS", "DocumentFamilies", "LiveFamilies", "Metrics", "SharedRendering", "View", "ViewHolder"]
