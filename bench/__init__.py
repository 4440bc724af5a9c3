"""Benchmarks: Sluice against vLLM's own OpenAI server and the raw engine (`python -m bench`)."""
