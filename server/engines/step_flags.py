"""The engine flags Sluice sets when the user has not: a step that leaves room for a chat turn.

Why it exists: a short prompt that Sluice releases waits for the engine's next
step, and vLLM schedules its running prefills first: with no cap, a 2,000-token
prompt takes the whole 2,048-token step on CPU, and a chat turn released beside
it waits one more step (issue 21: chat TTFT p95 about 9x its alone value beside
two bulk callers). vLLM's `--long-prefill-token-threshold` caps one prompt's
chunk per step. Measured on the three-caller KV-bound case (demo model, 2 cores,
one run each): a cap of 512 with Sluice's step lookahead at 1 took chat TTFT
p95 from 153-158 ms to 32-35 ms with bulk work at vLLM's throughput (563-594
against 595 requests); a cap of 256 cost bulk work (499). So the cap is a
quarter of the step's token budget.

`--long-prefill-token-threshold-adaptive` (vLLM 0.32) floors the cap at the
budget divided by the requests queued and running, the waiting chat turn among
them: with one or two long prompts and little else, they keep larger chunks
(fewer steps), while each request, the chat turn too, still has a fair share
of the step. Sluice turns it on with the cap.

Pure: the numbers only; server/cli.py applies them and logs what it set, and
the benchmark passes the same flags to vLLM's server (bench/run/servers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# One prompt's chunk per step: this share of the step's token budget (512 of
# the 2,048 tokens vLLM's CPU backend batches per step).
PREFILL_CHUNK_SHARE = 4
# Never below one KV block of vLLM's default size: smaller chunks only add steps.
MIN_PREFILL_CHUNK = 16


@dataclass(frozen=True, slots=True)
class StepFlags:
    """The engine flags of the rule: vLLM's scheduler fields and their CLI spelling."""

    long_prefill_token_threshold: int
    long_prefill_token_threshold_adaptive: bool

    def argv(self) -> tuple[str, ...]:
        adaptive = (
            "--long-prefill-token-threshold-adaptive"
            if self.long_prefill_token_threshold_adaptive
            else "--no-long-prefill-token-threshold-adaptive"
        )
        return ("--long-prefill-token-threshold", str(self.long_prefill_token_threshold), adaptive)


def step_flags(step_tokens: int, max_model_len: int) -> StepFlags:
    """The per-prompt prefill cap for an engine that batches `step_tokens` per
    step (vLLM refuses a cap above the context)."""
    chunk = min(max(MIN_PREFILL_CHUNK, step_tokens // PREFILL_CHUNK_SHARE), max_model_len)
    return StepFlags(long_prefill_token_threshold=chunk, long_prefill_token_threshold_adaptive=True)
