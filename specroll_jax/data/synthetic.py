"""Synthetic grade-school arithmetic word problems in GSM8K's style, for small models to learn.

A problem is a chain of 1 to 3 arithmetic steps over integer operands, folded left:
``v0 = operands[0]`` and ``v[i] = v[i-1] ops[i-1] operands[i]``; the answer is the last value.
A sentence template turns the chain into a 1-3 sentence question and a solution with one line per
step, GSM8K's ``#### N`` last line and no calculator annotations::

  Question: Mia has 12 apples. She gives 5 of them to Leo. How many apples does she have left?
  Answer:   Mia has 12 - 5 = 7 apples left.
            #### 7

Every number of a problem (each operand, each intermediate value and the answer) is an integer in
``[2, difficulty.max_value]``: division is always exact and subtraction never reaches 0 or below.

Splits are disjoint by construction: a problem's canonical key (template name and operands; names
and objects are decoration) is assigned to exactly one split by a hash (``split_of``), and
``generate`` only returns problems whose key belongs to the requested split. The random stream
of problem ``i`` is ``numpy.random.default_rng([seed, split, i])``, so ``generate(n)`` is a prefix
of ``generate(n + k)`` for the same seed, split and difficulty.
"""

from __future__ import annotations

import dataclasses
import hashlib
import typing

import numpy as np

from specroll_jax.data import gsm8k

SPLITS = gsm8k.SPLITS
OPS = ("+", "-", "*", "/")
MAX_STEPS = 3
MIN_VALUE = 2  # the smallest number a problem ever contains (no "1 apples")
MAX_VALUE_RANGE = (10, 1000)  # allowed Difficulty.max_value
TEST_FRACTION = 0.2  # share of canonical keys that belong to the test split
_SPLIT_SALT = b"specroll-synthetic-v1"
_MAX_TRIES = 10_000


@dataclasses.dataclass(frozen=True)
class Difficulty:
  """Which problems ``generate`` draws.

  max_steps: the most arithmetic steps a problem has (1..3); each problem draws its step count
    uniformly from the counts in 1..max_steps that have a template over ``ops``.
  max_value: the largest number (operand, intermediate value or answer) a problem contains.
  ops: the operations allowed, a subset of ("+", "-", "*", "/"); stored in that canonical order.
  """

  max_steps: int
  max_value: int
  ops: tuple[str, ...]

  def __post_init__(self):
    if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, (int, np.integer)) or \
        not 1 <= self.max_steps <= MAX_STEPS:
      raise ValueError(
          f"Difficulty.max_steps must be an int in [1, {MAX_STEPS}], got {self.max_steps!r}")
    lo, hi = MAX_VALUE_RANGE
    if isinstance(self.max_value, bool) or not isinstance(self.max_value, (int, np.integer)) or \
        not lo <= self.max_value <= hi:
      raise ValueError(f"Difficulty.max_value must be an int in [{lo}, {hi}], got "
                       f"{self.max_value!r}")
    if isinstance(self.ops, str) or not isinstance(self.ops, (tuple, list)) or not self.ops or \
        any(op not in OPS for op in self.ops):
      raise ValueError(f"Difficulty.ops must be a non-empty tuple of ops from {OPS}, got "
                       f"{self.ops!r}")
    object.__setattr__(self, "max_steps", int(self.max_steps))
    object.__setattr__(self, "max_value", int(self.max_value))
    object.__setattr__(self, "ops", tuple(op for op in OPS if op in self.ops))

  @classmethod
  def easy(cls) -> Difficulty:
    """1-2 steps of + and -, numbers up to 20."""
    return cls(max_steps=2, max_value=20, ops=("+", "-"))

  @classmethod
  def medium(cls) -> Difficulty:
    """1-2 steps of all four operations, numbers up to 100."""
    return cls(max_steps=2, max_value=100, ops=OPS)

  @classmethod
  def hard(cls) -> Difficulty:
    """1-3 steps of all four operations, numbers up to 1000."""
    return cls(max_steps=3, max_value=1000, ops=OPS)

  @classmethod
  def from_level(cls, level: int) -> Difficulty:
    """A difficulty knob for command lines: level 0 (easiest) .. ``NUM_LEVELS - 1`` (hard).

    Monotone: each level allows at least the steps, values and ops of the level below it.
    1 is ``easy()``, 2 is ``medium()``, 4 is ``hard()``.
    """
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)) or \
        not 0 <= level < NUM_LEVELS:
      raise ValueError(f"level must be an int in [0, {NUM_LEVELS - 1}], got {level!r}")
    steps, max_value, ops = _LEVELS[int(level)]
    return cls(max_steps=steps, max_value=max_value, ops=ops)


