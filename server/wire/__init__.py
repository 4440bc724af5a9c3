"""Pure pieces every API's wire translation shares: no aiohttp, no vLLM, no I/O.

`request.py` holds the frozen internal request that every API's `parse.py` builds
(ChatRequest, CompletionRequest, Message, Sampling, Tool, ToolCall, Constraint,
Limits); `fields.py` the typed readers of a client's JSON fields and the 400s they
raise; `ignored.py` the one rule for what is accepted and ignored, and its record;
`tools.py` function tools and tool choice in OpenAI's shape (which Responses and
Ollama's API reuse); `structured.py` structured-output constraints.

No re-exports: a name is imported from the module that defines it, so an import
says which room it comes from. tests/unit/test_layout.py holds the purity line.
"""
