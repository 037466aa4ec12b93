"""The training engine: the model, its data and devices, one run from build to saved model, and its failures."""
