"""The benchmark's prompts: distinct essay requests from a word list (so no prompt cache helps)."""

from __future__ import annotations

import random

TOPICS = (
    "the history of bridges", "how tides work", "the economics of public libraries", "bees and pollination",
    "the invention of the printing press", "why cities grow along rivers", "the physics of bicycles",
    "the role of salt in cooking", "how glaciers shape valleys", "the first maps of the sea",
    "learning a second language as an adult", "the life of a lighthouse keeper", "how vaccines are tested",
    "the design of railway timetables", "why some forests need fire", "the craft of making violins",
)

WORDS = tuple("""
river stone harbor lantern copper meadow thunder orchard compass ledger timber granite echo valley
market signal window garden winter summer autumn spring ember canyon mirror anchor violet saddle
engine ribbon castle pepper candle marble fabric silver mountain island village forest desert ocean
kettle puzzle rocket shadow silence journey letter basket hammer needle ladder pillow tunnel vessel
harvest bakery painter sailor farmer weaver potter miller student teacher doctor builder captain
quickly slowly gently boldly quietly rarely often always never almost nearly barely simply clearly
bright narrow ancient hollow steady gentle rapid humble curious patient distant golden frozen woven
carry gather measure follow borrow listen wander settle repair divide balance travel shelter signal
question answer reason memory method pattern number border season custom wonder effort promise danger
""".split())


def build_prompt(index: int, words: int, salt: str = "") -> str:
    """A distinct essay request of about `words` words (deterministic in index and salt)."""
    rng = random.Random(f"strata-bench-{salt}-{index}")
    topic = TOPICS[index % len(TOPICS)]
    notes = " ".join(rng.choice(WORDS) for _ in range(max(0, words - 20)))
    return (f"Write an essay about {topic}. Use these notes as loose inspiration, in any order "
            f"(request {salt}{index}): {notes}")
