"""Prometheus metrics: the view of the current state (data) and its exposition (rendering)."""

from forewarn.metrics.exposition import Metrics, View, ViewHolder

__all__ = ["Metrics", "View", "ViewHolder"]
