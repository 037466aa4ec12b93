"""One router per resource: jobs, metrics, layer checks, evaluations, comparisons, health, Prometheus, dashboard."""
