"""The benchmark points and micro-benches: each one measurement, run as its own module."""
