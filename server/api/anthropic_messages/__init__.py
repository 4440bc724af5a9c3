"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens.

`parse.py` (pure) translates a body into the internal ChatRequest; `output.py`
(pure) writes a generated answer as a `message` body and the stream's events;
`endpoint.py` (aiohttp) prepares through the chat endpoint's `chat_job` and
encodes, with a `ping` after an idle time.
"""