_LEVELS = (
  (1, 10, ("+", "-")),
  (2, 20, ("+", "-")),
  (2, 100, OPS),
  (3, 100, OPS),
  (3, 1000, OPS),
)
NUM_LEVELS = len(_LEVELS)


@dataclasses.dataclass(frozen=True)
class Problem(gsm8k.Example):
  """One synthetic problem: a ``gsm8k.Example`` (question, answer, gold) plus its structure.

  template: the sentence template's name. operands, ops: the chain (``len(operands) ==
  len(ops) + 1``), folded left to the answer. Use it wherever a GSM8K example goes.
  """

  template: str
  operands: tuple[int, ...]
  ops: tuple[str, ...]

  @property
  def steps(self) -> int:
    """Number of arithmetic steps (= solution lines before ``#### N``)."""
    return len(self.ops)

  @property
  def key(self) -> tuple[str, tuple[int, ...]]:
    """The canonical key: what makes two problems the same problem, whatever names they use."""
    return (self.template, self.operands)

  @property
  def example(self) -> gsm8k.Example:
    """The plain ``gsm8k.Example`` of this problem."""
    return gsm8k.Example(self.question, self.answer, self.gold)


def _apply(a: int, op: str, b: int) -> int:
  if op == "+":
    return a + b
  if op == "-":
    return a - b
  if op == "*":
    return a * b
  if op == "/":
    if b == 0 or a % b:
      raise ValueError(f"inexact division {a} / {b}")
    return a // b
  raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _values(operands: typing.Sequence[int], ops: typing.Sequence[str]) -> list[int]:
  """v0 .. v_steps of the chain."""
  if len(operands) != len(ops) + 1:
    raise ValueError(f"a chain of {len(ops)} ops needs {len(ops) + 1} operands, got "
                     f"{len(operands)}")
  values = [int(operands[0])]
  for op, b in zip(ops, operands[1:], strict=True):
    values.append(_apply(values[-1], op, int(b)))
  return values


def answer_value(problem: Problem) -> int:
  """The answer recomputed from ``problem.operands`` and ``problem.ops`` (not from its text)."""
  return _values(problem.operands, problem.ops)[-1]


def split_of(template: str, operands: typing.Sequence[int]) -> str:
  """The one split ("train" or "test") that the canonical key (template, operands) belongs to."""
  text = template + ":" + ",".join(str(int(x)) for x in operands)
  h = hashlib.blake2b(text.encode(), digest_size=8, key=_SPLIT_SALT).digest()
  return "test" if int.from_bytes(h, "big") < TEST_FRACTION * 2**64 else "train"


# ---- templates -----------------------------------------------------------------------------------

class _Template(typing.NamedTuple):
  name: str
  ops: str  # one character per step
  question: str
  lines: tuple[str, ...]  # one per step; step i writes "{v<i>} op {a<i+1>} = {v<i+1>}" (v0 = a0)


