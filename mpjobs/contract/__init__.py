"""The wire contract: specs, records, states and reports, as the client, the API and the worker all read them.

Pydantic models and plain functions only: importing it loads no HTTP server, no Redis client and no
TensorFlow, so the client installs with it alone, as MLflow's server imports `mlflow.entities`.
"""

# spec.py first: it imports evaluation.py, which reads spec.py's DatasetSpec, once that is defined.
from mpjobs.contract import spec as _spec  # noqa: E402,F401
