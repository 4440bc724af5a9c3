"""Anthropic's Message Batches (issue 42): bulk work in Anthropic's shapes.

`parse` checks a create body's requests, pure; `output` maps a stored batch
to Anthropic's `MessageBatch` and a result line to its
`MessageBatchIndividualResponse`; `endpoint` is the routes. The batch itself
is an OpenAI Batch API batch over /v1/messages, run by that API's runner
(server/api/openai_batches/runner.py): one machinery, two views.
"""
