"""Synthetic dialogue generator for the embedded tiny target (see scripts/make_tiny_target.py).

Every conversation is a list of chat messages whose assistant answers follow fixed, learnable rules:
step-by-step addition and subtraction, counting up and down, list operations (reverse, sort,
first/last), repeating a word, spelling a word, and questions over a small table of fictional countries.
About a quarter of the conversations have a second turn that refers back to the first ("now reverse it",
"and what about <country> ?") or asks something new.

All text is lower case with every word, number and punctuation mark separated by one space, so a
word-level tokenizer splits it losslessly and `decode(encode(text)) == text`.

Held-out split: `is_heldout(prompt)` puts ~15% of first-turn prompts (chosen by a CRC32 of the prompt
text, so the split is the same on every machine and every seed) aside. Training conversations never start
with a held-out prompt; `generate(..., split="heldout")` draws only those, so accuracy measured on them is
on prompts the target never saw.

Public entry points: `generate(n, seed, split)`, `sample_conversation(rng, task, split, ...)`,
`TASKS`, `is_heldout`, `lexicon`.
"""

from __future__ import annotations

import random
import zlib

MAX_NUMBER = 199  # every number token is 0..199

NOUNS = [
    "apple", "river", "stone", "cloud", "tiger", "candle", "garden", "pencil", "window", "rabbit",
    "mountain", "bottle", "orange", "button", "forest", "island", "ladder", "mirror", "monkey", "needle",
    "planet", "rocket", "silver", "spider", "turtle", "violin", "wagon", "yellow", "zebra", "anchor",
    "basket", "castle", "dragon", "engine", "feather", "guitar", "hammer", "jacket", "kettle", "lemon",
    "marble", "napkin", "oyster", "parrot", "quilt", "ribbon", "saddle", "tunnel", "umbrella", "velvet",
    "walnut", "cat", "dog", "sun", "moon", "book", "tree", "fish", "bird", "star",
    "boat", "lamp", "door", "ring", "shoe", "cake", "milk", "rain", "snow", "wind",
]

COUNTRIES = [
    # name, capital, flag colour, animal, food
    ("zorbia", "plimtown", "blue", "owl", "bread"),
    ("quellin", "marsk", "green", "fox", "rice"),
    ("vandor", "tesh", "red", "bear", "soup"),
    ("olmira", "kestrel", "white", "whale", "cheese"),
    ("brakka", "dunmore", "black", "wolf", "noodles"),
    ("sylvene", "aurel", "gold", "swan", "honey"),
    ("tarnis", "holloway", "purple", "eagle", "apples"),
    ("munvale", "orrin", "orange", "deer", "fish"),
    ("keldora", "vash", "grey", "horse", "beans"),
    ("pellaria", "sunreach", "pink", "dolphin", "pasta"),
    ("grendal", "mosk", "brown", "badger", "potatoes"),
    ("ishtara", "velmont", "silver", "falcon", "dates"),
    ("norvik", "halden", "blue", "seal", "salmon"),
    ("corvath", "ember", "red", "raven", "pepper"),
    ("lumeria", "glimmer", "yellow", "lion", "mangoes"),
    ("dravos", "kohl", "green", "snake", "figs"),
    ("wendmark", "brill", "white", "goat", "milk"),
    ("astoria", "calder", "black", "panther", "corn"),
    ("felmoor", "ridge", "grey", "heron", "oats"),
    ("rhunia", "tallis", "purple", "moth", "plums"),
    ("yssen", "corra", "gold", "crab", "lemons"),
    ("belmark", "ashford", "orange", "lynx", "cabbage"),
    ("ostrava", "pell", "pink", "flamingo", "berries"),
    ("tamsin", "wick", "brown", "beaver", "nuts"),
]

SYSTEM_PROMPTS = [
    "you are a helpful assistant .",
    "you are a tiny model that answers questions about numbers , lists , words and countries .",
    "answer carefully and step by step .",
]


def is_heldout(prompt: str) -> bool:
    """True for the ~15% of first-turn prompts kept out of training (stable across machines and seeds)."""
    return zlib.crc32(prompt.encode("utf-8")) % 100 < 15


def _join(items) -> str:
    return " , ".join(str(x) for x in items)


# --- answers (pure functions of the question's arguments) -------------------------------------------------

def add_answer(a: int, b: int) -> str:
    ta, ua, tb, ub = a // 10 * 10, a % 10, b // 10 * 10, b % 10
    s = a + b
    return (f"{a} = {ta} + {ua} and {b} = {tb} + {ub} . {ta} + {tb} = {ta + tb} and {ua} + {ub} = {ua + ub} . "
            f"{ta + tb} + {ua + ub} = {s} . so {a} + {b} = {s} .")


def sub_answer(a: int, b: int) -> str:
    tb, ub = b // 10 * 10, b % 10
    x = a - tb
    return f"{b} = {tb} + {ub} . {a} - {tb} = {x} and {x} - {ub} = {x - ub} . so {a} - {b} = {a - b} ."


