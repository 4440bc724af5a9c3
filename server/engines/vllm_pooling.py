"""vLLM's pooling runner behind the engine seam: what the model serves, its
pooling parameters, the tokenization of embedding inputs and reranking pairs,
and its outputs.

Why this module exists: it is the one place that knows vLLM's pooling surface
(0.32: `PoolingParams` and their checks, the tokenization rules of its
embeddings and score servers in vllm/entrypoints/pooling/, the cross-encoder's
pair prompt, `PoolingRequestOutput`), so a vLLM upgrade touches this file. The
engine adapter (server/engines/vllm_adapter.py), which owns the `AsyncLLM`,
builds a `Pooling` at start when the model runs vLLM's pooling runner and
delegates to it; nothing else here holds state.

Rules (each as vLLM's own server does it, so the same input gives the same
tokens and the same vectors through Sluice as through `vllm serve`):

1. The kind (interface.py `Kind`) comes from vLLM's model config and the
   engine's supported tasks: the generate runner is "generate"; the pooling
   task vLLM's server would pick (`ModelConfig.get_pooling_task`) is "embed"
   for embed, "rerank" for classify with one label (a cross-encoder, as vLLM's
   `enable_scoring_api` decides), else "pooling".
2. Pooling parameters are vLLM's `PoolingParams`, verified against the model
   (`verify`: `dimensions` only for a Matryoshka model and within its sizes,
   `use_activation` defaults) once per distinct (task, dimensions,
   use_activation) and shared: the engine clones the ones it is given.
3. Embedding inputs are tokenized with the `TokenizeParams` vLLM's
   `/v1/embeddings` builds (the model's context, or the pooler's
   `max_embed_len`; `truncate_prompt_tokens`, `truncation_side`,
   `add_special_tokens`, the encoder's `do_lower_case`): the text check before
   tokenizing, one tokenizer call for all texts, the truncation and the length
   check after. An input past the context is a 400, never cut short unless the
   client asked with `truncate_prompt_tokens`. Token ids out of the vocabulary
   are a 400 (the renderer's `validate_token_ids`), not an engine error.
4. Reranking pairs on a cross-encoder are the prompts vLLM's score server
   builds (`CrossEncoderIOProcessor.get_score_prompt`: the model's score
   template, the tokenizer's text pair, or the plain concatenation vLLM uses
   for an LLM turned reranker), with the same checks; a pair whose tokenizer
   gives token type ids carries them in its own parameters, as vLLM's do.
5. An output is read once into `Pooled` (a float32 NumPy array, no copy); an
   output that carries an error raises it, a retryable one as a 503.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from vllm import PoolingParams
from vllm.config import ModelConfig
from vllm.entrypoints.pooling.scoring.io_processor import (
    CrossEncoderIOProcessor,
    _apply_post_tokenization_to_token_type_ids,
)
from vllm.entrypoints.pooling.scoring.utils import compress_token_type_ids
from vllm.exceptions import VLLMValidationError
from vllm.outputs import PoolingRequestOutput
from vllm.renderers import TokenizeParams
from vllm.renderers.chat_utils import ChatTemplateConfig

from server.engines.interface import Kind, Pooled, PoolTask
from server.errors import SluiceError

__all__ = ["PooledStream", "Pooling", "model_kind"]

Side = Literal["left", "right"]


def model_kind(model_config: ModelConfig, supported_tasks: Sequence[str]) -> Kind:
    """Rule 1: what the served model does, from vLLM's own config."""
    if model_config.runner_type != "pooling":
        return "generate"
    task = model_config.get_pooling_task(tuple(supported_tasks))
    if task in ("embed", "embed&token_classify"):
        return "embed"
    if task == "classify" and getattr(model_config.hf_config, "num_labels", 0) == 1:
        return "rerank"
    return "pooling"


def _refusal(exc: Exception, param: str) -> SluiceError:
    """vLLM's validation error (or a ValueError from its checks) as our 400."""
    message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    return SluiceError(message, param=param, code="invalid_value")


