"""Several models on CPU: unbound workers with the cores less one as OpenMP
threads (server/engines/cpu_threads.py)."""

from __future__ import annotations

from server.engines.cpu_threads import engine_env


def test_several_models_on_cpu_get_unbound_workers_with_the_cores_less_one() -> None:
    assert engine_env(2, True, 2, {}) == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    assert engine_env(3, True, 16, {})["OMP_NUM_THREADS"] == "15"
    assert engine_env(2, True, 1, {})["OMP_NUM_THREADS"] == "1"  # at least one


def test_one_model_or_a_gpu_is_left_to_vllm() -> None:
    assert engine_env(1, True, 2, {}) == {}
    assert engine_env(2, False, 16, {}) == {}


def test_the_operators_values_win() -> None:
    assert engine_env(2, True, 2, {"OMP_NUM_THREADS": "2"}) == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind"
    }
    # Bound by the operator: vLLM sets the threads from the binding itself.
    assert engine_env(2, True, 2, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) == {}
