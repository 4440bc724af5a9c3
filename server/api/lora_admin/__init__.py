"""Runtime LoRA loading, behind an admin key: vLLM's /v1/load_lora_adapter and unload.

`endpoint.py` (aiohttp) is all of it: /v1/load_lora_adapter and
/v1/unload_lora_adapter; what an adapter's files must hold is checked on the
engine side (server/engines/lora.py).
"""
