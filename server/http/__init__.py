"""The HTTP shell every API shares (aiohttp): the middlewares, a request's model, the pipeline.

A request passes `middleware.py` (its id and access line, errors in the API's own
shape, the API key), which names its caller with server/callers.py (the callers
file, keys, the `user` field); `models.py` resolves and holds the request's model;
a generation route is `pipeline.py`'s `generation_endpoint` around one API's
`prepare` (server/api/*/endpoint.py): result cache, the core's admission, the
engine, stream or whole body, abort when the client goes away. `status_page.py`
serves the status page, its `static/` files (package data) and /status.json.

The shell imports no API: every package of server/api/ imports it, and the
router (server/router.py, above both) assembles them into paths.
"""
