"""One rule for validated config fields: a frozen dataclass's typed, int and float fields checked
(bools refused, numpy scalars accepted and stored as Python numbers) with a ValueError naming the
owner, the field, the limit and the value."""

from __future__ import annotations

import math

import numpy as np


def check_type(obj, name: str, cls, *, what: str | None = None, owner: str | None = None):
  """``obj.name`` as an instance of ``cls`` (``what`` names it in the message)."""
  v = getattr(obj, name)
  if not isinstance(v, cls):
    owner = type(obj).__name__ if owner is None else owner
    raise ValueError(f"{owner}.{name} must be a {what or cls.__name__}, got {type(v).__name__}")
  return v


def check_int(obj, name: str, lo: int, hi: int | None = None, *, owner: str | None = None) -> int:
  """``obj.name`` as an int in [lo, hi] (hi None: no upper limit), stored back as a Python int."""
  v = getattr(obj, name)
  owner = type(obj).__name__ if owner is None else owner
  if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo or (
      hi is not None and v > hi):
    lim = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ValueError(f"{owner}.{name} must be an int {lim}, got {v!r}")
  object.__setattr__(obj, name, int(v))
  return int(v)


def check_float(obj, name: str, lo: float, hi: float = math.inf, *, lo_open: bool = False,
                owner: str | None = None) -> float:
  """``obj.name`` as a finite number >= lo (> lo with lo_open) and <= hi, stored as a float."""
  v = getattr(obj, name)
  owner = type(obj).__name__ if owner is None else owner
  ok = isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool) and \
      math.isfinite(v)
  if not ok or v > hi or v < lo or (lo_open and v == lo):
    lim = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi < math.inf else "")
    raise ValueError(f"{owner}.{name} must be a finite number {lim}, got {v!r}")
  object.__setattr__(obj, name, float(v))
  return float(v)
