"""A built-in English text generator to train the demo tokenizer offline.

Sentences come from templates filled with everyday words, plus made-up names and terms
built from syllables (so a larger vocabulary has enough distinct words to learn), numbers,
code, chat-like turns and a little non-ASCII text (accents, CJK, emoji) so multi-byte
characters are exercised. Deterministic for a given seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

NOUNS = ["time", "year", "people", "way", "day", "man", "woman", "child", "world", "life", "hand", "part", "place", "case", "week", "company", "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea", "kid", "body", "information", "school", "face", "others", "level", "office", "door", "health", "person", "art", "war", "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education", "model", "cache", "memory", "server", "request", "token", "layer", "engine", "node", "session", "message", "answer", "garden", "river", "mountain", "forest", "window", "table", "chair", "kitchen", "coffee", "computer", "network", "library", "market", "village", "ocean", "island", "bridge", "train", "letter", "music", "picture"]
VERBS = ["ask", "become", "begin", "bring", "build", "buy", "call", "carry", "change", "choose", "come", "consider", "continue", "create", "decide", "describe", "develop", "explain", "fall", "feel", "find", "follow", "give", "grow", "happen", "hear", "help", "hold", "include", "keep", "know", "learn", "leave", "let", "like", "listen", "live", "look", "lose", "make", "meet", "move", "need", "offer", "open", "pay", "play", "provide", "put", "reach", "read", "remember", "report", "run", "say", "see", "seem", "send", "serve", "set", "show", "sit", "speak", "stand", "start", "stay", "take", "talk", "teach", "tell", "think", "try", "turn", "understand", "use", "wait", "walk", "want", "watch", "win", "write", "load", "store", "compute", "predict", "measure", "improve", "share"]
ADJECTIVES = ["good", "new", "first", "last", "long", "great", "little", "own", "other", "old", "right", "big", "high", "different", "small", "large", "next", "early", "young", "important", "few", "public", "bad", "same", "able", "simple", "quiet", "bright", "dark", "warm", "cold", "fast", "slow", "happy", "careful", "strange", "modern", "ancient", "green", "blue", "red", "golden", "silver", "gentle", "heavy", "light", "clear", "busy", "empty", "full", "final", "local", "global", "rare", "common", "useful"]
ADVERBS = ["quickly", "slowly", "carefully", "often", "never", "always", "sometimes", "quietly", "really", "almost"]
PLACES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Lisbon", "Cairo", "Lima", "Oslo", "Dublin", "Seoul", "Nairobi"]
ONSETS = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br", "cr", "dr", "fl", "gr", "kl", "pl", "pr", "sh", "st", "th", "tr", "ch"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "oa"]
CODAS = ("", "", "n", "r", "s", "l", "m", "nd", "st", "rt", "ck", "ng", "x", "th")
EXTRAS = (
    "Café au lait, s'il vous plaît. Naïve façade, déjà vu, Größe, señor, smörgåsbord.",
    "你好，世界！今天天气很好。我们一起学习。日本語のテキストも少しあります。",
    "Emoji: 😀 🚀 🌍 ✨ — “quotes” and ‘apostrophes’ … • bullets • € £ ¥ ©",
    "Ελληνικά γράμματα, русский текст, עברית, العربية, हिन्दी.",
)
CODE = (
    "def {w}(x):\n    return x * {n} + {m}\n",
    'for i in range({n}):\n    print(i, "{w}")\n',
    "if ({w} > {n}) {{ return {m}; }} else {{ {w}++; }}\n",
    '{{"{w}": {n}, "enabled": true, "ratio": 0.{m}}}\n',
    "SELECT {w} FROM table WHERE id = {n};\n",
)
TEMPLATES = (
    "The {a} {n} {v}s the {n2}.",
    "{P} said that the {n} would {v} {adv}.",
    "Why did the {a} {n} {v} in {place}?",
    "We {v} a {a} {n} every {n2}, and it {v2}s {adv}.",
    "In {year}, about {num} people lived near the {a} {n} of {place}.",
    "{P} and {P2} {v} the {n} together because the {n2} was {a}.",
    "If you {v} the {n}, the {n2} will {v2} too.",
    "There are {num} {n}s in the {a} {n2}; {P} counted them twice.",
    '"Can you {v} the {n}?" asked {P}. "Yes, I can {v2} it {adv}," said {P2}.',
    "The {term} {n} of {place} is {a}, {a2} and {adv} {a3}.",
)


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(
        rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables)
    )


def _zipf(rng: random.Random, words: tuple[str, ...] | list[str]) -> str:
    # Frequent words first: rank r chosen with probability ~ 1/r.
    idx = int(len(words) ** rng.random()) - 1
    return words[max(0, min(idx, len(words) - 1))]


def corpus(num_lines: int, seed: int = 0) -> Iterator[str]:
    """Yield ``num_lines`` lines of text."""
    rng = random.Random(seed)
    names = [_word(rng, rng.choice((2, 2, 3))).capitalize() for _ in range(3000)]
    terms = [_word(rng, rng.choice((1, 2, 2, 3))) for _ in range(20000)]
    for i in range(num_lines):
        kind = i % 20
        if kind == 17:
            yield rng.choice(EXTRAS)
            continue
        if kind == 18:
            yield rng.choice(CODE).format(
                w=_zipf(rng, terms), n=rng.randint(0, 999), m=rng.randint(0, 99)
            )
            continue
        if kind == 19:
            yield (
                f"User: how do I {rng.choice(VERBS)} a {rng.choice(NOUNS)}?\n"
                f"Assistant: First, {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} "
                f"{rng.choice(NOUNS)}. Then {rng.choice(VERBS)} it {rng.choice(ADVERBS)}."
            )
            continue
        sentences = []
        for _ in range(rng.randint(1, 4)):
            sentences.append(
                rng.choice(TEMPLATES).format(
                    a=_zipf(rng, ADJECTIVES),
                    a2=rng.choice(ADJECTIVES),
                    a3=rng.choice(ADJECTIVES),
                    n=_zipf(rng, NOUNS),
                    n2=rng.choice(NOUNS),
                    v=_zipf(rng, VERBS),
                    v2=rng.choice(VERBS),
                    adv=rng.choice(ADVERBS),
                    place=rng.choice(PLACES),
                    P=_zipf(rng, names),
                    P2=rng.choice(names),
                    term=_zipf(rng, terms),
                    year=rng.randint(1800, 2030),
                    num=rng.randint(2, 100000),
                )
            )
        yield " ".join(sentences)
