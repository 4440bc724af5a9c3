"""Nothing on the request path blocks the event loop (DESIGN principle 6).

blockbuster patches the blocking calls of the standard library (time.sleep,
blocking socket and file I/O, os.read, ...) to raise when they run on the
event loop thread. The whole HTTP path, the driver and the streaming writer
run under it here (the engine is the fake; the real adapter's tokenizer and
NVML calls run on worker threads, which blockbuster leaves alone).
"""

from __future__ import annotations

from typing import Any

from blockbuster import blockbuster_ctx

from server.state import STATUS


async def test_request_path_does_not_block_the_loop(make_client: Any) -> None:
    client, app, _ = await make_client(warmup=False)
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with blockbuster_ctx():
        r = await client.post("/v1/chat/completions", json=chat)
        assert r.status == 200
        r = await client.post("/v1/chat/completions", json={**chat, "stream": True})
        assert (await r.text()).endswith("data: [DONE]\n\n")
        r = await client.post("/v1/completions", json={"model": "fake", "prompt": "x"})
        assert r.status == 200
        assert (await client.get("/metrics")).status == 200
        app[STATUS].sample()
        assert (await client.get("/status.json")).status == 200
        assert (await client.get("/")).status == 200
        assert (await client.get("/static/status.js")).status == 200
        assert (await client.post("/v1/completions", data=b"{bad")).status == 400
