"""OpenAI's Responses API: /v1/responses and its stored responses.

`parse.py` (pure) translates a body into the chat body it means and parses it;
`output.py` (pure) writes a chat choice as Responses items, the response object
and the stream's events; `store.py` keeps stored responses (bounded, in memory,
each readable by its maker only); `endpoint.py` (aiohttp) prepares, encodes, and
serves GET and DELETE of a stored response.
"""
