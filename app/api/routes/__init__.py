"""One router per resource: jobs, metrics, comparisons, health, Prometheus and the dashboard."""