def count_answer(a: int, b: int) -> str:
    step = 1 if b >= a else -1
    nums = " ".join(str(x) for x in range(a, b + step, step))
    word = "up" if step == 1 else "down"
    return f"sure . counting {word} from {a} to {b} : {nums} . done ."


def reverse_answer(items) -> str:
    return f"the list is {_join(items)} . in reverse order it is {_join(items[::-1])} ."


def sort_answer(nums) -> str:
    return f"the numbers are {_join(nums)} . from smallest to largest they are {_join(sorted(nums))} ."


def first_last_answer(items, which: str) -> str:
    head = f"the list is {_join(items)} ."
    if which == "first":
        return f"{head} so the first item is {items[0]} ."
    if which == "last":
        return f"{head} so the last item is {items[-1]} ."
    return f"{head} so the first item is {items[0]} and the last item is {items[-1]} ."


def repeat_answer(word: str, n: int) -> str:
    return f"ok . here is {word} {n} times : {' '.join([word] * n)} . done ."


def spell_answer(word: str, backwards: bool = False) -> str:
    letters = list(word[::-1] if backwards else word)
    how = "backwards is spelled" if backwards else "is spelled"
    return f"the word {word} {how} {' - '.join(letters)} . it has {len(word)} letters ."


FACT_FIELDS = {"capital": 1, "flag": 2, "animal": 3, "food": 4}


def fact_answer(country: tuple, field: str) -> str:
    name, capital, color, animal, food = country
    profile = (f"{name} is a country . its capital is {capital} , its flag is {color} , "
               f"its animal is the {animal} and people there eat {food} .")
    tail = {
        "capital": f"so the capital of {name} is {capital} .",
        "flag": f"so the flag of {name} is {color} .",
        "animal": f"so the animal of {name} is the {animal} .",
        "food": f"so people in {name} eat {food} .",
        "about": f"that is all i know about {name} .",
    }[field]
    return f"{profile} {tail}"


THANKS_ANSWER = ("you are welcome . i can add , subtract , count , sort , reverse , repeat and spell , "
                 "and i know about many countries .")


# --- tasks: each returns (prompt, answer, state) where state lets a follow-up refer back ----------------------

def _task_add(rng: random.Random):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    prompt = rng.choice(["what is {a} + {b} ?", "add {a} and {b} .", "compute {a} plus {b} .",
                         "what is the sum of {a} and {b} ?"]).format(a=a, b=b)
    return prompt, add_answer(a, b), {"result": a + b}


def _task_sub(rng: random.Random):
    a = rng.randint(0, 99)
    b = rng.randint(0, a)
    prompt = rng.choice(["what is {a} - {b} ?", "subtract {b} from {a} .", "compute {a} minus {b} ."]).format(a=a, b=b)
    return prompt, sub_answer(a, b), {"result": a - b}


def _task_count_up(rng: random.Random):
    n = rng.randint(6, 32)
    a = rng.randint(0, 120 - n + 1)
    b = a + n - 1
    prompt = rng.choice(["count from {a} to {b} .", "list the numbers from {a} to {b} .",
                         "please count up from {a} to {b} ."]).format(a=a, b=b)
    return prompt, count_answer(a, b), {"range": (a, b)}


def _task_count_down(rng: random.Random):
    n = rng.randint(6, 32)
    a = rng.randint(0, 120 - n + 1)
    b = a + n - 1
    prompt = rng.choice(["count down from {b} to {a} .", "list the numbers from {b} down to {a} .",
                         "please count backwards from {b} to {a} ."]).format(a=a, b=b)
    return prompt, count_answer(b, a), {"range": (b, a)}


def _task_reverse(rng: random.Random):
    items = rng.sample(NOUNS, rng.randint(3, 8))
    prompt = rng.choice(["reverse the list {l} .", "reverse this list : {l} .",
                         "what is {l} in reverse order ?"]).format(l=_join(items))
    return prompt, reverse_answer(items), {"items": items}


def _task_sort(rng: random.Random):
    nums = rng.sample(range(100), rng.randint(3, 7))
    prompt = rng.choice(["sort the numbers {l} .", "sort {l} from smallest to largest .",
                         "put {l} in increasing order ."]).format(l=_join(nums))
    return prompt, sort_answer(nums), {"items": sorted(nums)}


def _task_first_last(rng: random.Random):
    items = rng.sample(NOUNS, rng.randint(3, 8))
    which = rng.choice(["first", "last", "both"])
    prompt = {
        "first": "what is the first item of {l} ?",
        "last": "what is the last item of {l} ?",
        "both": "what are the first and last items of {l} ?",
    }[which].format(l=_join(items))
    return prompt, first_last_answer(items, which), {"items": items}


