"""The OpenAI wire protocol, pure: request parsing, response bodies, SSE frames.

Split by direction so each part stays small: ``requests`` turns bytes into
validated frozen requests (or a 400 SluiceError), ``responses`` builds whole
bodies, ``sse`` builds stream frames on the per-token hot path. No aiohttp,
no vLLM, no I/O here; handlers in server/ do the talking.
"""

from server.protocol.requests import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    Limits,
    Message,
    Sampling,
    check_context,
    parse_chat,
    parse_completion,
)
from server.protocol.responses import (
    REASONING_FIELD,
    ChatChoice,
    CompletionChoice,
    FinishReason,
    Parsed,
    ParsedDelta,
    TokenLogprob,
    ToolCallDelta,
    Usage,
    chat_completion_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    models_body,
)
from server.protocol.sse import DONE, ChatStream, CompletionStream, sse
from server.protocol.types import Constraint, Tool, ToolCall, ToolChoice

__all__ = [
    "COMPLETION_DEFAULT_MAX_TOKENS",
    "DONE",
    "REASONING_FIELD",
    "ChatChoice",
    "ChatRequest",
    "ChatStream",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionStream",
    "Constraint",
    "FinishReason",
    "Limits",
    "Message",
    "Parsed",
    "ParsedDelta",
    "Sampling",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "Usage",
    "chat_completion_body",
    "chat_logprobs",
    "check_context",
    "completion_body",
    "completion_logprobs",
    "models_body",
    "parse_chat",
    "parse_completion",
    "sse",
]
