"""Words and topics for the benchmark's prompts (distinct prompts, so no prompt cache helps)."""

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
