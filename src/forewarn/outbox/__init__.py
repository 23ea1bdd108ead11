"""The durable outbox: records waiting for their sinks, on disk, delivered at least once and in order."""
