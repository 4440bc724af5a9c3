"""The systems the benchmark compares, by the names its records, flags and tables use.

Why it exists: the runner starts them, the points name them and every table
and panel is keyed by them; one place says which there are and how a reader
sees them.
"""

from __future__ import annotations

SLUICE = "sluice"
VLLM = "vllm"
RAW = "raw"
# Issue 27: Sluice with --no-hold-backlog, every eligible request straight to vLLM's
# queue (`--systems sluice,vllm,nohold`): what holding the backlog costs.
NOHOLD = "nohold"
SYSTEMS: tuple[str, ...] = (SLUICE, VLLM, RAW, NOHOLD)
# The systems that are Sluice, held backlog or not: its flags, /ready, its counters.
SLUICE_SYSTEMS: tuple[str, ...] = (SLUICE, NOHOLD)
SYSTEM_TITLES: dict[str, str] = {
    SLUICE: "Sluice",
    VLLM: "vLLM server",
    RAW: "raw engine",
    NOHOLD: "Sluice, no held backlog",
}
