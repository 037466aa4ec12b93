"""mpjobs API: HTTP and Redis only. Never imports TensorFlow or `worker`."""
