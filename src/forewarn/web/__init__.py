"""The web endpoints (/metrics, /healthz, /readyz) and the background HTTP server they share."""
