"""Telemetry: what the compiled step measures (optimizer, step vector, batch loss) and the reporters it goes to."""
