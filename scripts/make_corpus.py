"""Write the shipped training corpus ``megatrain_lightning/data/tiny_corpus.txt``.

The corpus is synthetic, original and deterministic (seeded): templated English-like text with
structure a tiny byte-level language model learns within a few hundred steps: a small, closed
vocabulary, repeated sentence frames, number words, arithmetic facts that are always right,
counting runs, days and months in order, and short stories that reuse their characters' names.

Usage::

    python scripts/make_corpus.py                 # rewrites the shipped file (~300 KB)
    python scripts/make_corpus.py --size-kb 50 --out /tmp/small.txt --seed 1
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "megatrain_lightning" / "data" / "tiny_corpus.txt"

NUMBERS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
]  # fmt: skip
NAMES = ["anna", "ben", "cora", "dev", "ella", "finn", "gina", "hugo", "iris", "jack", "lena", "milo"]
ANIMALS = ["cat", "dog", "fox", "owl", "hen", "bear", "frog", "duck", "goat", "mouse"]
COLORS = ["red", "blue", "green", "brown", "white", "black", "yellow", "grey"]
SIZES = ["small", "big", "little", "tall", "old", "young"]
PLACES = ["river", "forest", "garden", "market", "hill", "farm", "lake", "village"]
FOODS = ["apples", "pears", "berries", "seeds", "carrots", "plums", "nuts", "eggs"]
THINGS = ["ball", "box", "book", "cup", "hat", "kite", "lamp", "key", "shoe", "drum"]
VERBS = [
    ("sees", "saw"),
    ("finds", "found"),
    ("likes", "liked"),
    ("carries", "carried"),
    ("paints", "painted"),
]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = [
    "january", "february", "march", "april", "may", "june", "july", "august", "september",
    "october", "november", "december",
]  # fmt: skip
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "cloudy"]


def plural(word: str, n: int) -> str:
    if n == 1:
        return word
    if word.endswith(("x", "s")):
        return word + "es"
    return word + "s"


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def arithmetic(rng: random.Random) -> str:
    op = rng.choice(["plus", "minus", "times"])
    if op == "plus":
        a = rng.randint(0, 10)
        b = rng.randint(0, 10)
        c = a + b
    elif op == "minus":
        a = rng.randint(0, 20)
        b = rng.randint(0, a)
        c = a - b
    else:
        a = rng.randint(0, 4)
        b = rng.randint(0, 5)
        c = a * b
    return f"{NUMBERS[a]} {op} {NUMBERS[b]} is {NUMBERS[c]}."


def comparison(rng: random.Random) -> str:
    a, b = rng.sample(range(21), 2)
    word = "more" if a > b else "less"
    return f"{NUMBERS[a]} is {word} than {NUMBERS[b]}."


def counting(rng: random.Random) -> str:
    start = rng.randint(0, 14)
    length = rng.randint(3, 6)
    return "we count: " + ", ".join(NUMBERS[start : start + length]) + "."


def calendar(rng: random.Random) -> str:
    if rng.random() < 0.5:
        i = rng.randrange(len(DAYS))
        return f"after {DAYS[i]} comes {DAYS[(i + 1) % len(DAYS)]}."
    i = rng.randrange(len(MONTHS))
    return f"after {MONTHS[i]} comes {MONTHS[(i + 1) % len(MONTHS)]}."


def scene(rng: random.Random) -> str:
    verb, _ = rng.choice(VERBS)
    return (
        f"the {rng.choice(SIZES)} {rng.choice(COLORS)} {rng.choice(ANIMALS)} {verb} "
        f"the {rng.choice(COLORS)} {rng.choice(THINGS)} near the {rng.choice(PLACES)}."
    )


def counting_story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    n = rng.randint(2, 10)
    m = rng.randint(1, n)
    return (
        f"{a} has {NUMBERS[n]} {plural(thing, n)}. {a} gives {NUMBERS[m]} to {b}. "
        f"now {a} has {NUMBERS[n - m]} {plural(thing, n - m)} and {b} has {NUMBERS[m]}."
    )


def story(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    animal, other = rng.sample(ANIMALS, 2)
    place = rng.choice(PLACES)
    food = rng.choice(FOODS)
    day = rng.choice(DAYS)
    weather = rng.choice(WEATHER)
    thing = rng.choice(THINGS)
    color = rng.choice(COLORS)
    _, past = rng.choice(VERBS)
    n = rng.randint(2, 9)
    lines = [
        f"once upon a time there was {article(rng.choice(SIZES))} {animal} named {name}.",
        f"every morning {name} went to the {place} to look for {food}.",
        f"on {day} it was {weather}, and {name} {past} {article(color)} {thing}.",
        f"then {name} met {friend} the {other}.",
        f"{friend} had {NUMBERS[n]} {food} and gave {NUMBERS[n // 2]} to {name}.",
        f"{name} and {friend} became good friends. the end.",
    ]
    return " ".join(lines)


def paragraph(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.30:
        return story(rng)
    if kind < 0.45:
        return counting_story(rng)
    makers = [arithmetic, arithmetic, comparison, counting, calendar, scene, scene]
    return " ".join(rng.choice(makers)(rng) for _ in range(rng.randint(3, 6)))


def make_corpus(size_bytes: int = 300_000, seed: int = 0) -> str:
    """Return a corpus of about ``size_bytes`` ASCII bytes, the same for the same seed."""
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < size_bytes:
        text = paragraph(rng) + "\n"
        parts.append(text)
        total += len(text)
    return "".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--size-kb", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    text = make_corpus(args.size_kb * 1000, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {len(text.encode())} bytes to {args.out}")


if __name__ == "__main__":
    main()
