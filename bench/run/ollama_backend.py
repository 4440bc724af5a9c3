"""An `ollama-chat` backend for `vllm bench serve`, which has none (vLLM 0.32).

Why this module exists: issue 31's benchmark point compares Ollama's chat
with chat completions through the same client, so this request function is
registered into vLLM's `ASYNC_REQUEST_FUNCS` (bench/run/vllm_client.py does it
before the parser is built, so `--backend ollama-chat` is a choice).
Modelled on bench/run/messages_backend.py:

1. POST `/api/chat`: the prompt as one user message, `stream: true`,
   `options.num_predict` the output length and `options.ignore_eos` (vLLM's
   extension, which Sluice honours in `options`); `--extra-body` merged at
   the top (the point sends `think: false`).
2. Ollama's stream is newline-delimited JSON: TTFT at the first object whose
   message carries content or thinking (Sluice's first line goes out with
   the first token, but may be empty when that token is a tag); ITL between
   such objects; the request ends at the last of them.
3. Output (and input) tokens from the final object's `eval_count`
   (`prompt_eval_count`).
4. Success needs a token object and the final `done: true`; an `error`
   object fails it.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

import aiohttp
from vllm.benchmarks.lib import endpoint_request_func as erf

NAME = "ollama-chat"


def _payload(inp: erf.RequestFuncInput) -> dict[str, Any]:
    options: dict[str, Any] = {"num_predict": inp.output_len}
    if inp.ignore_eos:
        options["ignore_eos"] = True
    payload: dict[str, Any] = {
        "model": inp.model_name or inp.model,
        "messages": [{"role": "user", "content": inp.prompt}],
        "stream": True,
        "options": options,
    }
    payload.update(inp.extra_body or {})
    return payload


async def async_request_ollama_chat(
    request_func_input: erf.RequestFuncInput,
    session: aiohttp.ClientSession,
    pbar: Any = None,
) -> erf.RequestFuncOutput:
    """One streamed /api/chat request, timed as rules 2-4 say."""
    inp = request_func_input
    erf._validate_api_url(inp.api_url, "Ollama chat API", "api/chat")
    headers = erf._get_headers("application/json")
    erf._update_headers_common(headers, inp)
    output = erf.RequestFuncOutput()
    output.prompt_len = inp.prompt_len
    text = ""
    stream_error: str | None = None
    done = first = False
    st = time.perf_counter()
    output.start_time = st
    last = st
    buffer = b""
    try:
        async with session.post(url=inp.api_url, json=_payload(inp), headers=headers) as resp:
            if resp.status != 200:
                output.error = resp.reason or f"HTTP {resp.status}"
            else:
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if not line:
                            continue
                        now = time.perf_counter()
                        data = json.loads(line)
                        if "error" in data:
                            stream_error = json.dumps(data)
                            continue
                        msg = data.get("message") or {}
                        piece = (msg.get("content") or "") + (msg.get("thinking") or "")
                        if piece:
                            if first:
                                output.itl.append(now - last)
                            else:
                                first = True
                                output.ttft = now - st
                            text += msg.get("content") or ""
                            last = now
                        if data.get("done"):
                            done = True
                            if (n_out := data.get("eval_count")) is not None:
                                output.output_tokens = n_out
                            if (n_in := data.get("prompt_eval_count")) is not None:
                                output.prompt_len = n_in
                output.generated_text = text
                output.latency = last - st
                if stream_error is not None:
                    output.error = stream_error
                elif not first:
                    output.error = "Never received content or thinking to calculate TTFT."
                elif not done:
                    output.error = "Stream ended without its done object."
                else:
                    output.success = True
    except Exception:
        output.success = False
        output.error = "".join(traceback.format_exception(*sys.exc_info()))
    if pbar:
        pbar.update(1)
    return output


def register() -> None:
    """Make `--backend ollama-chat` a choice of `vllm bench serve` (listed as
    OpenAI-compatible for the same reason as bench/run/messages_backend.py's)."""
    erf.ASYNC_REQUEST_FUNCS[NAME] = async_request_ollama_chat
    if NAME not in erf.OPENAI_COMPATIBLE_BACKENDS:
        erf.OPENAI_COMPATIBLE_BACKENDS.append(NAME)
