"""Helpers the test modules share (tiny models, CPU training runs, log files, the workflow copy).

Plain modules, not tests: tests/conftest.py imports them and the test modules take them from there
(`from conftest import make_run`), so no test module imports another.
"""