class Pooling:
    """One pooling model's parameters and tokenization (rules 2-4)."""

    def __init__(self, llm: Any, kind: Kind) -> None:
        self.kind = kind
        self._model_config: ModelConfig = llm.model_config
        self._renderer = llm.renderer
        self._tokenizer = llm.get_tokenizer()
        self._params: dict[tuple[str, int | None, bool | None], PoolingParams] = {}
        self._cross: CrossEncoderIOProcessor | None = None
        if kind == "rerank":
            # vLLM's own prompt builder for pairs (its score server's, without a
            # --chat-template: vLLM applies a score template only when given one).
            self._cross = CrossEncoderIOProcessor(
                vllm_config=llm.vllm_config,
                renderer=self._renderer,
                chat_template_config=ChatTemplateConfig(),
            )

    # -- rule 2 --------------------------------------------------------------

    def params(
        self, task: PoolTask, dimensions: int | None, use_activation: bool | None
    ) -> PoolingParams:
        key = (task, dimensions, use_activation)
        params = self._params.get(key)
        if params is None:
            params = PoolingParams(task=task, dimensions=dimensions, use_activation=use_activation)
            try:
                params.verify(self._model_config)
            except (VLLMValidationError, ValueError) as exc:
                raise _refusal(exc, "dimensions" if dimensions is not None else "model") from None
            if len(self._params) < 64:  # a handful of shapes in practice; bounded anyway
                self._params[key] = params
        return params

    # -- rule 3 --------------------------------------------------------------

    def _tok_params(
        self,
        *,
        add_special_tokens: bool,
        truncate_prompt_tokens: int | None,
        truncation_side: Side | None,
        embed: bool,
    ) -> TokenizeParams:
        """vLLM's EmbeddingTokenizeParamsMixin (embed) or ScoringRequestMixin's
        build_tok_params (rerank)."""
        config = self._model_config
        max_total = config.max_model_len
        pooler = config.pooler_config
        if embed and pooler is not None:
            max_total = (
                pooler.max_embed_len
                if pooler.enable_chunked_processing
                else (pooler.max_embed_len or max_total)
            )
        try:
            return TokenizeParams(
                max_total_tokens=max_total,
                max_output_tokens=0,
                truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=truncation_side,
                do_lower_case=(config.encoder_config or {}).get("do_lower_case", False),
                add_special_tokens=add_special_tokens,
                max_total_tokens_param="max_model_len",
            )
        except VLLMValidationError as exc:
            raise _refusal(exc, "truncate_prompt_tokens") from None

    def tokenize(
        self,
        inputs: Sequence[str | Sequence[int]],
        *,
        add_special_tokens: bool,
        truncate_prompt_tokens: int | None,
        truncation_side: Side | None,
        param: str,
    ) -> list[list[int]]:
        """Rule 3, for every input of one request (blocking: the adapter runs a
        large batch on its tokenizer thread)."""
        tok = self._tokenizer
        tp = self._tok_params(
            add_special_tokens=add_special_tokens,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            embed=True,
        )
        out: list[list[int]] = [[] for _ in inputs]
        texts: list[tuple[int, str]] = []
        where = param if len(inputs) == 1 else ""  # the 400 names the input
        i = 0
        try:
            for i, item in enumerate(inputs):
                if isinstance(item, str):
                    prompt = tp.apply_pre_tokenization(tok, {"prompt": item})
                    texts.append((i, prompt["prompt"]))
                else:
                    self._renderer.validate_token_ids(list(item), parameter=param)
                    out[i] = list(item)
            if texts:
                encoded = tok([t for _, t in texts], **tp.get_encode_kwargs())["input_ids"]
                for (j, _), ids in zip(texts, encoded, strict=True):
                    out[j] = list(ids)
            for i, ids in enumerate(out):
                checked = tp.apply_post_tokenization(tok, {"prompt_token_ids": ids})
                out[i] = list(checked["prompt_token_ids"])
        except VLLMValidationError as exc:
            raise _refusal(exc, where or f"{param}[{i}]") from None
        return out

    # -- rule 4 --------------------------------------------------------------

    def pairs(
        self,
        query: str,
        documents: Sequence[str],
        params: PoolingParams,
        *,
        truncate_prompt_tokens: int | None,
        truncation_side: Side | None,
    ) -> list[tuple[list[int], PoolingParams]]:
        """The cross-encoder's prompt for each (query, document) pair."""
        cross = self._cross
        if cross is None:
            raise SluiceError("this model is not a cross-encoder", param="model")
        tp = self._tok_params(
            add_special_tokens=True,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            embed=False,
        )
        encode = tp.get_encode_kwargs()
        out: list[tuple[list[int], PoolingParams]] = []
        try:
            for doc in documents:
                _, prompt = cross.get_score_prompt(
                    data_1=query, data_2=doc, encode_kwargs=encode, chat_template=None
                )
                tp.apply_post_tokenization(self._tokenizer, prompt)
                pair_params = params
                if types := prompt.pop("token_type_ids", None):
                    pair_params = params.clone()
                    pair_params.extra_kwargs = {
                        **(params.extra_kwargs or {}),
                        "compressed_token_type_ids": compress_token_type_ids(
                            _apply_post_tokenization_to_token_type_ids(self._tokenizer, tp, types)
                        ),
                    }
                out.append((list(prompt["prompt_token_ids"]), pair_params))
        except (VLLMValidationError, ValueError) as exc:
            raise _refusal(exc, "documents") from None
        return out


class PooledStream:
    """A pooling request's output collector, read as `Pooled` values (rule 5).

    `put` passes through (the driver puts an exception there to fail a reader);
    `get` reads vLLM's `PoolingRequestOutput` into a `Pooled`.
    """

    __slots__ = ("_collector",)

    def __init__(self, collector: Any) -> None:
        self._collector = collector

    def put(self, item: Any) -> None:
        self._collector.put(item)

    async def get(self) -> Pooled:
        out: PoolingRequestOutput = await self._collector.get()
        if out.error is not None:
            raise SluiceError(
                f"pooling failed: {out.error.message}",
                status=503 if out.error.retryable else 500,
                retry_after=5 if out.error.retryable else None,
            )
        data = out.outputs.data
        if data.dtype != torch.float32:
            data = data.float()
        return Pooled(
            data=data.reshape(-1).numpy(),
            prompt_tokens=len(out.prompt_token_ids or ()),
            num_cached_tokens=out.num_cached_tokens,
            finished=out.finished,
        )
