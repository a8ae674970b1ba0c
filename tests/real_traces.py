"""The real traces kept with the tests (one NVIDIA H200): a labelled calibration trace and a training run.

wattgate.testing.trace_scoring scores triage against them (calibration_agreement, train_agreement).
"""

from pathlib import Path

H200_DATA = Path(__file__).resolve().parent / "data" / "h200"
