"""Test and benchmark support that ships with the package: synthetic power traces with their known phases
(synthetic_trace.py) and the scores that judge triage against them. No stage imports this package."""
