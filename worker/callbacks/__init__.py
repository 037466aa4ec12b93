"""The Keras callbacks of a run, one concern each: record steps, checkpoint, stop, guard against divergence."""
