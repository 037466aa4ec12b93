"""HTTP only: routes, dependencies, the service functions behind them, response models and comparison reports."""
