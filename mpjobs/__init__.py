"""`mpjobs`: the Python client of the mpjobs API, for scripts and notebooks (docs/client.md).

    >>> from mpjobs import Client
    >>> client = Client()                                     # doctest: +SKIP
    >>> job = client.submit(model, policy="mixed_float16")    # doctest: +SKIP
    >>> frame = job.wait().to_pandas()                        # doctest: +SKIP

It speaks HTTP (httpx) with the API's own schemas (mpjobs/contract/) and imports neither TensorFlow nor Keras:
a Keras model passed to `submit` is sent as its `to_json()`. pandas is needed only by `to_pandas()`.
"""

from __future__ import annotations

from mpjobs._client import DEFAULT_TIMEOUT_S, DEFAULT_URL, Client
from mpjobs._comparison import Comparison
from mpjobs._exceptions import (
    ApiError,
    BadResponse,
    ClientError,
    Conflict,
    InvalidSpec,
    MpjobsError,
    NotFound,
    ServerError,
    Timeout,
    Unauthorized,
    Unavailable,
    Unreachable,
    WaitTimeout,
)
from mpjobs._job import Job
from mpjobs._reading import member

__all__ = ["DEFAULT_TIMEOUT_S", "DEFAULT_URL", "ApiError", "BadResponse", "Client", "ClientError", "Comparison",
           "Conflict", "InvalidSpec", "Job", "MpjobsError", "NotFound", "ServerError", "Timeout", "Unauthorized",
           "Unavailable", "Unreachable", "WaitTimeout", "member"]
