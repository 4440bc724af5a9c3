"""The coding agents the suite runs against Sluice: where they come from, how they run.

tests/agents/install.py installs them from the npm registry into a cache;
tests/agents/proxy.py records what they send; tests/agents/recorded/ holds
requests recorded that way, which unit tests replay.
"""

from pathlib import Path

RECORDED = Path(__file__).resolve().parent / "recorded"
