"""An `anthropic-messages` backend for `vllm bench serve`, which has none (vLLM 0.32).

Why this module exists: issue 17's benchmark point compares Anthropic Messages
with chat and Responses through the same client, so this request function is
registered into vLLM's `ASYNC_REQUEST_FUNCS` (bench/run/vllm_client.py does it
before the parser is built, so `--backend anthropic-messages` is a choice).
Modelled on vLLM's `async_request_openai_responses`:

1. POST `/v1/messages`: `max_tokens`, `stream: true`, the prompt as one user
   message; `--extra-body` and `ignore_eos` merged as for the other backends.
2. TTFT at the first `content_block_delta` that carries text or thinking,
   never at `message_start` or `ping` (sent before any token); ITL between
   those deltas; the request ends at the last of them.
3. Output (and input) tokens from `message_delta.usage`.
4. Success needs a token delta and `message_stop`; an `error` event fails it.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

import aiohttp
from vllm.benchmarks.lib import endpoint_request_func as erf

NAME = "anthropic-messages"

# The deltas that carry generated tokens (rule 2): a thinking delta is
# decoding too, as vLLM's Responses client counts reasoning deltas.
_TOKEN_DELTAS = frozenset({"text_delta", "thinking_delta"})


def _payload(inp: erf.RequestFuncInput) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": inp.model_name or inp.model,
        "messages": [{"role": "user", "content": inp.prompt}],
        "max_tokens": inp.output_len,
        "stream": True,
    }
    erf._update_payload_common(payload, inp)
    return payload


async def async_request_anthropic_messages(
    request_func_input: erf.RequestFuncInput,
    session: aiohttp.ClientSession,
    pbar: Any = None,
) -> erf.RequestFuncOutput:
    """One streamed /v1/messages request, timed as rules 2-4 say."""
    inp = request_func_input
    erf._validate_api_url(inp.api_url, "Anthropic Messages API", "messages")
    headers = erf._get_headers("application/json")
    headers["anthropic-version"] = "2023-06-01"
    erf._update_headers_common(headers, inp)
    output = erf.RequestFuncOutput()
    output.prompt_len = inp.prompt_len
    text = ""
    stream_error: str | None = None
    stopped = first = False
    st = time.perf_counter()
    output.start_time = st
    last = st
    try:
        async with session.post(url=inp.api_url, json=_payload(inp), headers=headers) as resp:
            if resp.status != 200:
                output.error = resp.reason or f"HTTP {resp.status}"
            else:
                handler = erf.StreamedResponseHandler()
                async for chunk_bytes in resp.content.iter_any():
                    for message in handler.add_chunk(chunk_bytes):
                        chunk = erf._extract_sse_data(message)
                        if not chunk:
                            continue
                        now = time.perf_counter()
                        data = json.loads(chunk)
                        kind = data.get("type")
                        delta = data.get("delta") or {}
                        if kind == "content_block_delta" and delta.get("type") in _TOKEN_DELTAS:
                            if first:
                                output.itl.append(now - last)
                            else:
                                first = True
                                output.ttft = now - st
                            text += delta.get("text") or ""
                            last = now
                        elif kind == "message_delta":
                            usage = data.get("usage") or {}
                            if (n_out := usage.get("output_tokens")) is not None:
                                output.output_tokens = n_out
                            if (n_in := usage.get("input_tokens")) is not None:
                                output.prompt_len = n_in
                        elif kind == "message_stop":
                            stopped = True
                        elif kind == "error":
                            stream_error = json.dumps(data.get("error") or data)
                output.generated_text = text
                output.latency = last - st
                if stream_error is not None:
                    output.error = stream_error
                elif not first:
                    output.error = "Never received a text or thinking delta to calculate TTFT."
                elif not stopped:
                    output.error = "Stream ended without message_stop."
                else:
                    output.success = True
    except Exception:
        output.success = False
        output.error = "".join(traceback.format_exception(*sys.exc_info()))
    if pbar:
        pbar.update(1)
    return output


def register() -> None:
    """Make `--backend anthropic-messages` a choice of `vllm bench serve`.

    Also listed as OpenAI-compatible: serve.py takes sampling flags and the
    random dataset's ignore-EOS default only for those backends."""
    erf.ASYNC_REQUEST_FUNCS[NAME] = async_request_anthropic_messages
    if NAME not in erf.OPENAI_COMPATIBLE_BACKENDS:
        erf.OPENAI_COMPATIBLE_BACKENDS.append(NAME)
