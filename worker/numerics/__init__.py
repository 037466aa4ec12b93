"""What the numbers mean: the float32 check, layer checks, scale search, speed against float32 and the summary."""
