"""wattgate: deadlock-proof data plans and power-aware hang detection for FSDP fine-tuning."""

__version__ = "0.1.0"
