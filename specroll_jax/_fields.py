"""One rule for validated values: ints (bools refused, numpy integers accepted and returned as
Python ints), finite numbers (returned as floats) and bools, each refused with a ValueError naming
the argument (or ``Owner.field``), the limit and the value.

``int_arg`` / ``float_arg`` / ``int_tuple`` / ``bool_arg`` check a function's arguments;
``check_int`` / ``check_float`` / ``check_bool`` / ``check_type`` check a frozen dataclass's field
in ``__post_init__`` and store it back as the Python value."""

from __future__ import annotations

import math

import numpy as np


def is_int(v) -> bool:
  """An int or numpy integer, not a bool."""
  return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _int_ok(v, lo: int | None, hi: int | None) -> bool:
  return is_int(v) and (lo is None or v >= lo) and (hi is None or v <= hi)


def _int_limit(lo: int | None, hi: int | None) -> str:
  if lo is None:
    return "" if hi is None else f" <= {hi}"
  return f" >= {lo}" if hi is None else f" in [{lo}, {hi}]"


def int_arg(value, name: str, lo: int | None, hi: int | None = None, *, optional: bool = False):
  """``value`` as a Python int in [lo, hi] (None: no limit on that side); with ``optional``, None
  is returned as is. ValueError: "{name} must be an int >= lo, got value"."""
  if optional and value is None:
    return None
  if not _int_ok(value, lo, hi):
    raise ValueError(f"{name} must be {'None or ' if optional else ''}an int"
                     f"{_int_limit(lo, hi)}, got {value!r}")
  return int(value)


def int_tuple(values, name: str, lo: int | None, hi: int | None = None, *,
              length: int | None = None, count: str | None = None) -> tuple[int, ...]:
  """``values`` (any iterable) as a tuple of Python ints, each in [lo, hi]; with ``length``,
  exactly that many (``count`` names the length in the message, e.g. "num_heads=3")."""
  try:
    vs = tuple(values)
  except TypeError:
    vs = None
  if vs is None or (length is not None and len(vs) != length) or not all(
      _int_ok(v, lo, hi) for v in vs):
    n = "" if length is None else f"{length if count is None else count} "
    raise ValueError(f"{name} must hold {n}ints{_int_limit(lo, hi)}, got {values!r}")
  return tuple(int(v) for v in vs)


def float_arg(value, name: str, lo: float = -math.inf, hi: float = math.inf, *,
              lo_open: bool = False, hi_open: bool = False, allow_inf: bool = False) -> float:
  """``value`` (an int or float, numpy's included, not a bool) as a Python float in [lo, hi]
  (``lo_open`` / ``hi_open``: that end excluded); finite unless ``allow_inf``, never nan.
  ValueError: "{name} must be a finite number >= lo, got value" (an interval when hi is set)."""
  ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
  if ok:
    v = float(value)
    ok = (not math.isnan(v) if allow_inf else math.isfinite(v)) and (
        v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
  if not ok:
    if hi < math.inf or allow_inf:
      lim = f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    elif lo > -math.inf:
      lim = f" {'>' if lo_open else '>='} {lo}"
    else:
      lim = ""
    raise ValueError(f"{name} must be a{'' if allow_inf else ' finite'} number{lim}, got "
                     f"{value!r}")
  return v


def bool_arg(value, name: str) -> bool:
  """``value`` if it is a bool. ValueError: "{name} must be a bool, got value"."""
  if not isinstance(value, bool):
    raise ValueError(f"{name} must be a bool, got {value!r}")
  return value


def _owner(obj, owner: str | None) -> str:
  return type(obj).__name__ if owner is None else owner


def check_type(obj, name: str, cls, *, what: str | None = None, owner: str | None = None):
  """``obj.name`` as an instance of ``cls`` (``what`` names it in the message)."""
  v = getattr(obj, name)
  if not isinstance(v, cls):
    raise ValueError(f"{_owner(obj, owner)}.{name} must be a {what or cls.__name__}, got "
                     f"{type(v).__name__}")
  return v


def check_int(obj, name: str, lo: int | None, hi: int | None = None, *, optional: bool = False,
              owner: str | None = None) -> int | None:
  """``obj.name`` as an int in [lo, hi] (None: no limit on that side; ``optional``: None allowed),
  stored back as a Python int (``int_arg``'s rule and message, named ``Owner.name``)."""
  v = int_arg(getattr(obj, name), f"{_owner(obj, owner)}.{name}", lo, hi, optional=optional)
  object.__setattr__(obj, name, v)
  return v


def check_float(obj, name: str, lo: float, hi: float = math.inf, *, lo_open: bool = False,
                hi_open: bool = False, allow_inf: bool = False,
                owner: str | None = None) -> float:
  """``obj.name`` as a number in [lo, hi] (``float_arg``'s rule and message, named
  ``Owner.name``), stored back as a Python float."""
  v = float_arg(getattr(obj, name), f"{_owner(obj, owner)}.{name}", lo, hi, lo_open=lo_open,
                hi_open=hi_open, allow_inf=allow_inf)
  object.__setattr__(obj, name, v)
  return v


def check_bool(obj, name: str, *, owner: str | None = None) -> bool:
  """``obj.name`` if it is a bool (``bool_arg``'s rule and message, named ``Owner.name``)."""
  return bool_arg(getattr(obj, name), f"{_owner(obj, owner)}.{name}")
