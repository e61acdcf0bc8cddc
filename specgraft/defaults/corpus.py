"""A deterministic procedural corpus in four domains of different predictability, built from nothing but Python.

The embedded default target (:mod:`specgraft.defaults.target`) is trained on it, and ``specgraft demo`` trains
draft heads on it and evaluates them on held-out prompts drawn from it. The domains (in brackets: the committed
target's held-out perplexity and mean greedy top-1 probability, see its ``training_report.json``):

* ``arithmetic`` (1.6, 0.83): sums of two-digit numbers ``37 + 42 = 79`` (mostly without a carry in the units),
  sums worked column by column, multiplication tables, running totals and counting by a step. Digits are single
  tokens (the tokenizer splits numbers into digits) so the answers are learnable: the target gets 81% of fresh sums.
* ``records`` (2.0, 0.75): JSON lines, CSV tables, log lines and INI sections with fixed schemas, sequential ids
  and fields derived from other fields (an e-mail address from the name), with random values in between.
* ``code`` (10.3, 0.60): functions and classes of a fixed list of standard-library modules, read from the files on
  disk (not imported), with docstrings and comments stripped by an ``ast`` round trip so the formatting is uniform.
  The hardest domain to model for a 0.9M-parameter target, yet its greedy output is more predictable than prose's.
* ``prose`` (4.3, 0.54): short stories from a random grammar whose slots (determiners, adjectives, nouns, verbs,
  places) are drawn from large synonym lists, so most words are free choices: the least predictable output.

Every document is a function of ``(domain, split, seed)`` only: the generator is ``random.Random`` seeded with the
string ``"{domain}:{split}:{seed}"`` (string seeds are hashed with SHA-512, stable across Python versions), so the
``train``, ``heldout`` and ``prompt`` splits are disjoint streams for any seeds. The code domain draws from a finite
pool of chunks; each chunk belongs to exactly one split by the SHA-256 of its text, so held-out and prompt code is
never trained on. The code pool is identical on machines with the same Python minor version (the stdlib sources and
``ast.unparse`` are); missing modules are skipped.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sysconfig
import warnings
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from specgraft.errors import SpecgraftError

#: The domains, in the order reports list them.
DOMAINS: tuple[str, ...] = ("code", "arithmetic", "records", "prose")
#: Disjoint generator streams: what the target and heads train on, what perplexity is measured on, what the demo
#: prompts come from.
SPLITS: tuple[str, ...] = ("train", "heldout", "prompt")

# --- code domain ------------------------------------------------------------------------------------------------
#: Standard-library files (relative to the stdlib folder) the code domain reads: plain Python, present in 3.10-3.13.
#: Few enough (~190k tokens) that the target sees each training chunk several times and learns the idioms; a wider
#: pool left held-out code perplexity higher at the same budget (17 vs 10).
CODE_MODULES: tuple[str, ...] = (
    "textwrap.py", "colorsys.py", "heapq.py", "bisect.py", "fnmatch.py", "glob.py", "shlex.py", "string.py",
    "calendar.py", "fractions.py", "statistics.py", "queue.py", "copy.py", "operator.py", "posixpath.py",
    "genericpath.py", "ntpath.py", "sched.py", "graphlib.py", "numbers.py", "contextlib.py", "dataclasses.py",
    "functools.py", "json/encoder.py", "json/decoder.py", "csv.py", "configparser.py", "difflib.py", "pprint.py",
    "reprlib.py", "base64.py", "gettext.py", "weakref.py", "_collections_abc.py", "ipaddress.py", "datetime.py",
    "random.py", "tempfile.py", "shutil.py", "argparse.py", "cmd.py", "html/parser.py", "urllib/parse.py",
    "mimetypes.py", "plistlib.py", "timeit.py",
)
#: Chunks shorter than this are dropped (one-line helpers teach little); longer ones keep their leading statements.
CODE_MIN_CHARS = 80
CODE_MAX_CHARS = 1400
#: A class no longer than this stays one chunk; a longer one is split into its methods.
CODE_CLASS_CHARS = 900
#: SHA-256 of a chunk modulo this picks its split: residue 0 -> heldout, 1 -> prompt, the rest -> train.
CODE_SPLIT_MODULUS = 16

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


def _strip_docstrings(tree: ast.AST) -> None:
    """Remove docstrings in place (a body left empty gets ``pass``), so chunks are code, not prose."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                body.pop(0)
                if not body:
                    body.append(ast.Pass())


