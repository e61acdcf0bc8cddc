"""A deterministic procedural corpus in four domains of different predictability, built from nothing but Python.

The embedded default target (:mod:`specgraft.defaults.target`) is trained on it, and ``specgraft demo`` trains
draft heads on it and evaluates them on held-out prompts drawn from it. The domains (in brackets: the committed
target's held-out perplexity and mean greedy top-1 probability, see its ``training_report.json``):

* ``code`` (1.15, 0.98): Python about one entity per document (a ``User`` class with ``__init__``,
  ``__repr__``, properties, ``to_dict``; functions that total, filter, count, find, group, sort, validate, parse
  and load lists of users; ``test_`` functions whose expected values are right). Names declared once recur
  throughout, as in real code, so most tokens are copies of earlier ones: the most predictable domain. (Real
  standard-library source was tried first: at 0.9M parameters the target could not learn it (perplexity 10.3), which
  made code the least predictable domain, the opposite of what real models show.)
* ``arithmetic`` (1.58, 0.84): sums of two-digit numbers ``37 + 42 = 79`` (mostly without a carry in the
  units), sums worked column by column, multiplication tables, running totals and counting by a step. Digits are
  single tokens (the tokenizer splits numbers into digits) so the answers are learnable: the target gets 95.5% of
  fresh sums.
* ``records`` (2.02, 0.74): JSON lines, CSV tables, log lines and INI sections with fixed schemas,
  sequential ids and fields derived from other fields (an e-mail address from the name), with random values in
  between.
* ``prose`` (3.39, 0.52): short stories from a random grammar whose slots (determiners, adjectives, nouns,
  verbs, places) are drawn from large synonym lists, so most words are free choices: the least predictable output.

Every document is a function of ``(domain, split, seed)`` only: the generator is ``random.Random`` seeded with the
string ``"{domain}:{split}:{seed}"`` (string seeds are hashed with SHA-512, stable across Python versions), so the
``train``, ``heldout`` and ``prompt`` splits are disjoint streams for any seeds, and every machine generates the
same documents.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from specgraft.errors import SpecgraftError

#: The domains, in the order reports list them.
DOMAINS: tuple[str, ...] = ("code", "arithmetic", "records", "prose")
#: Disjoint generator streams: what the target and heads train on, what perplexity is measured on, what the demo
#: prompts come from.
SPLITS: tuple[str, ...] = ("train", "heldout", "prompt")

# --- arithmetic domain ------------------------------------------------------------------------------------------
#: Sums add two-digit numbers: with every digit at a fixed distance from the ``=``, a small model learns which digits
#: to add far sooner than with operands of mixed lengths.
SUM_MIN, SUM_MAX = 10, 99
#: Share of sums whose units digits carry. In the others the units add up to less than ten, so each answer digit
#: depends on one aligned pair of digits: a small model learns that within the build budget, carries take far longer.
CARRY_SHARE = 0.2
TABLE_FACTORS = (2, 12)
TABLE_LENGTH = 10
STEP_TERM_MAX = 49
COUNT_STEPS = (2, 3, 5, 10, 20)
COUNT_START_MAX = 50

# --- word lists (records and prose) -----------------------------------------------------------------------------
FIRST_NAMES = (
    "Ada", "Alan", "Amara", "Anna", "Arjun", "Bea", "Boris", "Carla", "Chen", "Dara", "David", "Elena", "Emil",
    "Fatima", "Felix", "Grace", "Hana", "Hugo", "Ines", "Ivan", "Jonas", "Julia", "Kai", "Lena", "Leo", "Lucia",
    "Maya", "Milan", "Nadia", "Noah", "Olga", "Omar", "Paula", "Pedro", "Rosa", "Sami", "Sara", "Tomas", "Vera",
    "Yuki",
)
LAST_NAMES = (
    "Adams", "Berg", "Costa", "Diaz", "Evans", "Fischer", "Garcia", "Hansen", "Ito", "Jensen", "Khan", "Lopez",
    "Moreau", "Novak", "Okafor", "Petrov", "Quinn", "Rossi", "Silva", "Tanaka", "Weber", "Young", "Zhang",
)
CITIES = (
    "Lyon", "Porto", "Oslo", "Kyoto", "Lima", "Cairo", "Dublin", "Quebec", "Seoul", "Vienna", "Austin", "Perth",
    "Nairobi", "Krakow", "Bergen", "Turin",
)
#: item -> category, so the category column is predictable from the item.
ITEMS = {
    "hammer": "tools", "wrench": "tools", "drill": "tools", "saw": "tools", "apple": "food", "bread": "food",
    "cheese": "food", "rice": "food", "lamp": "home", "chair": "home", "table": "home", "rug": "home",
    "cable": "electronics", "charger": "electronics", "mouse": "electronics", "speaker": "electronics",
}
HTTP_ROUTES = ("/users", "/orders", "/items", "/login", "/search", "/cart", "/health")
LOG_SERVICES = ("api", "auth", "db", "cache", "worker")
LOG_LEVELS = ("INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR")
SECTION_NAMES = ("server", "database", "cache", "logging", "worker")

HEROES = (
    "fox", "heron", "miller", "sailor", "girl", "boy", "old woman", "young king", "baker", "shepherd", "wolf",
    "owl", "painter", "fisherman", "princess", "tailor", "cat", "bear", "hermit", "traveller", "weaver", "crow",
    "merchant", "knight", "goat", "rabbit", "scholar", "gardener", "dragon", "toad", "blacksmith", "beekeeper",
    "widow", "soldier", "monk", "piper", "mouse", "stranger", "giant", "clockmaker", "potter", "queen", "donkey",
    "raven", "hunter", "nurse", "poet", "cook",
)
ADJECTIVES = (
    "brave", "quiet", "clever", "curious", "gentle", "restless", "proud", "tired", "cheerful", "stubborn", "shy",
    "wise", "lonely", "hungry", "honest", "wild", "patient", "careless", "kind", "bold", "nervous", "graceful",
    "clumsy", "sleepy", "fierce", "humble", "lucky", "grumpy", "tiny", "ancient", "strange", "dusty", "noisy",
    "hollow", "bright", "crooked", "gloomy", "tall", "polite", "rusty", "secret", "soft", "enormous", "foolish",
    "silent", "merry", "odd", "golden", "frozen", "busy",
)
PLACES = (
    "forest", "village", "valley", "harbour", "castle", "desert", "meadow", "mountain", "river bank", "island",
    "marsh", "city", "cave", "orchard", "lighthouse", "farm", "garden", "bridge", "tower", "market", "glacier",
    "swamp", "canyon", "library", "mill", "chapel", "well", "inn", "cellar", "kitchen", "palace", "station",
    "ferry", "school", "hill", "beach",
)
OBJECTS = (
    "lantern", "key", "map", "ring", "feather", "stone", "letter", "basket", "compass", "flute", "mirror", "boat",
    "coin", "rope", "seed", "book", "cloak", "bell", "shell", "candle", "kite", "box", "sword", "jar", "hat",
    "violin", "ladder", "blanket", "clock", "apple", "crown", "wheel", "bottle", "scarf", "drum", "spoon", "egg",
    "umbrella", "painting", "needle",
)
VERBS_PAST = (
    "found", "lost", "carried", "mended", "hid", "painted", "sold", "stole", "buried", "polished", "dropped",
    "opened", "traded", "guarded", "broke", "borrowed", "forgot", "chased", "followed", "noticed", "threw",
    "washed", "counted", "weighed", "wrapped", "tasted", "hung", "packed", "watched", "admired", "repaired",
    "shared", "kept", "remembered", "offered",
)
MOVES = (
    "walked", "ran", "wandered", "sailed", "climbed", "hurried", "crept", "rode", "flew", "swam", "danced",
    "waited", "slept", "sang", "rested", "hid", "listened", "stumbled", "marched", "drifted", "limped", "played",
    "searched", "worked",
)
ADVERBS = (
    "slowly", "quickly", "quietly", "happily", "sadly", "carefully", "bravely", "lazily", "softly", "angrily",
    "gladly", "proudly", "nervously", "patiently", "boldly", "sleepily", "gracefully", "awkwardly", "eagerly",
    "calmly", "again", "alone", "all day", "at once",
)
PREPOSITIONS = ("near", "behind", "across", "inside", "beyond", "under", "beside", "around", "through", "above", "past")
CONNECTORS = (
    "Then", "Later", "Suddenly", "Meanwhile", "After a while", "At last", "Soon", "That evening", "Still",
    "The next day", "By noon", "Without a word",
)
EXCLAMATIONS = (
    "Look at this!", "Where is my hat?", "Not again!", "We must hurry.", "What a day!", "Who is there?",
    "I told you so.", "Follow me.", "It is gone!", "Can you hear that?", "Come back!", "How lovely.",
    "I am so hungry.", "Let us go home.",
)
FEELINGS = (
    "happy", "afraid", "angry", "puzzled", "hopeful", "sad", "surprised", "calm", "jealous", "grateful", "worried",
    "proud", "ashamed", "excited", "lonely", "amazed", "bored", "sleepy", "brave", "foolish",
)
TIMES = (
    "One morning", "Long ago", "On a rainy day", "At dawn", "Late one night", "In the spring", "One winter",
    "At noon", "After the harvest", "Before the storm", "On a foggy evening", "Once upon a time",
)
WEATHER = ("rain", "snow", "wind", "fog", "sun", "storm", "frost", "heat", "thunder", "mist", "hail", "cloud")
WEATHER_VERBS = ("came", "rolled", "fell", "drifted", "stayed", "howled", "settled", "lingered", "swept", "broke")
COLOURS = (
    "red", "blue", "green", "golden", "silver", "black", "white", "purple", "grey", "orange", "yellow", "brown",
    "pink",
)
SAYS = ("said", "whispered", "shouted", "asked", "replied", "muttered", "sang", "cried", "laughed", "sighed")
ENDINGS = (
    "and that was the end of it", "and nobody ever knew why", "and the {place} was never the same",
    "and they laughed about it for years", "and the {obj} was never seen again", "and everyone went home",
    "and the {weather} stopped at last", "and a new day began",
)


def _pick(rng: random.Random, seq: tuple[str, ...]) -> str:
    return seq[rng.randrange(len(seq))]


# --- code -------------------------------------------------------------------------------------------------------

#: Entities the code domain is about: name -> fields as ``(field, kind)``, kind one of str/int/float/bool. Every
#: entity has at least one field of each kind, so every construct applies to every entity.
CODE_ENTITIES: dict[str, tuple[tuple[str, str], ...]] = {
    "user": (("name", "str"), ("email", "str"), ("age", "int"), ("active", "bool")),
    "order": (("customer", "str"), ("total", "float"), ("quantity", "int"), ("paid", "bool")),
    "item": (("name", "str"), ("price", "float"), ("stock", "int"), ("available", "bool")),
    "account": (("owner", "str"), ("balance", "float"), ("limit", "int"), ("frozen", "bool")),
    "task": (("title", "str"), ("priority", "int"), ("hours", "float"), ("done", "bool")),
    "event": (("name", "str"), ("source", "str"), ("count", "int"), ("handled", "bool")),
    "message": (("sender", "str"), ("subject", "str"), ("size", "int"), ("read", "bool")),
    "book": (("title", "str"), ("author", "str"), ("pages", "int"), ("borrowed", "bool")),
    "server": (("host", "str"), ("port", "int"), ("load", "float"), ("online", "bool")),
    "sensor": (("label", "str"), ("reading", "float"), ("errors", "int"), ("enabled", "bool")),
    "student": (("name", "str"), ("grade", "int"), ("score", "float"), ("enrolled", "bool")),
    "file": (("path", "str"), ("size", "int"), ("mode", "str"), ("hidden", "bool")),
}
#: String literals the generated tests use.
CODE_WORDS = ("alpha", "beta", "gamma", "delta", "red", "blue", "north", "south", "main", "spare", "left", "right")
#: Functions per document (after the optional class), and the share of documents that start with the class.
CODE_FUNCTIONS = (2, 4)
CODE_CLASS_SHARE = 0.7


class _CodeDoc:
    """One code document about one entity: the entity's class, then functions over lists of it, then tests.

    Names recur the way they do in real code (``users``, ``user.age``, ``total_age``), which is what makes code
    the most predictable domain for a draft model: much of it is copied from a few lines above.
    """

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.entity = _pick(rng, tuple(CODE_ENTITIES))
        fields = CODE_ENTITIES[self.entity]
        keep = sorted(rng.sample(range(len(fields)), rng.randint(3, len(fields))))
        # every kind must survive the subset: str and number and bool constructs refer to one of each
        kinds = {fields[i][1] for i in keep}
        for i, (_, kind) in enumerate(fields):
            if kind not in kinds and not (kind in ("int", "float") and kinds & {"int", "float"}):
                keep.append(i)
                kinds.add(kind)
        self.fields = [fields[i] for i in sorted(keep)]
        self.cls = "".join(part.capitalize() for part in self.entity.split("_"))
        self.many = self.entity + "s"
        #: (function, "total" or "count", field) of the functions defined so far that tests can check
        self.testable: list[tuple[str, str, str]] = []

    def field(self, *kinds: str) -> str:
        return _pick(self.rng, tuple(name for name, kind in self.fields if kind in kinds))

    def function(self, name: str, params: str, body: list[str]) -> str:
        return "\n".join([f"def {name}({params}):", *body])

    def literal(self, kind: str) -> str:
        rng = self.rng
        if kind == "str":
            return repr(_pick(rng, CODE_WORDS))
        if kind == "int":
            return str(rng.randint(1, 99))
        if kind == "float":
            return f"{rng.randint(1, 99)}.{_pick(rng, ('0', '5', '25', '75'))}"  # exact in binary: sums compare
        return _pick(rng, ("True", "False"))

    # --- the class --------------------------------------------------------------------------------------------

    def class_def(self) -> str:
        rng, names = self.rng, [name for name, _ in self.fields]
        lines = [f"class {self.cls}:", "", f"    def __init__(self, {', '.join(names)}):"]
        private = rng.random() < 0.3
        lines += [f"        self.{'_' if private else ''}{n} = {n}" for n in names]
        if private:  # properties over private attributes, with a validating setter for the numbers
            for name, kind in self.fields:
                lines += ["", "    @property", f"    def {name}(self):", f"        return self._{name}"]
                if kind in ("int", "float") and rng.random() < 0.6:
                    lines += ["", f"    @{name}.setter", f"    def {name}(self, value):", "        if value < 0:",
                              f"            raise ValueError('{name} must not be negative')",
                              f"        self._{name} = value"]
        if rng.random() < 0.7:
            shown = ", ".join(f"{n}={{self.{n}!r}}" for n in names)
            lines += ["", "    def __repr__(self):", f"        return f'{self.cls}({shown})'"]
        if rng.random() < 0.5:
            mine = ", ".join(f"self.{n}" for n in names)
            theirs = ", ".join(f"other.{n}" for n in names)
            lines += ["", "    def __eq__(self, other):", f"        if not isinstance(other, {self.cls}):",
                      "            return NotImplemented", f"        return ({mine}) == ({theirs})"]
        if rng.random() < 0.5:
            pairs = ", ".join(f"'{n}': self.{n}" for n in names)
            args = ", ".join(f"data['{n}']" for n in names)
            lines += ["", "    def to_dict(self):", f"        return {{{pairs}}}", "", "    @classmethod",
                      "    def from_dict(cls, data):", f"        return cls({args})"]
        return "\n".join(lines)

    # --- functions over a list of entities --------------------------------------------------------------------

    def total(self) -> str:
        f, e = self.field("int", "float"), self.entity
        name = f"total_{f}"
        if self.rng.random() < 0.5:
            body = [f"    return sum({e}.{f} for {e} in {self.many})"]
        else:
            body = ["    total = 0", f"    for {e} in {self.many}:", f"        total += {e}.{f}", "    return total"]
        self.testable.append((name, "total", f))
        return self.function(name, self.many, body)

    def select(self) -> str:
        f, e = self.field("bool"), self.entity
        negate = self.rng.random() < 0.3
        name = f"{'not_' if negate else ''}{f}_{self.many}"
        cond = f"not {e}.{f}" if negate else f"{e}.{f}"
        if self.rng.random() < 0.5:
            body = [f"    return [{e} for {e} in {self.many} if {cond}]"]
        else:
            body = ["    result = []", f"    for {e} in {self.many}:", f"        if {cond}:",
                    f"            result.append({e})", "    return result"]
        return self.function(name, self.many, body)

    def count(self) -> str:
        f, e = self.field("bool"), self.entity
        name = f"count_{f}"
        body = ["    count = 0", f"    for {e} in {self.many}:", f"        if {e}.{f}:", "            count += 1",
                "    return count"]
        self.testable.append((name, "count", f))
        return self.function(name, self.many, body)

    def find(self) -> str:
        f, e = self.field("str"), self.entity
        name = f"find_{e}"
        body = [f"    for {e} in {self.many}:", f"        if {e}.{f} == {f}:", f"            return {e}"]
        body.append("    return None" if self.rng.random() < 0.6 else
                    f"    raise KeyError(f'no {e} with {f} {{{f}!r}}')")
        return self.function(name, f"{self.many}, {f}", body)

    def largest(self) -> str:
        f, e = self.field("int", "float"), self.entity
        name = f"{e}_with_most_{f}"
        body = ["    best = None", f"    for {e} in {self.many}:", f"        if best is None or {e}.{f} > best.{f}:",
                f"            best = {e}", "    return best"]
        return self.function(name, self.many, body)

    def group(self) -> str:
        f, e = self.field("str", "bool"), self.entity
        name = f"group_by_{f}"
        body = ["    groups = {}", f"    for {e} in {self.many}:",
                f"        groups.setdefault({e}.{f}, []).append({e})", "    return groups"]
        return self.function(name, self.many, body)

    def sort(self) -> str:
        f, e = self.field("str", "int", "float"), self.entity
        name = f"sort_by_{f}"
        body = [f"    return sorted({self.many}, key=lambda {e}: {e}.{f}, reverse=reverse)"]
        return self.function(name, f"{self.many}, reverse=False", body)

    def check(self) -> str:
        f = self.field("int", "float")
        kind = dict(self.fields)[f]
        name = f"check_{f}"
        types = "int" if kind == "int" else "(int, float)"
        body = ["    if value is None:", f"        raise ValueError('{f} is required')",
                f"    if not isinstance(value, {types}):",
                f"        raise TypeError(f'{f} must be a number, not {{type(value).__name__}}')",
                "    if value < 0:", f"        raise ValueError(f'{f} must not be negative, got {{value}}')",
                "    return value"]
        return self.function(name, "value", body)

    def parse(self) -> str:
        e, n = self.entity, len(self.fields)
        name = f"parse_{e}"
        convert = {"str": "{}.strip()", "int": "int({})", "float": "float({})", "bool": "{} == 'yes'"}
        args = ", ".join(convert[kind].format(f"parts[{i}]") for i, (_, kind) in enumerate(self.fields))
        body = ["    parts = line.split(',')", f"    if len(parts) != {n}:",
                f"        raise ValueError(f'expected {n} fields, got {{len(parts)}}')",
                f"    return {self.cls}({args})"]
        return self.function(name, "line", body)

    def load(self) -> str:
        e = self.entity
        name = f"load_{self.many}"
        body = [f"    {self.many} = []", "    with open(path, encoding='utf-8') as f:", "        for line in f:",
                "            line = line.strip()", "            if not line or line.startswith('#'):",
                "                continue", f"            {self.many}.append(parse_{e}(line))",
                f"    return {self.many}"]
        return self.function(name, "path", body)

    def format(self) -> str:
        e = self.entity
        name = f"format_{e}"
        shown = ", ".join(f"{n}={{{e}.{n}}}" for n, _ in self.fields)
        return self.function(name, e, [f"    return f'{e} {shown}'"])

    # --- tests of what the document defined ---------------------------------------------------------------------

    def tests(self) -> list[str]:
        """``test_`` functions for the defined totals and counts, with the right expected values."""
        rng, many = self.rng, self.many
        values = [[self.literal(kind) for _, kind in self.fields] for _ in range(rng.randint(2, 3))]
        objects = ", ".join(f"{self.cls}({', '.join(v)})" for v in values)
        columns = [n for n, _ in self.fields]
        out = []
        for name, check, field in self.testable:
            column = [v[columns.index(field)] for v in values]
            if check == "total":
                expected = repr(sum(float(x) if "." in x else int(x) for x in column))
            else:
                expected = str(sum(x == "True" for x in column))
            out.append(self.function(f"test_{name}", "", [f"    {many} = [{objects}]",
                                                         f"    assert {name}({many}) == {expected}"]))
        return out

    def build(self) -> str:
        rng = self.rng
        parts = []
        has_class = rng.random() < CODE_CLASS_SHARE
        if has_class:
            parts.append(self.class_def())
        makers = [self.total, self.select, self.count, self.find, self.largest, self.group, self.sort, self.check,
                  self.format]
        if has_class:
            makers.append(self.parse)
        for make in rng.sample(makers, rng.randint(*CODE_FUNCTIONS)):
            parts.append(make())
            if make == self.parse and rng.random() < 0.6:
                parts.append(self.load())
        if has_class and rng.random() < 0.5:
            parts.extend(self.tests())
        return "\n\n\n".join(parts)


def _code_doc(rng: random.Random) -> str:
    return _CodeDoc(rng).build()


# --- arithmetic ---------------------------------------------------------------------------------------------------


def _addend(rng: random.Random, a: int, b_min: int, b_max: int) -> int:
    """A second addend for ``a`` in ``b_min..b_max`` (``b_min`` a multiple of ten, ``b_max`` ending in 9): mostly one
    whose units do not carry."""
    if rng.random() < CARRY_SHARE:
        return rng.randint(b_min, b_max)
    units = rng.randint(0, 9 - a % 10)
    return 10 * rng.randint(b_min // 10, b_max // 10) + units


def _arith_sums(rng: random.Random) -> list[str]:
    lines = []
    for _ in range(rng.randint(4, 8)):
        a = rng.randint(SUM_MIN, SUM_MAX)
        b = _addend(rng, a, SUM_MIN, SUM_MAX)
        lines.append(f"{a} + {b} = {a + b}")
    return lines


def _arith_columns(rng: random.Random) -> list[str]:
    """Sums worked column by column (units first), the way the direct sums are computed."""
    lines = []
    for _ in range(rng.randint(2, 4)):
        a = rng.randint(SUM_MIN, SUM_MAX)
        b = _addend(rng, a, SUM_MIN, SUM_MAX)
        units, tens = a % 10 + b % 10, a // 10 + b // 10 + (a % 10 + b % 10) // 10
        carry = f" + {(a % 10 + b % 10) // 10}" if units >= 10 else ""
        lines.append(f"{a} + {b}: {a % 10} + {b % 10} = {units}, {a // 10} + {b // 10}{carry} = {tens}, "
                     f"so {a} + {b} = {a + b}")
    return lines


def _arith_table(rng: random.Random) -> list[str]:
    k = rng.randint(*TABLE_FACTORS)
    return [f"Table of {k}:"] + [f"{k} x {i} = {k * i}" for i in range(1, TABLE_LENGTH + 1)]


def _arith_steps(rng: random.Random) -> list[str]:
    terms = [rng.randint(SUM_MIN, STEP_TERM_MAX)]
    for _ in range(rng.randint(2, 3)):
        terms.append(_addend(rng, sum(terms), SUM_MIN, STEP_TERM_MAX))
    head = ", ".join(str(t) for t in terms[:-1])
    lines = [f"Add {head} and {terms[-1]}."]
    total = terms[0]
    for t in terms[1:]:
        lines.append(f"{total} + {t} = {total + t}")
        total += t
    lines.append(f"The total is {total}.")
    return lines


def _arith_count(rng: random.Random) -> list[str]:
    step, start = COUNT_STEPS[rng.randrange(len(COUNT_STEPS))], rng.randint(0, COUNT_START_MAX)
    seq = ", ".join(str(start + step * i) for i in range(rng.randint(6, 10)))
    return [f"Count by {step} from {start}: {seq}."]


_ARITH_BLOCKS: tuple[Callable[[random.Random], list[str]], ...] = (
    _arith_sums, _arith_sums, _arith_sums, _arith_sums, _arith_columns, _arith_columns, _arith_table, _arith_steps,
    _arith_steps, _arith_count,
)


def _arithmetic_doc(rng: random.Random) -> str:
    blocks = ["\n".join(_ARITH_BLOCKS[rng.randrange(len(_ARITH_BLOCKS))](rng)) for _ in range(rng.randint(2, 4))]
    return "\n\n".join(blocks)


# --- records ------------------------------------------------------------------------------------------------------


def _records_people(rng: random.Random) -> str:
    start = rng.randint(100, 900)
    lines = []
    for i in range(rng.randint(3, 6)):
        first, last = _pick(rng, FIRST_NAMES), _pick(rng, LAST_NAMES)
        lines.append(
            f'{{"id": {start + i}, "name": "{first} {last}", "age": {rng.randint(18, 80)}, '
            f'"city": "{_pick(rng, CITIES)}", "email": "{first.lower()}.{last.lower()}@example.org"}}'
        )
    return "\n".join(lines)


def _records_inventory(rng: random.Random) -> str:
    start = rng.randint(1, 90)
    items = tuple(ITEMS)
    lines = ["sku,item,category,price,stock"]
    for i in range(rng.randint(4, 8)):
        item = _pick(rng, items)
        lines.append(f"SKU-{start + i:04d},{item},{ITEMS[item]},{rng.randint(1, 99)}.{rng.choice((0, 50, 99)):02d},"
                     f"{rng.randint(0, 200)}")
    return "\n".join(lines)


def _records_log(rng: random.Random) -> str:
    day, hour, minute, second = rng.randint(1, 28), rng.randint(0, 22), rng.randint(0, 59), rng.randint(0, 59)
    lines = []
    for _ in range(rng.randint(4, 8)):
        second += rng.randint(1, 20)
        minute, second = minute + second // 60, second % 60
        hour, minute = hour + minute // 60, minute % 60
        route = _pick(rng, HTTP_ROUTES)
        status = 200 if rng.random() < 0.8 else rng.choice((404, 500))
        lines.append(f"2024-03-{day:02d} {hour:02d}:{minute:02d}:{second:02d} {_pick(rng, LOG_LEVELS)} "
                     f"{_pick(rng, LOG_SERVICES)}: GET {route} {status} {rng.randint(2, 400)}ms")
    return "\n".join(lines)


def _records_ini(rng: random.Random) -> str:
    sections = []
    for name in rng.sample(SECTION_NAMES, rng.randint(2, 3)):
        sections.append(
            f"[{name}]\nhost = 10.0.{rng.randint(0, 9)}.{rng.randint(1, 254)}\nport = {rng.randint(1000, 9999)}\n"
            f"enabled = {rng.choice(('true', 'false'))}\ntimeout = {rng.randint(1, 60)}"
        )
    return "\n\n".join(sections)


_RECORD_KINDS: tuple[Callable[[random.Random], str], ...] = (
    _records_people, _records_inventory, _records_log, _records_ini,
)


def _records_doc(rng: random.Random) -> str:
    return _RECORD_KINDS[rng.randrange(len(_RECORD_KINDS))](rng)


# --- prose --------------------------------------------------------------------------------------------------------

#: Sentence shapes of the story grammar. Every ``{slot}`` is drawn afresh where it occurs (noun phrases get a random
#: determiner and an optional adjective), so most words are free choices: the least predictable domain.
PROSE_SHAPES: tuple[str, ...] = (
    "{conn}{np} {vt} {thing} {pp}.",
    "{conn}{np} {vi} {adv} {pp}.",
    "\"{exclaim}\" {say} {np}{adv_tail}.",
    "{conn}the {weather} {vi_weather} {pp}, and {np} felt {feeling}.",
    "{name} the {noun} {vt} {thing} and {vi} {adv}.",
    "{np} was {feeling} because {thing} was {colour}.",
    "{conn}{np} {vi} {pp} with {thing}.",
    "Nobody {pp} had ever seen such a {adj}{obj}.",
    "{np} {vt} {thing}, then {vt} {thing} {pp}.",
    "{conn}{np} and {np} {vi} {adv}.",
    "{np} wanted {thing}, but {np} {vt} it {pp}.",
    "{conn}{np} told {np} about {thing} {pp}.",
)
DETERMINERS = ("the", "the", "a", "that", "this", "one", "his", "her", "their", "every")


def _maybe(rng: random.Random, text: str) -> str:
    return text if rng.random() < 0.5 else ""


def _quoted(line: str) -> str:
    """A line as quoted before ``said ...``: a final full stop becomes a comma (``"We must go," said``)."""
    return line[:-1] + "," if line.endswith(".") else line


def _noun_phrase(rng: random.Random, nouns: tuple[str, ...], hero: str | None = None) -> str:
    noun = hero if hero is not None and rng.random() < 0.4 else _pick(rng, nouns)  # the protagonist recurs
    return f"{_pick(rng, DETERMINERS)} {_maybe(rng, _pick(rng, ADJECTIVES) + ' ')}{noun}"


#: slot -> filler(rng, hero); called once per occurrence.
_PROSE_SLOTS: dict[str, Callable[[random.Random, str], str]] = {
    "conn": lambda rng, hero: _maybe(rng, _pick(rng, CONNECTORS) + ", "),
    "np": lambda rng, hero: _noun_phrase(rng, HEROES, hero),
    "thing": lambda rng, hero: _noun_phrase(rng, OBJECTS),
    "pp": lambda rng, hero: f"{_pick(rng, PREPOSITIONS)} {_noun_phrase(rng, PLACES)}",
    "adj": lambda rng, hero: _maybe(rng, _pick(rng, ADJECTIVES) + " "),
    "noun": lambda rng, hero: _pick(rng, HEROES),
    "obj": lambda rng, hero: _pick(rng, OBJECTS),
    "vt": lambda rng, hero: _pick(rng, VERBS_PAST),
    "vi": lambda rng, hero: _pick(rng, MOVES),
    "adv": lambda rng, hero: _pick(rng, ADVERBS),
    "adv_tail": lambda rng, hero: _maybe(rng, " " + _pick(rng, ADVERBS)),
    "say": lambda rng, hero: _pick(rng, SAYS),
    "exclaim": lambda rng, hero: _quoted(_pick(rng, EXCLAMATIONS)),
    "weather": lambda rng, hero: _pick(rng, WEATHER),
    "vi_weather": lambda rng, hero: _pick(rng, WEATHER_VERBS),
    "feeling": lambda rng, hero: _pick(rng, FEELINGS),
    "name": lambda rng, hero: _pick(rng, FIRST_NAMES),
    "colour": lambda rng, hero: _pick(rng, COLOURS),
}
_SLOT = re.compile(r"\{(\w+)\}")


def _prose_sentence(rng: random.Random, hero: str) -> str:
    shape = PROSE_SHAPES[rng.randrange(len(PROSE_SHAPES))]
    sentence = _SLOT.sub(lambda m: _PROSE_SLOTS[m[1]](rng, hero), shape)
    return sentence[0].upper() + sentence[1:]


def _prose_doc(rng: random.Random) -> str:
    hero, home = _pick(rng, HEROES), _pick(rng, PLACES)  # the story's protagonist and home recur
    sentences = [f"{_pick(rng, TIMES)}, there was a {_pick(rng, ADJECTIVES)} {hero} who lived in a {home}."]
    sentences.extend(_prose_sentence(rng, hero) for _ in range(rng.randint(4, 7)))
    ending = _pick(rng, ENDINGS).format(place=home, obj=_pick(rng, OBJECTS), weather=_pick(rng, WEATHER))
    sentences.append(f"In the end the {hero} went back to the {home}, {ending}.")
    return _ARTICLE.sub(r"\1\2n \3", " ".join(sentences))


#: "a" before a vowel -> "an" (the shapes write "a {adj}{noun}" whatever the word).
_ARTICLE = re.compile(r"(^|[\s\"])([aA]) ([aeiou])")


# --- public API ---------------------------------------------------------------------------------------------------

_GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "code": _code_doc, "arithmetic": _arithmetic_doc, "records": _records_doc, "prose": _prose_doc,
}


def _check(domain: str, split: str, n: int) -> None:
    if domain not in DOMAINS:
        raise SpecgraftError(f"unknown corpus domain {domain!r}; use one of {', '.join(DOMAINS)}")
    if split not in SPLITS:
        raise SpecgraftError(f"unknown corpus split {split!r}; use one of {', '.join(SPLITS)}")
    if n < 0:
        raise SpecgraftError(f"the number of documents must be >= 0, got {n}; pass a non-negative count")


def generate_corpus(domain: str, n_docs: int, seed: int, *, split: str = "train") -> list[str]:
    """``n_docs`` documents of ``domain``; the same ``(domain, n_docs, seed, split)`` always gives the same list.

    A longer request extends a shorter one with the same seed (the first documents agree). Splits are disjoint
    streams: ``heldout`` and ``prompt`` documents never come from the ``train`` stream.
    """
    _check(domain, split, n_docs)
    rng = random.Random(f"{domain}:{split}:{seed}")
    make = _GENERATORS[domain]
    return [make(rng) for _ in range(n_docs)]


def _prompt_cut(domain: str, doc: str, rng: random.Random) -> str:
    """A prefix of ``doc`` ending where the training text's tokenisation ends too (before a space or newline).

    Arithmetic prompts end after ``= `` so the model answers a sum; the others end at a line or word end.
    """
    if domain == "arithmetic":
        ends = [i + 2 for i in range(len(doc)) if doc.startswith("= ", i)]
        return doc[: ends[rng.randrange(len(ends))]] if ends else doc
    if domain == "prose":
        ends = [i for i, ch in enumerate(doc) if ch == " " and i > len(doc) // 4]
        return doc[: ends[rng.randrange(min(len(ends), 6))]] if ends else doc
    lines = doc.split("\n")
    keep = max(1, min(len(lines) - 1, 1 + rng.randrange(max(1, len(lines) // 2))))
    while keep > 1 and not lines[keep - 1].strip():  # end on a line with text, not between blocks
        keep -= 1
    return "\n".join(lines[:keep])


def prompt_cuts(domain: str, n_docs: int, seed: int, *, split: str = "prompt") -> list[str]:
    """Prefixes of ``generate_corpus(domain, n_docs, seed, split=split)``, cut where a demo prompt is cut
    (:func:`_prompt_cut`, with its own generator seeded from ``"{domain}:{split}-cut:{seed}"``)."""
    rng = random.Random(f"{domain}:{split}-cut:{seed}")
    return [_prompt_cut(domain, doc, rng) for doc in generate_corpus(domain, n_docs, seed, split=split)]


def demo_prompts(n_per_domain: int, seed: int = 0) -> list[dict]:
    """Held-out prompts (prefixes of ``prompt``-split documents) in FastChat question shape.

    Returns ``[{"question_id": "code-0", "category": "code", "turns": [prompt]}, ...]``, ``n_per_domain`` per
    domain in :data:`DOMAINS` order. Feed the prompt text to the target as is (no chat template: the default
    target has none and was trained on raw documents).
    """
    return [{"question_id": f"{domain}-{i}", "category": domain, "turns": [prompt]}
            for domain in DOMAINS for i, prompt in enumerate(prompt_cuts(domain, n_per_domain, seed))]
