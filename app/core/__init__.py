"""The contract both processes share: specs, records, states, errors, settings, clock, number formats."""
