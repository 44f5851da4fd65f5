"""GSM8K: loading, the prompt template, and final-answer extraction.

The records ship as package data in ``specroll_jax/data/gsm8k/{train,test}.jsonl``: one JSON object
``{"question", "answer"}`` a line, each answer ending with a line ``#### N``. The data folder shares
its name with this module; imports still resolve to this module (a plain module wins over a folder
without ``__init__.py``), and the files are read through ``importlib.resources``.

Numbers are compared in a normal form (``normalize_number``): no ``$``, no thousands commas, no
trailing ``.``, no trailing fractional zeros ("5.00" -> "5", "2.50" -> "2.5"), no leading zeros.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import importlib.resources
import json
import re

SPLITS = ("train", "test")
EXTRACT_MODES = ("strict", "flexible")
PROMPT_TEMPLATE = (
  "Question: {question}\nAnswer step by step and finish with a line '#### <number>'.\nAnswer:"
)

# A number as written in solutions: optional sign and "$" (either order), digits with optional
# thousands commas, optional decimals, or a bare decimal such as ".5".
_NUMBER = r"-?\$?-?[ \t]*(?:\d(?:[\d,]*\d)?(?:\.\d+)?|\.\d+)"
_STRICT_RE = re.compile(r"####[ \t]*(" + _NUMBER + r")")
_FORMAT_LINE_RE = re.compile(r"^[ \t]*####[ \t]*" + _NUMBER + r"\.?[ \t]*$", re.MULTILINE)
# Flexible: any number; a "-" counts as a sign only when it does not follow a digit ("3-2" -> "2").
_ANY_NUMBER_RE = re.compile(r"(?:(?<![\d)])-)?\$?(?:\d(?:[\d,]*\d)?(?:\.\d+)?|\.\d+)")
_PLAIN_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")


@dataclasses.dataclass(frozen=True)
class Example:
  """One GSM8K record. gold: the final number of ``answer``, commas and "$" stripped ("1234")."""

  question: str
  answer: str
  gold: str


def normalize_number(s: str) -> str | None:
  """Normal form of a number string ("$1,234.50" -> "1234.5", "5.0" -> "5", "-0" -> "0"), else None.

  Accepts surrounding spaces, "$" and "-" before or after each other, thousands commas and one
  trailing ".". Returns None for anything else (words, fractions "1/2", exponents).
  """
  t = s.strip().replace(",", "").replace("$", "").replace(" ", "").replace("\t", "")
  if t.endswith(".") and not t.endswith(".."):
    t = t[:-1]
  if not _PLAIN_RE.fullmatch(t):
    return None
  d = decimal.Decimal(t)
  if d == 0:
    return "0"
  return format(d.normalize(), "f")


def extract_gold(answer: str) -> str:
  """The text after the last "####" of a GSM8K solution, with commas, "$" and spaces stripped."""
  if "####" not in answer:
    raise ValueError(f"answer has no '####' final-answer marker: {answer[-80:]!r}")
  tail = answer.rsplit("####", 1)[1]
  return re.sub(r"[\s,$]", "", tail)


def extract_answer(text: str, mode: str = "strict") -> str | None:
  """Normalised final number of a completion, or None.

  strict: the number right after the last "####" (spaces, "$", thousands commas, sign, decimals
  allowed). flexible: the strict answer if there is one, else the last number anywhere in ``text``.
  """
  if mode not in EXTRACT_MODES:
    raise ValueError(f"mode must be one of {EXTRACT_MODES}, got {mode!r}")
  idx = text.rfind("####")
  if idx >= 0:
    m = _STRICT_RE.match(text, idx)
    if m is not None:
      return normalize_number(m.group(1))
  if mode == "strict":
    return None
  last = None
  for m in _ANY_NUMBER_RE.finditer(text):
    last = m.group(0)
  return None if last is None else normalize_number(last)


def has_answer_line(text: str) -> bool:
  """True when ``text`` contains a line that is exactly "#### N" (N a number, spaces allowed)."""
  return _FORMAT_LINE_RE.search(text) is not None


def format_prompt(question: str) -> str:
  """The prompt for one question; the model continues it with ``format_target(answer)``."""
  return PROMPT_TEMPLATE.format(question=question.strip())


def format_target(answer: str) -> str:
  """The SFT target that follows ``format_prompt``: a space, then the solution with its "#### N"."""
  return " " + answer.strip()


@functools.cache
def _load(split: str) -> tuple[Example, ...]:
  path = importlib.resources.files("specroll_jax.data").joinpath("gsm8k", f"{split}.jsonl")
  examples = []
  with path.open("r", encoding="utf-8") as f:
    for line in f:
      if not line.strip():
        continue
      rec = json.loads(line)
      examples.append(Example(rec["question"], rec["answer"], extract_gold(rec["answer"])))
  return tuple(examples)


def load(split: str) -> list[Example]:
  """All records of ``split`` ("train": 7473, "test": 1319), in file order. Parsed once, cached."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  return list(_load(split))
