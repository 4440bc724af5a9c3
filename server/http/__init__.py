"""The HTTP shell every API shares (aiohttp): who asks, the middlewares, routes, the pipeline.

A request passes `middleware.py` (its id and access line, errors in the API's own
shape, the API key), which names its caller with `callers.py` (the callers file,
keys, the `user` field); `routes.py` is the table of which path runs what, with the
small handlers (models, probes, /metrics, tokenizer); a generation route is
`pipeline.py`'s `generation_endpoint` around one API's `prepare`
(server/api/*/endpoint.py): result cache, the core's admission, the engine,
stream or whole body, abort when the client goes away.
"""
