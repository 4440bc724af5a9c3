"""Sluice: an asyncio-native micro-batching OpenAI-compatible server for vLLM.

`server` holds everything that does I/O (HTTP, the engine, NVML, systemd);
the policy it applies lives in the pure `batching` package.
"""

__version__ = "0.1.0"
