"""The built-in text corpus the workloads draw their prompts from, and the helpers that compose it.

A small, fixed corpus (a library assistant's system prompt, everyday sentences, topics, questions,
follow-ups, story openings, names) so that a seed fully decides a workload's text.
"""

from __future__ import annotations

import random


# -- corpus -----------------------------------------------------------------------------------

SYSTEM_SENTENCES: tuple[str, ...] = (
    "You are Quill, the assistant of a small public library in a harbour town.",
    "You answer questions from visitors about books, local history, science and everyday practical matters.",
    "Keep every answer short, friendly and concrete, and prefer plain words over jargon.",
    "When a question is ambiguous, say which reading you chose before you answer it.",
    "If you do not know something, say so plainly and suggest where in the library the visitor could look.",
    "Never invent titles, authors, dates or quotations; it is better to admit a gap than to guess.",
    "The library opens at nine in the morning and closes at six in the evening, except on Sundays.",
    "Its reading room faces the harbour, its archive keeps ship logs from the last two centuries, "
    "and its workshop lends tools as well as books.",
    "Visitors range from school children doing homework to retired sailors tracing old voyages.",
    "Adapt the depth of an answer to the visitor: one example is often worth more than three definitions.",
    "Use metric units, and give both the metric and the imperial value when a visitor uses imperial units.",
    "When you list steps, number them, and keep each step to a single sentence.",
    "Do not give medical, legal or financial advice beyond pointing to the right kind of professional.",
    "End an answer with a question only when you really need more information to help.",
)
DEFAULT_SYSTEM_PROMPT = " ".join(SYSTEM_SENTENCES)

SENTENCES: tuple[str, ...] = (
    "The tide in the harbour rises twice a day, and the fishing boats leave an hour before high water.",
    "Sourdough bread rises slowly because wild yeast works more gently than the yeast sold in packets.",
    "A glacier moves only a few centimetres a day, yet over centuries it can carve a whole valley.",
    "Honey bees tell each other where flowers are by dancing in a figure of eight inside the hive.",
    "The old lighthouse keeper wrote the weather into his log every four hours for thirty-one years.",
    "A violin's top plate is usually spruce, chosen because it is light and stiff along the grain.",
    "Compilers turn source code into machine instructions, and good ones reorder work to keep the processor busy.",
    "Cast iron pans hold heat well, which is why they sear meat better than thin aluminium ones.",
    "Night trains were popular again after travellers noticed how much time a sleeping berth saves.",
    "Chess openings have names like the Sicilian Defence and the Queen's Gambit that go back centuries.",
    "A suspension bridge hangs its deck from cables that pass over tall towers and anchor in the ground.",
    "Moss grows on the shady side of trees and walls, where the surface stays damp for longest.",
    "The first public libraries lent books for free so that workers could study in the evenings.",
    "Salt marshes protect the coast by slowing waves down before they reach the dunes.",
    "A cache keeps recently used data close at hand so the next request does not have to fetch it again.",
    "Paper made from cotton rags lasts far longer than paper made from wood pulp.",
    "Swallows fly thousands of kilometres south each autumn and often return to the same barn in spring.",
    "The town's clock tower was rebuilt after a storm in the winter of the great flood.",
    "Fermenting cabbage with salt produces sauerkraut, which keeps for months in a cool cellar.",
    "Old maps often show sea monsters in the empty corners where the mapmakers had no information.",
    "Tomatoes ripen faster next to bananas because bananas release a gas called ethylene.",
    "A well-tuned bicycle chain needs a drop of oil on each link and a wipe to remove the excess.",
    "Telescopes gather light with a large lens or mirror, so a wider one shows fainter stars.",
    "The market square fills with stalls on Saturdays, selling cheese, apples, rope and second-hand books.",
    "Knots used by sailors, like the bowline, are chosen because they hold well and untie easily.",
    "Rain gauges are simple cylinders, but they must stand away from walls and trees to read correctly.",
    "A sonnet has fourteen lines, and its turn of thought usually comes after the eighth line.",
    "Beeswax candles burn longer and cleaner than paraffin ones, though they cost more.",
    "The ferry to the island runs every two hours in summer and twice a day in winter.",
    "Learning a language is easier with short daily practice than with one long session a week.",
    "A compass needle points to magnetic north, which drifts slowly away from the geographic pole.",
    "Clay pots keep water cool because a little of it seeps through and evaporates from the surface.",
    "The museum's oldest exhibit is a carved wooden anchor pulled from the mud during dredging.",
    "Wind turbines turn their blades to face the wind and stop themselves when gusts become too strong.",
    "A good index at the back of a book saves the reader more time than any table of contents.",
    "Seaweed was once burned to make soda ash, which glassmakers needed to melt sand.",
    "In a relay race the baton must be passed inside a marked zone, or the team is disqualified.",
    "Owls can turn their heads much further than people because their necks have twice as many bones.",
    "Printing presses spread quickly because one press could do in a day what a scribe did in a year.",
    "Frost forms on clear nights because heat escapes into the open sky without clouds to hold it in.",
)

