"""Domain errors shared by the API and the worker.

Error tree::

    MpjobsError
    ├── JobNotFound          HTTP 404
    │   ├── ArtifactNotFound HTTP 404
    │   └── ComparisonNotFound HTTP 404
    ├── ServiceUnavailable   HTTP 503 (Redis unreachable)
    │   ├── IdempotencyKeyContended HTTP 503 (concurrent requests kept rewriting one key)
    │   └── RedisFull        HTTP 503 (Redis near or over its maxmemory)
    ├── Unauthorized         HTTP 401
    ├── IdempotencyConflict  HTTP 409
    ├── JobAlreadyEnded      HTTP 409 (a cancel of an ended job; the body has its `state`)
    ├── DeleteRefused        HTTP 409 (nothing was deleted)
    │   ├── JobNotEnded
    │   ├── ComparisonNotEnded
    │   ├── JobInComparison
    │   └── JobStillHeld
    ├── SpecRefused          HTTP 422 (valid, but over a deployment limit)
    ├── DatasetNotFound      HTTP 404
    ├── DatasetInUse         HTTP 409 (a queued or running job trains on it; nothing was deleted)
    ├── DatasetTooLarge      HTTP 413 (over DATASET_MAX_BYTES; nothing kept)
    ├── NotAnNpzBody         HTTP 415 (the upload is not an .npz)
    ├── DatasetRefused       HTTP 422 (an .npz whose arrays cannot train a model; nothing kept)
    └── JobFailed            a job ended with a named FailureReason
        ├── InvalidModel         reason=invalid_model
        ├── InvalidDataset       reason=invalid_dataset
        ├── Diverged             reason=diverged
        ├── TimedOut             reason=timeout
        ├── OutOfMemory          reason=out_of_memory
        └── UnsupportedPrecision reason=unsupported_precision_on_device

Lower-layer errors (TensorFlow, Keras, OS) are mapped to these in one place per
layer and never reach a user as a raw traceback.
"""

from __future__ import annotations

from mpjobs.contract.jobs import FailureReason


class DomainError(Exception):
    """Base of every error this project raises on purpose."""


class JobNotFound(DomainError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"No job with id {job_id!r}.")


class ArtifactNotFound(JobNotFound):
    def __init__(self, job_id: str, name: str) -> None:
        DomainError.__init__(self, f"Job {job_id!r} has no {name} yet; it is written when the job succeeds.")


class ComparisonNotFound(JobNotFound):
    def __init__(self, comparison_id: str) -> None:
        DomainError.__init__(self, f"No comparison with id {comparison_id!r}.")


class PlanNotFound(JobNotFound):
    def __init__(self, job_id: str, why: str) -> None:
        DomainError.__init__(self, f"Job {job_id!r} has no precision plan: {why}")


class ServiceUnavailable(DomainError):
    def __init__(self, detail: str) -> None:
        super().__init__(f"Redis is unreachable, so jobs cannot be read or queued right now: {detail}")


class TooManyStreams(ServiceUnavailable):
    """This API process serves as many live streams as MAX_STREAMS allows."""

    retry_after_s = 5

    def __init__(self, limit: int) -> None:
        DomainError.__init__(self, f"This API process already serves {limit} live streams, its limit (MAX_STREAMS): "
                                   f"retry in {self.retry_after_s} s, or read the steps in pages "
                                   "(GET /jobs/{id}/metrics?after=N).")


class RedisFull(ServiceUnavailable):
    """Redis holds too much to take a new job: over the high-water mark, or refusing writes (OOM)."""

    def __init__(self, used: int, limit: int, high_water: float, refused: bool = False) -> None:
        held = f"Redis holds {_size(used)} of its {_size(limit)} maxmemory ({used / max(limit, 1):.0%})"
        why = (f"{held} and refused a write as out of memory" if refused else
               f"{held}, over the {high_water:.0%} high-water mark (REDIS_MEMORY_HIGH_WATER)")
        DomainError.__init__(self, f"{why}: no new job is taken, and nothing was written. Free memory by "
                                   "deleting old jobs (DELETE /jobs/{id}?purge=true), lower HISTORY_RETENTION_S "
                                   "so ended jobs' step records leave Redis sooner, or raise Redis's maxmemory.")
        self.used, self.limit = used, limit


