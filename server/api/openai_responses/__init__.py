"""OpenAI's Responses API: /v1/responses and its stored responses.

`parse.py` (pure) translates a body into the chat body it means and parses it;
`output.py` (pure) writes a chat choice as Responses items, the response object
and the stream's events; `store.py` (pure) is the stored responses' policy (bounded,
retained, each readable by its maker only); `endpoint.py` (aiohttp) prepares,
encodes, keeps stored responses in the state database and serves GET and DELETE
of one.
"""