# Placeholders: {name}, {friend}, {friend2} (distinct names); {he} {He} {him} {his} for {name};
# {item}/{items}, {box}/{boxes} (containers), {gift}; {a0}..{a3} operands; {v1}..{v3} values.
_T = _Template
_TEMPLATES = (
  # ---- 1 step
  _T("add_buy", "+", "{name} has {a0} {items}. {He} buys {a1} more. How many {items} does {he} "
     "have now?", ("{name} has {a0} + {a1} = {v1} {items} now.",)),
  _T("add_days", "+", "{name} collected {a0} {items} on Monday and {a1} on Tuesday. How many "
     "{items} did {he} collect in all?", ("{name} collected {a0} + {a1} = {v1} {items} in all.",)),
  _T("add_together", "+", "{name} has {a0} {items} and {friend} has {a1} {items}. How many {items}"
     " do they have together?", ("Together they have {a0} + {a1} = {v1} {items}.",)),
  _T("add_save", "+", "{name} saved ${a0} in May and ${a1} in June. How much money did {he} save "
     "in total?", ("{name} saved {a0} + {a1} = ${v1} in total.",)),
  _T("sub_give", "-", "{name} has {a0} {items}. {He} gives {a1} of them to {friend}. How many "
     "{items} does {he} have left?", ("{name} has {a0} - {a1} = {v1} {items} left.",)),
  _T("sub_sell", "-", "A shop has {a0} {items}. It sells {a1} of them. How many {items} are left?",
     ("The shop has {a0} - {a1} = {v1} {items} left.",)),
  _T("sub_spend", "-", "{name} has ${a0}. {He} spends ${a1} on a {gift}. How much money does {he}"
     " have left?", ("{name} has {a0} - {a1} = ${v1} left.",)),
  _T("sub_compare", "-", "{name} has {a0} {items}. {friend} has {a1} {items}. How many more "
     "{items} does {name} have than {friend}?", ("{name} has {a0} - {a1} = {v1} more {items}.",)),
  _T("sub_pages", "-", "A book has {a0} pages. {name} has read {a1} pages. How many pages are "
     "left?", ("There are {a0} - {a1} = {v1} pages left.",)),
  _T("mul_boxes", "*", "{name} buys {a0} {boxes} of {items}. Each {box} holds {a1} {items}. How "
     "many {items} does {he} buy?", ("{name} buys {a0} * {a1} = {v1} {items}.",)),
  _T("mul_price", "*", "One {item} costs ${a1}. {name} buys {a0} {items}. How much does {he} pay?",
     ("{name} pays {a0} * {a1} = ${v1}.",)),
  _T("mul_days", "*", "{name} reads {a1} pages every day. How many pages does {he} read in {a0} "
     "days?", ("{name} reads {a0} * {a1} = {v1} pages.",)),
  _T("mul_rows", "*", "There are {a0} rows of chairs with {a1} chairs in each row. How many chairs "
     "are there?", ("There are {a0} * {a1} = {v1} chairs.",)),
  _T("mul_times", "*", "{friend} has {a0} {items}. {name} has {a1} times as many. How many {items}"
     " does {name} have?", ("{name} has {a0} * {a1} = {v1} {items}.",)),
  _T("div_share", "/", "{name} has {a0} {items}. {He} shares them equally among {a1} friends. How "
     "many {items} does each friend get?", ("Each friend gets {a0} / {a1} = {v1} {items}.",)),
  _T("div_pack", "/", "{name} puts {a0} {items} into {boxes} of {a1}. How many {boxes} does {he} "
     "fill?", ("{name} fills {a0} / {a1} = {v1} {boxes}.",)),
  _T("div_price", "/", "{name} pays ${a0} for {a1} {items}. Each {item} costs the same. How much "
     "does one {item} cost?", ("One {item} costs {a0} / {a1} = ${v1}.",)),
  _T("div_days", "/", "{name} reads a {a0}-page book in {a1} days, the same number of pages each "
     "day. How many pages does {he} read each day?",
     ("{name} reads {a0} / {a1} = {v1} pages each day.",)),
  # ---- 2 steps
  _T("add_sub_give", "+-", "{name} has {a0} {items}. {He} buys {a1} more and then gives {a2} to "
     "{friend}. How many {items} does {he} have now?",
     ("After buying, {name} has {a0} + {a1} = {v1} {items}.",
      "After giving some away, {he} has {v1} - {a2} = {v2} {items}.")),
  _T("add_sub_basket", "+-", "There are {a0} {items} in a basket. {name} puts in {a1} more and "
     "{friend} takes out {a2}. How many {items} are in the basket now?",
     ("With {name}'s, there are {a0} + {a1} = {v1} {items}.",
      "Now there are {v1} - {a2} = {v2} {items} in the basket.")),
  _T("sub_add_shop", "-+", "A shop has {a0} {items}. It sells {a1} and then gets {a2} more. How "
     "many {items} does it have now?",
     ("After selling, the shop has {a0} - {a1} = {v1} {items}.",
      "Then it has {v1} + {a2} = {v2} {items}.")),
  _T("sub_add_lost", "-+", "{name} had {a0} {items}. {He} lost {a1} of them and then found {a2}. "
     "How many {items} does {he} have now?",
     ("After losing some, {name} had {a0} - {a1} = {v1} {items}.",
      "Now {he} has {v1} + {a2} = {v2} {items}.")),
  _T("add_add_days", "++", "{name} collected {a0} {items} on Monday, {a1} on Tuesday and {a2} on "
     "Wednesday. How many {items} did {he} collect in all?",
     ("On Monday and Tuesday {name} collected {a0} + {a1} = {v1} {items}.",
      "In all {he} collected {v1} + {a2} = {v2} {items}.")),
  _T("add_add_gifts", "++", "{name} has {a0} {items}. {friend} gives {him} {a1} and {friend2} "
     "gives {him} {a2}. How many {items} does {name} have now?",
     ("After {friend}'s gift, {name} has {a0} + {a1} = {v1} {items}.",
      "After {friend2}'s gift, {he} has {v1} + {a2} = {v2} {items}.")),
  _T("sub_sub_spend", "--", "{name} has ${a0}. {He} spends ${a1} on a {gift} and ${a2} on lunch. "
     "How much money does {he} have left?",
     ("After the {gift}, {name} has {a0} - {a1} = ${v1}.",
      "After lunch, {he} has {v1} - {a2} = ${v2} left.")),
  _T("sub_sub_bus", "--", "A bus has {a0} people on it. At the first stop {a1} people get off, and "
     "at the second stop {a2} more get off. How many people are on the bus now?",
     ("After the first stop, there are {a0} - {a1} = {v1} people.",
      "After the second stop, there are {v1} - {a2} = {v2} people on the bus.")),
  _T("mul_sub_boxes", "*-", "{name} buys {a0} {boxes} of {items} with {a1} {items} in each. {He} "
     "gives away {a2} {items}. How many {items} does {he} have left?",
     ("{name} buys {a0} * {a1} = {v1} {items}.",
      "{He} has {v1} - {a2} = {v2} {items} left.")),
  _T("mul_add_shop", "*+", "{name} buys {a0} {items} at ${a1} each and a {gift} for ${a2}. How "
     "much does {he} spend in total?",
     ("The {items} cost {a0} * {a1} = ${v1}.",
      "In total {name} spends {v1} + {a2} = ${v2}.")),
  _T("add_mul_boxes", "+*", "{name} has {a0} red {boxes} and {a1} blue {boxes}. Each {box} holds "
     "{a2} {items}. How many {items} are there in all?",
     ("{name} has {a0} + {a1} = {v1} {boxes}.",
      "They hold {v1} * {a2} = {v2} {items}.")),
  _T("add_div_share", "+/", "{name} has {a0} {items} and {friend} has {a1}. They share them all "
     "equally among {a2} kids. How many {items} does each kid get?",
     ("Together they have {a0} + {a1} = {v1} {items}.",
      "Each kid gets {v1} / {a2} = {v2} {items}.")),
  _T("sub_div_keep", "-/", "{name} has {a0} {items}. {He} keeps {a1} and shares the rest equally "
     "among {a2} friends. How many {items} does each friend get?",
     ("{name} shares {a0} - {a1} = {v1} {items}.",
      "Each friend gets {v1} / {a2} = {v2} {items}.")),
  _T("mul_div_share", "*/", "{name} buys {a0} {boxes} of {items} with {a1} in each {box}. {He} "
     "shares them equally among {a2} friends. How many {items} does each friend get?",
     ("{name} has {a0} * {a1} = {v1} {items}.",
      "Each friend gets {v1} / {a2} = {v2} {items}.")),
  _T("div_add_share", "/+", "{name} shares {a0} {items} equally among {a1} kids, one of them "
     "{friend}. {friend} already had {a2} {items}. How many {items} does {friend} have now?",
     ("Each kid gets {a0} / {a1} = {v1} {items}.",
      "{friend} has {v1} + {a2} = {v2} {items} now.")),
  _T("div_mul_price", "/*", "At a shop, {a1} {items} cost ${a0}. How much do {a2} {items} cost?",
     ("One {item} costs {a0} / {a1} = ${v1}.",
      "So {a2} {items} cost {v1} * {a2} = ${v2}.")),
  _T("mul_mul_read", "**", "{name} reads {a0} pages an hour. {He} reads {a1} hours a day for {a2} "
     "days. How many pages does {he} read?",
     ("{name} reads {a0} * {a1} = {v1} pages a day.",
      "In {a2} days {he} reads {v1} * {a2} = {v2} pages.")),
  _T("div_sub_box", "/-", "{name} splits {a0} {items} equally into {a1} {boxes}. Then {he} takes "
     "{a2} {items} out of one {box}. How many {items} are left in that {box}?",
     ("Each {box} has {a0} / {a1} = {v1} {items}.",
      "That {box} has {v1} - {a2} = {v2} {items} left.")),
  _T("sub_mul_packs", "-*", "A pack has {a0} {items}, but {a1} of them are damaged. How many good "
     "{items} are in {a2} packs?",
     ("Each pack has {a0} - {a1} = {v1} good {items}.",
      "So {a2} packs have {v1} * {a2} = {v2} good {items}.")),
  # ---- 3 steps
  _T("add_sub_sub", "+--", "{name} has {a0} {items}. {He} buys {a1} more, gives {a2} to {friend} "
     "and loses {a3}. How many {items} does {he} have left?",
     ("After buying, {name} has {a0} + {a1} = {v1} {items}.",
      "After giving some to {friend}, {he} has {v1} - {a2} = {v2} {items}.",
      "{He} has {v2} - {a3} = {v3} {items} left.")),
  _T("mul_sub_div", "*-/", "{name} buys {a0} {boxes} of {items} with {a1} in each. {He} keeps {a2}"
     " and shares the rest equally among {a3} friends. How many {items} does each friend get?",
     ("{name} buys {a0} * {a1} = {v1} {items}.",
      "{He} shares {v1} - {a2} = {v2} {items}.",
      "Each friend gets {v2} / {a3} = {v3} {items}.")),
  _T("mul_add_sub", "*+-", "{name} buys {a0} {items} at ${a1} each and a {gift} for ${a2}. {He} "
     "has a coupon for ${a3} off. How much does {he} pay?",
     ("The {items} cost {a0} * {a1} = ${v1}.",
      "With the {gift}, the total is {v1} + {a2} = ${v2}.",
      "With the coupon, {name} pays {v2} - {a3} = ${v3}.")),
  _T("add_add_div", "++/", "{name} has {a0} {items}, {friend} has {a1} and {friend2} has {a2}. "
     "They pack them all into {boxes} of {a3}. How many {boxes} do they fill?",
     ("{name} and {friend} have {a0} + {a1} = {v1} {items}.",
      "With {friend2}'s, they have {v1} + {a2} = {v2} {items}.",
      "They fill {v2} / {a3} = {v3} {boxes}.")),
  _T("div_mul_add", "/*+", "At a shop, {a1} {items} cost ${a0}. {name} buys {a2} {items} and a "
     "{gift} for ${a3}. How much does {he} spend?",
     ("One {item} costs {a0} / {a1} = ${v1}.",
      "So {a2} {items} cost {v1} * {a2} = ${v2}.",
      "In total {name} spends {v2} + {a3} = ${v3}.")),
  _T("sub_mul_add", "-*+", "A pack has {a0} {items}, but {a1} of them are damaged. {name} buys "
     "{a2} packs and already has {a3} good {items}. How many good {items} does {he} have now?",
     ("Each pack has {a0} - {a1} = {v1} good {items}.",
      "So {a2} packs have {v1} * {a2} = {v2} good {items}.",
      "{name} has {v2} + {a3} = {v3} good {items} now.")),
  _T("mul_mul_sub", "**-", "{name} earns ${a0} an hour. {He} works {a1} hours a day for {a2} days "
     "and then spends ${a3} on a {gift}. How much money does {he} have left?",
     ("{name} earns {a0} * {a1} = ${v1} a day.",
      "In {a2} days {he} earns {v1} * {a2} = ${v2}.",
      "After the {gift}, {he} has {v2} - {a3} = ${v3} left.")),
  _T("add_mul_sub", "+*-", "{name} has {a0} red {boxes} and {a1} blue {boxes} with {a2} {items} in"
     " each. {He} gives away {a3} {items}. How many {items} does {he} have left?",
     ("{name} has {a0} + {a1} = {v1} {boxes}.",
      "They hold {v1} * {a2} = {v2} {items}.",
      "{He} has {v2} - {a3} = {v3} {items} left.")),
  _T("sub_div_add", "-/+", "{name} keeps {a1} of {his} {a0} {items} and shares the rest equally "
     "among {a2} friends. {friend}, one of them, already had {a3}. How many {items} does {friend} "
     "have now?",
     ("{name} shares {a0} - {a1} = {v1} {items}.",
      "Each friend gets {v1} / {a2} = {v2} {items}.",
      "{friend} has {v2} + {a3} = {v3} {items} now.")),
  _T("add_add_add", "+++", "{name} collected {a0} {items} on Monday, {a1} on Tuesday, {a2} on "
     "Wednesday and {a3} on Thursday. How many {items} did {he} collect in all?",
     ("On Monday and Tuesday {name} collected {a0} + {a1} = {v1} {items}.",
      "With Wednesday's, that is {v1} + {a2} = {v2} {items}.",
      "In all {he} collected {v2} + {a3} = {v3} {items}.")),
  _T("sub_sub_sub", "---", "{name} has ${a0}. {He} spends ${a1} on a {gift}, ${a2} on lunch and "
     "${a3} on a bus ticket. How much money does {he} have left?",
     ("After the {gift}, {name} has {a0} - {a1} = ${v1}.",
      "After lunch, {he} has {v1} - {a2} = ${v2}.",
      "After the ticket, {he} has {v2} - {a3} = ${v3} left.")),
)
del _T
TEMPLATE_NAMES = tuple(t.name for t in _TEMPLATES)
assert len(set(TEMPLATE_NAMES)) == len(TEMPLATE_NAMES)

