"""OpenAI's Usage API over Sluice's usage ledger: /v1/organization/usage/{completions,embeddings}.

`endpoint.py` (aiohttp) is all of it: the query string, who sees what, and
the page in OpenAI's shape; the counting and the storage are
server/operations/usage.py's.
"""
