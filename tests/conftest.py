import os

# Quiet TensorFlow's C++ start-up chatter in test output; errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
