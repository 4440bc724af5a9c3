"""The request class on the real engine, through the real `openai` client:
`service_tier="flex"` is background work and every API that takes it (chat,
streamed chat, Responses) says which tier served it, as OpenAI's does; the
access line and /metrics name the class (batching/classes.py)."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.support import SluiceProcess

pytestmark = pytest.mark.engine

MODEL = "sluice-demo"
_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(sluice_server: SluiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=sluice_server.base + "/v1", api_key="unused", max_retries=0)


def _classes(base: str) -> dict[str, float]:
    """sluice_class_requests_total by class, for status 200."""
    text = httpx.get(base + "/metrics", timeout=5).text
    found = re.findall(r'sluice_class_requests_total\{class="(\w+)",status="200"\} (\S+)', text)
    return {cls: float(v) for cls, v in found}


def _access_class(server: SluiceProcess, rid: str) -> str:
    """The `class` of the access line of request `rid` (the log's writer thread
    writes it after the response)."""
    line = re.compile(rf"sluice\.access: request request_id={re.escape(rid)} .*")
    deadline = time.monotonic() + 30
    while not (found := line.findall(server.tail(200_000))):
        assert time.monotonic() < deadline, server.tail()
        time.sleep(0.05)
    return dict(re.findall(r"(?:^| )(\w+)=(\S*)", found[-1]))["class"]


def test_flex_is_background_and_the_response_names_its_tier(
    client: openai.OpenAI, sluice_server: SluiceProcess
) -> None:
    before = _classes(sluice_server.base)
    msgs: list[dict[str, str]] = [{"role": "user", "content": "Say something"}]
    flex = client.chat.completions.create(
        model=MODEL,
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=4,
        service_tier="flex",
        extra_body=_OFF,
        extra_headers={"x-request-id": "class-flex"},
    )
    assert flex.service_tier == "flex" and flex.choices[0].message.content is not None
    plain = client.chat.completions.create(
        model=MODEL,
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=4,
        extra_body=_OFF,
        extra_headers={"x-request-id": "class-plain"},
    )
    assert plain.service_tier == "default"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=4,
            stream=True,
            service_tier="flex",
            extra_body=_OFF,
        )
    )
    assert chunks and {c.service_tier for c in chunks} == {"flex"}
    resp = client.responses.create(
        model=MODEL,
        input="Say something",
        max_output_tokens=16,
        service_tier="flex",
        reasoning={"effort": "none"},
    )
    assert resp.service_tier == "flex" and resp.status in ("completed", "incomplete")
    assert _access_class(sluice_server, "class-flex") == "background"
    assert _access_class(sluice_server, "class-plain") == "interactive"
    after = _classes(sluice_server.base)
    assert after.get("background", 0) - before.get("background", 0) == 3
    assert after.get("interactive", 0) - before.get("interactive", 0) == 1