_NAMES = (
  ("Tom", "he"), ("Mia", "she"), ("Sam", "he"), ("Lily", "she"), ("Ben", "he"), ("Emma", "she"),
  ("Jack", "he"), ("Ava", "she"), ("Leo", "he"), ("Zoe", "she"), ("Max", "he"), ("Anna", "she"),
  ("Noah", "he"), ("Ella", "she"), ("Omar", "he"), ("Maria", "she"), ("Ravi", "he"),
  ("Grace", "she"), ("Luis", "he"), ("Nina", "she"), ("Kai", "he"), ("Sara", "she"),
  ("John", "he"), ("Amy", "she"),
)
_PRONOUNS = {"he": ("he", "He", "him", "his"), "she": ("she", "She", "her", "her")}
_ITEMS = (
  ("apple", "apples"), ("orange", "oranges"), ("pencil", "pencils"), ("sticker", "stickers"),
  ("marble", "marbles"), ("cookie", "cookies"), ("cupcake", "cupcakes"), ("card", "cards"),
  ("shell", "shells"), ("stamp", "stamps"), ("balloon", "balloons"), ("crayon", "crayons"),
  ("egg", "eggs"), ("flower", "flowers"), ("candy", "candies"), ("muffin", "muffins"),
  ("bead", "beads"), ("peach", "peaches"), ("button", "buttons"), ("lemon", "lemons"),
)
_BOXES = (
  ("box", "boxes"), ("bag", "bags"), ("pack", "packs"), ("jar", "jars"), ("basket", "baskets"),
  ("tray", "trays"), ("crate", "crates"), ("bucket", "buckets"),
)
_GIFTS = ("hat", "game", "kite", "ball", "scarf", "lamp", "puzzle", "backpack", "book", "toy")


