"""Ollama's API (/api/*) on the one pipeline: parse.py and output.py translate
(pure), endpoint.py is the aiohttp half (docs/ollama.md)."""
