"""Power analysis after the fact: importing other collectors' logs, triage tables, calibration, triage."""
