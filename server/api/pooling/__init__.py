"""The pooling APIs: /v1/embeddings (OpenAI's) and /v1/rerank (vLLM's, Jina's
and Cohere's shape), for a model that runs vLLM's pooling runner.

`parse.py` turns bodies into frozen requests, `output.py` turns vectors and
scores into response bodies (both pure); `endpoint.py` is the aiohttp half:
model check, tokenization through the engine, and the pooling pipeline
(server/http/pipeline.py `pooling_endpoint`).
"""
