"""Test and benchmark support that ships with the package: synthetic power traces with their known phases
(synthetic_trace.py), written as foreign logs too (nvidia_smi_log.py), and the scores that judge triage against
real traces (trace_scoring.py). No stage imports this package."""
