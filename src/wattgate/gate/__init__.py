"""The invariant gate: prove a plan safe before any GPU job is submitted."""