def _task_repeat(rng: random.Random):
    word, n = rng.choice(NOUNS), rng.randint(4, 16)
    prompt = rng.choice(["repeat the word {w} {n} times .", "say {w} {n} times .",
                         "write {w} {n} times ."]).format(w=word, n=n)
    return prompt, repeat_answer(word, n), {"word": word}


def _task_spell(rng: random.Random):
    word = rng.choice(NOUNS)
    prompt = rng.choice(["spell the word {w} .", "how do you spell {w} ?", "spell {w} letter by letter .",
                         "what are the letters of {w} ?"]).format(w=word)
    return prompt, spell_answer(word), {"word": word}


def _task_fact(rng: random.Random):
    country = rng.choice(COUNTRIES)
    field = rng.choice(["capital", "flag", "animal", "food", "about"])
    prompt = rng.choice({
        "capital": ["what is the capital of {c} ?", "which city is the capital of {c} ?"],
        "flag": ["what color is the flag of {c} ?", "what is the flag of {c} like ?"],
        "animal": ["what animal is the symbol of {c} ?", "which animal belongs to {c} ?"],
        "food": ["what do people eat in {c} ?", "what is the food of {c} ?"],
        "about": ["tell me about {c} .", "what do you know about {c} ?"],
    }[field]).format(c=country[0])
    return prompt, fact_answer(country, field), {"country": country, "field": field}


TASKS = {
    "add": _task_add,
    "sub": _task_sub,
    "count_up": _task_count_up,
    "count_down": _task_count_down,
    "reverse": _task_reverse,
    "sort": _task_sort,
    "first_last": _task_first_last,
    "repeat": _task_repeat,
    "spell": _task_spell,
    "fact": _task_fact,
}
# Harder, compositional tasks are drawn more often.
TASK_WEIGHTS = {"add": 3, "sub": 3, "count_up": 1, "count_down": 1, "reverse": 1, "sort": 2,
                "first_last": 1, "repeat": 1, "spell": 1, "fact": 1}


def _follow_up(rng: random.Random, task: str, state: dict):
    """A second user turn that refers back to the first, and its answer; None if the task has none."""
    if task in ("add", "sub"):
        r = state["result"]
        if r > MAX_NUMBER - 1:
            return None
        k = rng.randint(1, min(99, MAX_NUMBER - r))
        return f"now add {k} to the result .", add_answer(r, k)
    if task in ("count_up", "count_down"):
        a, b = state["range"]
        return "now count the other way .", count_answer(b, a)
    if task in ("reverse", "first_last", "sort"):
        items = state["items"]
        return "now reverse it .", reverse_answer(items)
    if task in ("spell", "repeat"):
        return "now spell it backwards .", spell_answer(state["word"], backwards=True)
    if task == "fact":
        other = rng.choice([c for c in COUNTRIES if c is not state["country"]])
        return f"and what about {other[0]} ?", fact_answer(other, state["field"])
    return None


def sample_conversation(rng: random.Random, task: str | None = None, split: str = "train",
                        two_turn_prob: float = 0.25, system_prob: float = 0.15) -> dict:
    """One conversation {"task", "messages"}; split "train" avoids held-out first prompts, "heldout" uses only
    them, "any" takes whatever comes."""
    task = task or rng.choices(list(TASK_WEIGHTS), weights=list(TASK_WEIGHTS.values()))[0]
    while True:
        prompt, answer, state = TASKS[task](rng)
        if split == "any" or is_heldout(prompt) == (split == "heldout"):
            break
    messages = []
    if rng.random() < system_prob:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    if rng.random() < two_turn_prob:
        follow = _follow_up(rng, task, state) if rng.random() < 0.7 else None
        if follow is None:
            if rng.random() < 0.3:
                follow = ("thank you .", THANKS_ANSWER)
            else:  # an unrelated second question
                p2, a2, _ = TASKS[rng.choice(list(TASKS))](rng)
                follow = (p2, a2)
        messages += [{"role": "user", "content": follow[0]}, {"role": "assistant", "content": follow[1]}]
    return {"task": task, "messages": messages}


def generate(n: int, seed: int, split: str = "train", **kw) -> list[dict]:
    """n conversations from one seeded stream (deterministic)."""
    rng = random.Random(seed)
    return [sample_conversation(rng, split=split, **kw) for _ in range(n)]


def lexicon() -> list[str]:
    """Every word the generator can emit, in a fixed order (numbers, letters, then template words)."""
    words = [str(i) for i in range(MAX_NUMBER + 1)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words += NOUNS + [w for c in COUNTRIES for w in c]
    rng = random.Random(0)
    texts = list(SYSTEM_PROMPTS) + [THANKS_ANSWER]
    for conv in generate(20000, seed=12345, split="any", two_turn_prob=0.5, system_prob=0.0):
        texts += [m["content"] for m in conv["messages"]]
    for task in TASKS:  # make sure each task's templates are all seen
        for _ in range(200):
            p, a, _ = TASKS[task](rng)
            texts += [p, a]
    for t in texts:
        words += t.split()
    seen, out = set(), []
    for w in words:
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out
