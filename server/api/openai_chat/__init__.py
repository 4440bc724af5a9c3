"""OpenAI's chat completions and completions: /v1/chat/completions, /v1/completions.

`parse.py` (pure) turns a body into a ChatRequest or CompletionRequest, or a 400
naming the field; `output.py` (pure) builds whole bodies (and /v1/models') and the
output value types the other APIs read too; `stream.py` (pure) the per-token SSE
frames, the hot path; `endpoint.py` (aiohttp) prepares a job (model, constraint,
template, tokens, context check) and encodes choices. The other APIs are fronts
of this one: Responses and Messages become a ChatRequest and run `chat_job`.
"""
