"""What the API, the store and the worker share beyond the wire contract: settings, clock, domain errors, sizes."""
