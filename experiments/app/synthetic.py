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

from app import synthetic_templates as _tpl
from specroll_jax._fields import check_int, int_arg
from specroll_jax.data import gsm8k

TEMPLATE_NAMES = _tpl.TEMPLATE_NAMES

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
    check_int(self, "max_steps", 1, MAX_STEPS)
    check_int(self, "max_value", *MAX_VALUE_RANGE)
    if isinstance(self.ops, str) or not isinstance(self.ops, (tuple, list)) or not self.ops or \
        any(op not in OPS for op in self.ops):
      raise ValueError(f"Difficulty.ops must be a non-empty tuple of ops from {OPS}, got "
                       f"{self.ops!r}")
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
    steps, max_value, ops = _LEVELS[int_arg(level, "level", 0, NUM_LEVELS - 1)]
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


def _templates_for(difficulty: Difficulty) -> dict[int, list[_tpl.Template]]:
  """Eligible templates by step count (only counts that have one)."""
  by_steps: dict[int, list[_tpl.Template]] = {}
  for t in _tpl.TEMPLATES:
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


def _render(rng: np.random.Generator, t: _tpl.Template, operands: tuple[int, ...]) -> Problem:
  values = _values(operands, tuple(t.ops))
  people = rng.permutation(len(_tpl.NAMES))[:3]
  (name, sex), (friend, _), (friend2, _) = (_tpl.NAMES[int(i)] for i in people)
  he, he_cap, him, his = _tpl.PRONOUNS[sex]
  item, items = _pick(rng, _tpl.ITEMS)
  box, boxes = _pick(rng, _tpl.BOXES)
  fields = dict(name=name, friend=friend, friend2=friend2, he=he, He=he_cap, him=him, his=his,
                item=item, items=items, box=box, boxes=boxes, gift=_pick(rng, _tpl.GIFTS))
  fields.update({f"a{i}": a for i, a in enumerate(operands)})
  fields.update({f"v{i}": v for i, v in enumerate(values) if i})
  question = t.question.format(**fields)
  lines = [line.format(**fields) for line in t.lines]
  answer = "\n".join(lines + [f"#### {values[-1]}"])
  return Problem(question=question, answer=answer, gold=str(values[-1]), template=t.name,
                 operands=operands, ops=tuple(t.ops))


def generate(n: int, *, seed: int, split: str = "train",
             difficulty: Difficulty | None = None) -> list[Problem]:
  """``n`` problems of ``split`` at ``difficulty`` (None: ``Difficulty.easy()``).

  Deterministic in (seed, split, difficulty, index); problem ``i`` does not depend on ``n``.
  Every returned problem's key satisfies ``split_of(*p.key) == split``, so the splits never share
  a problem. Problems may repeat within a split, the more often the fewer the difficulty allows.
  Raises RuntimeError when a difficulty admits (almost) no problem of ``split``.
  """
  n = int_arg(n, "n", 0)
  seed = int_arg(seed, "seed", 0)
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
