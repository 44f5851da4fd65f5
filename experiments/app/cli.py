"""Command-line helpers for the experiment scripts: bad flags end in one line and exit code 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


def fail(flag: str, value, why: str) -> NoReturn:
  """Print ``error: FLAG=VALUE: WHY`` on stderr and exit with status 2 (argparse's usage code)."""
  print(f"error: {flag}={value!r}: {why}", file=sys.stderr)
  raise SystemExit(2)


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose errors are one line (no usage block) with exit status 2."""

  def error(self, message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def require(args, **lower_bounds) -> None:
  """``fail`` unless every named argument (a number or a list of numbers; None is skipped) is at
  least its bound: ``require(a, steps=1, lr=1e-12)``. The flag is the name with "-" for "_"."""
  for name, lo in lower_bounds.items():
    value = getattr(args, name)
    if value is None:
      continue
    for v in value if isinstance(value, list | tuple) else [value]:
      if not v >= lo:  # also catches NaN
        fail("--" + name.replace("_", "-"), value, f"must be >= {lo}")