TOPICS: tuple[str, ...] = (
    "the tides", "sourdough starters", "glaciers", "bee dances", "lighthouses", "violin making", "compilers",
    "cast iron cooking", "night trains", "chess openings", "suspension bridges", "salt marshes",
    "paper making", "bird migration", "fermentation", "old sea charts", "ripening fruit", "bicycle repair",
    "telescopes", "sailors' knots", "rain gauges", "sonnets", "candle making", "magnetic compasses",
    "wind turbines", "book indexes", "glass making", "owls", "printing presses", "frost",
)

QUESTIONS: tuple[str, ...] = (
    "Can you explain how {topic} work, in simple words?",
    "What is the most surprising fact you know about {topic}?",
    "I am writing a school report on {topic}. Where should I start?",
    "Could you give me three quick tips about {topic}?",
    "What did people get wrong about {topic} a hundred years ago?",
    "Which books in the library would help me understand {topic}?",
    "Why do so many visitors ask about {topic}?",
    "How would you describe {topic} to a seven year old?",
    "What is one small experiment I can do at home about {topic}?",
    "Is there a connection between {topic} and the harbour town?",
)

FOLLOW_UPS: tuple[str, ...] = (
    "Thanks. Can you say a bit more about the second point?",
    "That helps. Is there a simpler example?",
    "I see. What would you read first, if you had only one evening?",
    "Interesting. How does that compare with {topic}?",
    "Could you sum that up in one sentence?",
    "And what is a common mistake people make with {topic}?",
    "Good. Can you suggest a question I could ask the librarian about {topic}?",
)

STORIES: tuple[str, ...] = (
    "A retired sailor finds a ship's log in the library archive that ends in the middle of a sentence.",
    "Two children borrow a telescope from the workshop and see a light on the island where nobody lives.",
    "The lighthouse keeper's cat goes missing on the night of the first winter storm.",
    "A baker discovers that her grandmother's sourdough starter is older than the town's clock tower.",
    "A visitor returns a book forty years late, with a pressed flower and a map tucked inside.",
    "The ferry is cancelled, and six strangers spend the evening in the library reading room.",
)

NAMES: tuple[str, ...] = ("Ada", "Bram", "Cleo", "Dev", "Esme", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kiri",
                          "Lev", "Mina", "Nils", "Oona", "Pavel")


def _question(rng: random.Random) -> str:
    return rng.choice(QUESTIONS).format(topic=rng.choice(TOPICS))


def _message(rng: random.Random, context_sentences: int) -> str:
    """A user message: a few corpus sentences of context, then a question."""
    context = rng.sample(SENTENCES, context_sentences)
    return " ".join([*context, _question(rng)])


def _follow_up(rng: random.Random) -> str:
    return rng.choice(FOLLOW_UPS).format(topic=rng.choice(TOPICS))


def _passage(rng: random.Random, n_words: int) -> str:
    """Paragraphs of corpus sentences (each used once before any repeats) with at least n_words words."""
    sentences: list[str] = []
    order: list[str] = []
    words = 0
    while words < n_words:
        if not order:
            order = rng.sample(SENTENCES, len(SENTENCES))
        sentences.append(order.pop())
        words += len(sentences[-1].split())
    paragraphs = []
    while sentences:
        k = rng.randint(3, 6)
        paragraphs.append(" ".join(sentences[:k]))
        sentences = sentences[k:]
    return "\n\n".join(paragraphs)
