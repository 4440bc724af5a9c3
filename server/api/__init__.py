"""One package per API a client speaks: its pure wire translation beside its aiohttp half.

In each: `parse.py` turns the client's body into the one internal request
(server/wire/request.py) or a 400 in the API's own shape; `output.py` writes engine
output back as the API's bodies and stream events; `endpoint.py` is the aiohttp
half, the `prepare` and `Encoder` that the one pipeline (server/http/pipeline.py)
runs. Only `endpoint.py` imports aiohttp; no module here imports vLLM
(tests/unit/test_layout.py).

openai_chat (chat completions, completions), openai_responses, anthropic_messages,
lora_admin (runtime LoRA loading). Next: ollama (issue 31), pooling (embeddings,
rerank; issue 30), each a package of the same three modules.
"""
