"""server/engines/vllm_pooling.py through the engine adapter, against vLLM's own
config, renderer and input processing, without an engine core (the FrontHalf of
tests/unit/test_engine_adapter.py): what kind of model the demo is under the
pooling runner and as its reranker sibling, vLLM's pooling parameter checks as
400s naming the field, the context rule for embedding inputs (a 400, or cut
when the client asks), and that `add` hands vLLM a pooling request.
tests/integration/test_pooling.py and test_reranker.py run the same on the
real engine, against vLLM's server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from server.cli import parse_serve_args
from server.engines import vllm_adapter as engine_mod
from server.engines.demo.model import build_demo_model
from server.engines.vllm_adapter import EngineAdapter
from server.errors import SluiceError
from tests.unit.test_engine_adapter import FrontHalf


async def _adapter(argv: list[str]) -> AsyncIterator[EngineAdapter]:
    mp = pytest.MonkeyPatch()
    mp.setattr(engine_mod.AsyncLLM, "from_vllm_config", lambda config, **_: FrontHalf(config))
    a = EngineAdapter(parse_serve_args(argv, {}).engine_args, "m")
    try:
        await a.start()
        yield a
    finally:
        a.shutdown()
        mp.undo()


@pytest.fixture(scope="module")
async def embedder(demo_model_dir: Path) -> AsyncIterator[EngineAdapter]:
    async for a in _adapter(["--model", str(demo_model_dir), "--runner", "pooling"]):
        yield a


@pytest.fixture(scope="module")
async def reranker(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EngineAdapter]:
    model = build_demo_model(tmp_path_factory.mktemp("rr") / "model", reranker=True)
    async for a in _adapter(["--model", str(model)]):  # no flags: its config says pooling
        yield a


def _tokenizer(a: EngineAdapter) -> Any:
    return a._llm.get_tokenizer()  # type: ignore[union-attr]


def _last_request(a: EngineAdapter) -> Any:
    """The EngineCoreRequest vLLM's input processing made of the last `add`."""
    return a._llm.requests[-1]  # type: ignore[union-attr]


async def test_the_demo_under_the_pooling_runner_is_an_embedder(embedder: EngineAdapter) -> None:
    assert embedder.info.kind == "embed"
    texts = ["Hello world", "the cat sat"]
    ids = await embedder.tokenize_pooling(texts)
    assert ids == [_tokenizer(embedder).encode(t) for t in texts]
    params = embedder.pooling_params("embed")
    await embedder.add("e1", ids[0], params, priority=0)
    req = _last_request(embedder)
    assert req.prompt_token_ids == ids[0] and req.pooling_params.task == "embed"
    assert req.sampling_params is None


async def test_pooling_parameters_vllm_refuses_are_400s(embedder: EngineAdapter) -> None:
    with pytest.raises(SluiceError) as err:
        embedder.pooling_params("embed", dimensions=8)  # not a Matryoshka model
    assert err.value.status == 400 and err.value.param == "dimensions"


async def test_inputs_past_the_context_are_400s_unless_cut_on_request(
    embedder: EngineAdapter,
) -> None:
    n = embedder.info.max_model_len
    with pytest.raises(SluiceError) as err:
        await embedder.tokenize_pooling([[7] * (n + 1)])
    assert err.value.param == "input" and "maximum context length" in err.value.message
    with pytest.raises(SluiceError) as err:
        await embedder.tokenize_pooling(["ok", [7] * (n + 1)])
    assert err.value.param == "input[1]"  # the 400 names the input
    (cut,) = await embedder.tokenize_pooling([[7] * (n + 1)], truncate_prompt_tokens=100)
    assert len(cut) == 100
    (whole,) = await embedder.tokenize_pooling([[7] * (n + 1)], truncate_prompt_tokens=-1)
    assert len(whole) == n
    with pytest.raises(SluiceError) as err:
        await embedder.tokenize_pooling([[10**7]])  # outside the vocabulary
    assert err.value.status == 400


async def test_the_reranker_sibling_is_a_cross_encoder(reranker: EngineAdapter) -> None:
    assert reranker.info.kind == "rerank"
    params = reranker.pooling_params("classify")
    pairs = await reranker.tokenize_pairs("a small cat", ["a kitten", "stocks"], params)
    tok = _tokenizer(reranker)
    # vLLM's pair prompt for an LLM turned reranker: the query's tokens, then the document's.
    for (ids, p), doc in zip(pairs, ["a kitten", "stocks"], strict=True):
        assert ids == tok.encode("a small cat") + tok.encode(doc)
        assert p.task == "classify"
    await reranker.add("r1", pairs[0][0], pairs[0][1], priority=0)
    assert _last_request(reranker).pooling_params.task == "classify"
    with pytest.raises(SluiceError) as err:
        await reranker.tokenize_pairs("q", ["x " * (reranker.info.max_model_len + 1)], params)
    assert err.value.param == "documents"