def _templates_for(difficulty: Difficulty) -> dict[int, list[_Template]]:
  """Eligible templates by step count (only counts that have one)."""
  by_steps: dict[int, list[_Template]] = {}
  for t in _TEMPLATES:
    if len(t.ops) <= difficulty.max_steps and all(op in difficulty.ops for op in t.ops):
      by_steps.setdefault(len(t.ops), []).append(t)
  return by_steps


def _pick(rng: np.random.Generator, seq):
  return seq[int(rng.integers(len(seq)))]


def _randint(rng: np.random.Generator, lo: int, hi: int) -> int:
  return int(rng.integers(lo, hi, endpoint=True))


def _sample_operands(rng: np.random.Generator, ops: str, max_value: int) -> tuple[int, ...] | None:
  """Operands of a chain whose every value lies in [MIN_VALUE, max_value], or None (retry)."""
  lo = MIN_VALUE
  first = ops[0]
  if first == "+":
    v = _randint(rng, lo, max_value - lo)
  elif first == "-":
    v = _randint(rng, 2 * lo, max_value)
  elif first == "*":
    v = _randint(rng, lo, max_value // lo)
  else:  # "/": a composite dividend, built from its quotient and divisor
    q = _randint(rng, lo, max_value // lo)
    v = q * _randint(rng, lo, max_value // q)
  operands = [v]
  for op in ops:
    if op == "+":
      if v > max_value - lo:
        return None
      b = _randint(rng, lo, max_value - v)
    elif op == "-":
      if v < 2 * lo:
        return None
      b = _randint(rng, lo, v - lo)
    elif op == "*":
      if v > max_value // lo:
        return None
      b = _randint(rng, lo, max_value // v)
    else:
      divisors = [d for d in range(lo, v // lo + 1) if v % d == 0]
      if not divisors:
        return None
      b = _pick(rng, divisors)
    v = _apply(v, op, b)
    operands.append(b)
  return tuple(operands)


def _render(rng: np.random.Generator, t: _Template, operands: tuple[int, ...]) -> Problem:
  values = _values(operands, tuple(t.ops))
  people = rng.permutation(len(_NAMES))[:3]
  (name, sex), (friend, _), (friend2, _) = (_NAMES[int(i)] for i in people)
  he, he_cap, him, his = _PRONOUNS[sex]
  item, items = _pick(rng, _ITEMS)
  box, boxes = _pick(rng, _BOXES)
  fields = dict(name=name, friend=friend, friend2=friend2, he=he, He=he_cap, him=him, his=his,
                item=item, items=items, box=box, boxes=boxes, gift=_pick(rng, _GIFTS))
  fields.update({f"a{i}": a for i, a in enumerate(operands)})
  fields.update({f"v{i}": v for i, v in enumerate(values) if i})
  question = t.question.format(**fields)
  lines = [line.format(**fields) for line in t.lines]
  answer = "\n".join(lines + [f"#### {values[-1]}"])
  return Problem(question=question, answer=answer, gold=str(values[-1]), template=t.name,
                 operands=operands, ops=tuple(t.ops))


def _check_int(name: str, value, lo: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
    raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
  return int(value)


def generate(n: int, *, seed: int, split: str = "train",
             difficulty: Difficulty | None = None) -> list[Problem]:
  """``n`` problems of ``split`` at ``difficulty`` (None: ``Difficulty.easy()``).

  Deterministic in (seed, split, difficulty, index); problem ``i`` does not depend on ``n``.
  Every returned problem's key satisfies ``split_of(*p.key) == split``, so the splits never share
  a problem. Problems may repeat within a split, the more often the fewer the difficulty allows.
  Raises RuntimeError when a difficulty admits (almost) no problem of ``split``.
  """
  n = _check_int("n", n, 0)
  seed = _check_int("seed", seed, 0)
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if difficulty is None:
    difficulty = Difficulty.easy()
  if not isinstance(difficulty, Difficulty):
    raise ValueError(f"difficulty must be a Difficulty, got {difficulty!r}")
  by_steps = _templates_for(difficulty)
  step_counts = sorted(by_steps)
  split_id = SPLITS.index(split)
  problems = []
  for i in range(n):
    rng = np.random.default_rng([seed, split_id, i])
    for _ in range(_MAX_TRIES):
      t = _pick(rng, by_steps[_pick(rng, step_counts)])
      operands = _sample_operands(rng, t.ops, difficulty.max_value)
      if operands is not None and split_of(t.name, operands) == split:
        problems.append(_render(rng, t, operands))
        break
    else:
      raise RuntimeError(f"no {split} problem found in {_MAX_TRIES} tries at {difficulty}: it "
                         f"allows too few distinct problems")
  return problems
