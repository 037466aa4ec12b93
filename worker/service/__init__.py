"""The service around the engine: the RQ task, job slots per GPU, the GPUs themselves and the reaper."""
