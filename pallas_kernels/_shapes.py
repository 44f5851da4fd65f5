"""Integer shape helpers and static-argument checks shared by the kernels' wrappers (static
Python values, not traced). The checks follow ``specroll_jax._fields`` (which pallas_kernels
does not import): bools refused, numpy scalars accepted, a ValueError naming the argument, the
limit and the value."""

import math

import numpy as np


def int_arg(value, name: str, lo: int, *, optional: bool = False) -> int | None:
  """``value`` as a Python int >= lo (None passes with ``optional``)."""
  if optional and value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < lo:
    raise ValueError(f"{name} must be {'None or ' if optional else ''}an int >= {lo}, got "
                     f"{value!r}")
  return int(value)


def float_arg(value, name: str, lo: float) -> float:
  """``value`` (an int or float, not a bool) as a finite Python float >= lo."""
  ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
  if not ok or not math.isfinite(value) or value < lo:
    raise ValueError(f"{name} must be a finite number >= {lo}, got {value!r}")
  return float(value)


def is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def cdiv(n: int, m: int) -> int:
  return -(-n // m)
