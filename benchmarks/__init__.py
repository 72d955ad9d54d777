"""Measurement harnesses (throughput, memory, communication, parity): run from the repository root, as
`python benchmarks/<name>.py` or `python -m benchmarks.<name>`; what several of them share is in harness.py."""
