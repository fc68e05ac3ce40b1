"""The instruction prompt set of the default model's EAGLE-3 head (`data/instruct_prompts.jsonl`).

Self-distillation needs prompts, not answers: the head learns from the target's own replies to
them (`benchmarks/build_family.py --family smollm2`). The set is built from task templates over
topics, deterministically, so anyone can rebuild and extend it; the held-out split uses topics
and templates that no training prompt uses, so acceptance measured on it is not memorized.

    python -m specserve.train.instruct_prompts   # rewrites specserve/data/instruct_prompts.jsonl
"""

from __future__ import annotations

import json
import os
import random

# (template, kind): {t} is a topic of that kind.
TEMPLATES = [
    ("Explain {t} in simple terms.", "concept"),
    ("What is {t}? Give a short example.", "concept"),
    ("Give me three key facts about {t}.", "concept"),
    ("Write a short paragraph introducing {t} to a beginner.", "concept"),
    ("What are the main advantages and disadvantages of {t}?", "concept"),
    ("Summarize the history of {t} in a few sentences.", "concept"),
    ("How would you explain {t} to a ten-year-old?", "concept"),
    ("List five common misconceptions about {t}.", "concept"),
    ("Write a Python function that {t}.", "code"),
    ("Write a Python function that {t}, with a docstring and a usage example.", "code"),
    ("How do I write a function that {t} in Python? Explain the code.", "code"),
    ("Write a JavaScript function that {t}.", "code"),
    ("Write a short, well-commented Python script that {t}.", "code"),
    ("Give me three tips for {t}.", "activity"),
    ("What is a good way to get started with {t}?", "activity"),
    ("Write a step-by-step guide to {t}.", "activity"),
    ("What are common mistakes people make when {t}?", "activity"),
    ("Write a short poem about {t}.", "thing"),
    ("Write a haiku about {t}.", "thing"),
    ("Write a short story of about 100 words about {t}.", "thing"),
    ("Describe {t} in three sentences.", "thing"),
    ("Write a product description for {t}.", "thing"),
]
HELDOUT_TEMPLATES = [
    ("Can you tell me what {t} is and why it matters?", "concept"),
    ("Please write a Python function that {t}, and explain how it works.", "code"),
    ("I want to learn {t}. Where should I begin?", "activity"),
    ("Write a limerick about {t}.", "thing"),
]
TOPICS = {
    "concept": [
        "photosynthesis",
        "gravity",
        "machine learning",
        "inflation",
        "the water cycle",
        "black holes",
        "democracy",
        "the immune system",
        "blockchain",
        "climate change",
        "recursion",
        "supply and demand",
        "DNA",
        "the internet",
        "electric circuits",
        "the French Revolution",
        "compound interest",
        "plate tectonics",
        "vaccines",
        "operating systems",
        "binary numbers",
        "evolution",
        "renewable energy",
        "neural networks",
        "the stock market",
        "the Roman Empire",
        "quantum computing",
        "encryption",
        "volcanoes",
        "the Pythagorean theorem",
        "object-oriented programming",
        "hash tables",
        "sleep",
        "the solar system",
        "nutrition",
        "probability",
        "cloud computing",
        "the printing press",
        "ocean tides",
        "magnetism",
    ],
    "code": [
        "reverses a string",
        "checks whether a number is prime",
        "computes the factorial of n",
        "returns the n-th Fibonacci number",
        "removes duplicates from a list",
        "counts the words in a sentence",
        "checks whether a string is a palindrome",
        "finds the largest element in a list",
        "merges two sorted lists",
        "converts Celsius to Fahrenheit",
        "sorts a list of dictionaries by a key",
        "flattens a nested list",
        "computes the average of a list of numbers",
        "reads a CSV file and prints each row",
        "validates an email address",
        "generates a random password",
        "counts the vowels in a string",
        "finds the greatest common divisor of two numbers",
        "implements binary search",
        "transposes a matrix",
        "capitalizes every word in a string",
        "computes a running sum",
        "checks whether two strings are anagrams",
        "returns the prime factors of a number",
        "implements bubble sort",
        "finds the second largest number in a list",
        "converts a decimal number to binary",
        "parses a date string",
        "groups words by their first letter",
        "computes the median of a list",
    ],
    "activity": [
        "learning a new language",
        "running a marathon",
        "saving money",
        "public speaking",
        "learning to code",
        "growing tomatoes",
        "writing a resume",
        "studying for exams",
        "cooking pasta",
        "starting a small business",
        "meditating",
        "taking better photos",
        "staying productive while working from home",
        "planning a trip",
        "learning the guitar",
        "keeping a journal",
        "making new friends in a new city",
        "baking bread",
        "reading more books",
        "giving constructive feedback",
    ],
    "thing": [
        "the ocean",
        "autumn leaves",
        "a city at night",
        "a cup of coffee",
        "the moon",
        "a lighthouse",
        "an old library",
        "mountains in winter",
        "a thunderstorm",
        "a garden",
        "a robot learning to paint",
        "a lost cat",
        "the first day of school",
        "a train journey",
        "a smartphone",
        "a pair of running shoes",
        "a desert at sunrise",
        "friendship",
        "a quiet morning",
        "a busy market",
    ],
}
# Topics only the held-out split uses.
HELDOUT_TOPICS = {
    "concept": ["entropy", "the Silk Road", "relational databases", "antibiotics"],
    "code": [
        "counts how often each character appears in a string",
        "rotates a list by k positions",
        "checks whether a year is a leap year",
        "finds the longest word in a sentence",
    ],
    "activity": ["learning to swim", "organizing a small event"],
    "thing": ["a snowy forest", "a bicycle"],
}


def build(seed: int = 0) -> list[dict[str, str]]:
    """Every (template, topic) pair of the training split plus the held-out split, shuffled."""
    rows = [
        {"prompt": tpl.format(t=t), "split": "train"}
        for tpl, kind in TEMPLATES
        for t in TOPICS[kind]
    ]
    held = [
        {"prompt": tpl.format(t=t), "split": "heldout"}
        for tpl, kind in HELDOUT_TEMPLATES
        for t in HELDOUT_TOPICS[kind] + TOPICS[kind][:2]
    ]
    random.Random(seed).shuffle(rows)
    return rows + held


def write(path: str | None = None) -> str:
    from specserve.data import DATA_DIR

    path = path or os.path.join(DATA_DIR, "instruct_prompts.jsonl")
    with open(path, "w") as f:
        for row in build():
            f.write(json.dumps(row) + "\n")
    return path


if __name__ == "__main__":
    print(write())
