"""Issue 43's spread of unrelated prompts: single-turn prompts with nothing to
share, of 13 lengths from 16 to 2,000 tokens.

Why it exists: the check "placement costs nothing where there is nothing to
reuse" (>= 0.98x Sluice with --no-prefix-placement) needs a load whose prompts
share no leading block, so prefix placement can only cost (a hash per block,
a lookup that finds nothing) and never help. Each prompt is random words drawn
from a `random.Random` seeded by (run, caller, turn), so a run is the same on
every machine and no two runs share a prompt; the words are single tokens of
the demo model's tokenizer with or without a leading space (checked against
its tokenizer: a prompt of n words is n tokens there), so a length in words is
one in tokens. 162 words to choose from: two prompts share their first 16 words
with odds of 162^-16 (about 2^-117). The lengths are geometric, each caller
going through all 13 in a shuffled order of its own.
"""

from __future__ import annotations

import random

# Single tokens of the demo tokenizer, bare and after a space (its corpus's
# commonest such words of 4-9 letters).
_WORDS = """
    about admission answer assistant away bank batch been better blue board body busy cache
    cannot changes chat cloudy code common condition cover data degrees demo does each eleven
    empty engine engineer error euro ever fast fastest file finish fire first fish flag float
    four free from garden gate good grams graph green group have here host humidity import
    index inter into iron know late latency later level light line lines list load local look
    made merges message messages missing model module morning name network night noon offline
    ones other over paint pane pear plain port priority prompt queue rain random read ready
    relief requests results retry river root safe scattered second seconds self service side
    sing sixth sluice starts state station stream system team text that then thing thirty
    through time token tokenizer tokens tool total town until used user value venv very wait
    waited watch watchdog water weight weights were what wheel where while window with without
    words work writes year
    """
VOCABULARY: tuple[str, ...] = tuple(_WORDS.split())
STEPS = 13
SHORTEST = 16  # tokens: one block on a GPU (vLLM's default block size)
LONGEST = 2000
# 16, 24, 36, 53, 80, 120, 179, 267, 400, 598, 894, 1337, 2000
LENGTHS: tuple[int, ...] = tuple(
    round(SHORTEST * (LONGEST / SHORTEST) ** (i / (STEPS - 1))) for i in range(STEPS)
)


def length_order(run: int, caller: int) -> list[int]:
    """The lengths one caller goes through, in its own shuffled order."""
    order = list(LENGTHS)
    random.Random(f"spread-order {run} {caller}").shuffle(order)
    return order


def spread_prompt(run: int, caller: int, turn: int) -> str:
    """Turn `turn`'s prompt of caller `caller` in run `run`: LENGTHS[...] random
    words, its length the caller's order's next (cycling)."""
    words = length_order(run, caller)[turn % STEPS]
    pick = random.Random(f"spread-prompt {run} {caller} {turn}").choice
    return " ".join(pick(VOCABULARY) for _ in range(words))
