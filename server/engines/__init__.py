"""The engine side: what Sluice asks of an engine, and the vLLM engine that answers.

`interface.py` is the seam (the `Engine` Protocol and output types; no vLLM);
`vllm_adapter.py` implements it on one vLLM AsyncLLM and, with `vllm_parsers.py`
(vLLM's tool-call and reasoning parsers, structured outputs) and `step_flags.py`
(the engine flags Sluice sets when the user has not), is where vLLM is imported;
`driver.py` feeds one engine from the batching core; `lora.py` says which
fine-tunes run and which one a request means; `reasoning_split.py` and
`choice_reader.py` read a choice's text into reasoning, answer and tool calls;
`thread_batcher.py` batches tokenizer work onto a worker thread; `demo/` builds
the offline demo model and LoRA adapter.

Room for several engines: each is one adapter and one driver. Today the app holds
one of each (the ENGINE and DRIVER app keys, server/state.py); the model registry
(issue 30) is the one place that will know there are several.
"""