def _unparse_within(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, max_chars: int) -> str | None:
    """``node`` as source, keeping only as many leading body statements as fit in ``max_chars`` (still valid
    Python); None when not even the first statement fits."""
    text = ast.unparse(node)
    if len(text) <= max_chars:
        return text
    body, best = node.body, None
    lo, hi = 1, len(body) - 1  # binary search for the most leading statements that fit
    while lo <= hi:
        mid = (lo + hi) // 2
        node.body = body[:mid]
        text = ast.unparse(node)
        if len(text) <= max_chars:
            best, lo = text, mid + 1
        else:
            hi = mid - 1
    node.body = body
    return best


def _module_chunks(source: str) -> list[str]:
    """Top-level functions and (small) classes or (methods of large classes) of one module, as source text."""
    tree = ast.parse(source)
    _strip_docstrings(tree)
    chunks: list[str | None] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            chunks.append(_unparse_within(node, CODE_MAX_CHARS))
        elif isinstance(node, ast.ClassDef):
            whole = ast.unparse(node)
            if len(whole) <= CODE_CLASS_CHARS:
                chunks.append(whole)
            else:
                chunks.extend(_unparse_within(item, CODE_MAX_CHARS) for item in node.body
                              if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef))
    return [c for c in chunks if c is not None and len(c) >= CODE_MIN_CHARS]


def code_split_of(chunk: str) -> str:
    """The split a code chunk belongs to, by the SHA-256 of its text."""
    residue = int.from_bytes(hashlib.sha256(chunk.encode("utf-8")).digest()[:8], "big") % CODE_SPLIT_MODULUS
    return "heldout" if residue == 0 else "prompt" if residue == 1 else "train"


@lru_cache(maxsize=1)
def code_pool() -> dict[str, tuple[str, ...]]:
    """The code chunks of :data:`CODE_MODULES` per split (deduplicated, in file then source order).

    Cached per process: parsing the modules takes about a second and the files do not change while it runs.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pools: dict[str, list[str]] = {split: [] for split in SPLITS}
    seen: set[str] = set()
    missing = []
    for rel in CODE_MODULES:
        path = stdlib / rel
        try:
            source = path.read_text(encoding="utf-8")
            chunks = _module_chunks(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            # A trimmed or patched Python may lack a module (or ship only bytecode): the pool just gets smaller.
            missing.append(rel)
            continue
        for chunk in chunks:
            if chunk not in seen:
                seen.add(chunk)
                pools[code_split_of(chunk)].append(chunk)
    if missing:
        warnings.warn(f"code corpus: {len(missing)} stdlib modules unreadable under {stdlib} ({', '.join(missing)});"
                      " the code domain is smaller than on a full Python install", stacklevel=2)
    if not all(pools.values()):
        raise SpecgraftError(f"the code corpus is empty: no readable Python sources under {stdlib}; "
                             "use a Python installation that ships its standard library as .py files")
    return {split: tuple(chunks) for split, chunks in pools.items()}


def _code_docs(n_docs: int, rng: random.Random, split: str) -> list[str]:
    pool = list(code_pool()[split])
    docs: list[str] = []
    while len(docs) < n_docs:  # one shuffled pass per epoch, so every chunk recurs equally often
        order = pool[:]
        rng.shuffle(order)
        docs.extend(order[: n_docs - len(docs)])
    return docs


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

_PROCEDURAL: dict[str, Callable[[random.Random], str]] = {
    "arithmetic": _arithmetic_doc, "records": _records_doc, "prose": _prose_doc,
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
    if domain == "code":
        return _code_docs(n_docs, rng, split)
    make = _PROCEDURAL[domain]
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
    return "\n".join(lines[:keep])


def demo_prompts(n_per_domain: int, seed: int = 0) -> list[dict]:
    """Held-out prompts (prefixes of ``prompt``-split documents) in FastChat question shape.

    Returns ``[{"question_id": "code-0", "category": "code", "turns": [prompt]}, ...]``, ``n_per_domain`` per
    domain in :data:`DOMAINS` order. Feed the prompt text to the target as is (no chat template: the default
    target has none and was trained on raw documents).
    """
    prompts = []
    for domain in DOMAINS:
        rng = random.Random(f"{domain}:prompt-cut:{seed}")
        for i, doc in enumerate(generate_corpus(domain, n_per_domain, seed, split="prompt")):
            prompt = _prompt_cut(domain, doc, rng)
            prompts.append({"question_id": f"{domain}-{i}", "category": domain, "turns": [prompt]})
    return prompts
