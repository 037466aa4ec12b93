"""mpjobs worker: the mixed-precision training engine and its queue glue."""
