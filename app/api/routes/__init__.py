"""One router per resource: jobs, metrics, layer checks, comparisons, health, Prometheus and the dashboard."""
