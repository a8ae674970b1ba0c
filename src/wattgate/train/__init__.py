"""The train stage: FSDP2 full fine-tuning that runs the gated plan exactly as planned."""