def _size(n: int) -> str:
    """Bytes in words: `1.5 GiB`, `512 MiB`, `900 KiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


class NotAuthenticated(DomainError):
    pass


class IdempotencyKeyContended(ServiceUnavailable):
    """Redis answers, but the key changed under every read: retrying is safe."""

    def __init__(self, reads: int) -> None:
        DomainError.__init__(self, f"This Idempotency-Key was rewritten by concurrent requests each of the {reads} "
                                   "times it was read, so no job was created or returned by this request; retry it.")


class IdempotencyConflict(DomainError):
    def __init__(self, what: str = "job spec") -> None:
        super().__init__(f"This Idempotency-Key was already used with a different {what}.")


class JobAlreadyEnded(DomainError):
    """A cancel of a job that has already ended: nothing to cancel (409, with the job's state)."""

    def __init__(self, job_id: str, state: str) -> None:
        super().__init__(f"Job {job_id!r} has already ended ({state}): there is nothing to cancel. To delete it "
                         f"for good: DELETE /jobs/{job_id}?purge=true.")
        self.state = state


class DeleteRefused(DomainError):
    """A delete (`purge=true`) that would lose a job still in use: nothing was deleted."""


class JobNotEnded(DeleteRefused):
    def __init__(self, job_id: str, state: str) -> None:
        super().__init__(f"Job {job_id!r} is {state}; only an ended job can be deleted. Cancel it first "
                         f"(DELETE /jobs/{job_id}), then delete it once it has ended. Nothing was deleted.")


class ComparisonNotEnded(DeleteRefused):
    def __init__(self, comparison_id: str, states: dict[str, str]) -> None:
        jobs = ", ".join(f"{job_id!r} is {state}" for job_id, state in states.items())
        super().__init__(f"Comparison {comparison_id!r} has jobs that have not ended ({jobs}); it is deleted "
                         f"only once all have. Cancel it first (DELETE /comparisons/{comparison_id}), then "
                         "delete it. Nothing was deleted.")


class JobInComparison(DeleteRefused):
    def __init__(self, job_id: str, comparison_id: str) -> None:
        super().__init__(f"Job {job_id!r} belongs to comparison {comparison_id!r}, and is deleted with it: "
                         f"DELETE /comparisons/{comparison_id}?purge=true deletes the comparison and all its "
                         "jobs. Nothing was deleted.")


class JobStillHeld(DeleteRefused):
    def __init__(self, job_id: str, lease_s: float) -> None:
        super().__init__(f"Job {job_id!r} has ended, but the worker that ran it has not let go of it yet "
                         f"(its lease lapses within {lease_s:g} s if that worker died). Retry then. "
                         "Nothing was deleted.")


class SpecRefused(DomainError):
    """A spec that validates but exceeds this deployment's limits: answered 422, like a bad field.

    `loc` is the field's path in the body, e.g. ("training", "max_seconds").
    """

    error_type = "limit_exceeded"
    """The `type` of the 422's one error."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


class DatasetNotFound(DomainError):
    def __init__(self, dataset_id: str) -> None:
        super().__init__(f"No dataset with id {dataset_id!r}.")


class DatasetInUse(DomainError):
    def __init__(self, dataset_id: str, job_id: str, state: str) -> None:
        super().__init__(f"Dataset {dataset_id!r} is used by job {job_id!r}, which is {state}. Cancel the job "
                         f"(DELETE /jobs/{job_id}) or wait until it ends. Nothing was deleted.")


class DatasetTooLarge(DomainError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"Expected an .npz of at most {limit} bytes (DATASET_MAX_BYTES); the upload is longer. "
                         "Nothing of it was kept.")
        self.limit = limit


class NotAnNpzBody(DomainError):
    """The uploaded bytes are not an `.npz` archive: nothing was kept."""


class DatasetRefused(SpecRefused):
    """A dataset that cannot train the model: `loc` names the array (("x",)) or the spec's field (("dataset", "id"))."""

    error_type = "invalid_dataset"


class JobFailed(DomainError):
    """A job cannot continue. `reason` is machine-readable, `message` is advice."""

    reason: FailureReason = FailureReason.INTERNAL

    def __init__(self, message: str, reason: FailureReason | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.message}"


class InvalidModel(JobFailed):
    reason = FailureReason.INVALID_MODEL


class NoGradient(InvalidModel):
    """No gradient reaches any trainable weight: training would change nothing."""

    def __init__(self, weights: int) -> None:
        super().__init__(
            f"No gradient reaches any of the model's {weights} trainable weights: its output is cut off from "
            "them (cast to an integer or boolean, ops.stop_gradient, Discretization), so training cannot change "
            "them. Make the output a float that depends on the weights.")


class InvalidDataset(JobFailed):
    reason = FailureReason.INVALID_DATASET


class Diverged(JobFailed):
    reason = FailureReason.DIVERGED


class TimedOut(JobFailed):
    reason = FailureReason.TIMEOUT


class OutOfMemory(JobFailed):
    reason = FailureReason.OUT_OF_MEMORY


class UnsupportedPrecision(JobFailed):
    reason = FailureReason.UNSUPPORTED_PRECISION_ON_DEVICE
