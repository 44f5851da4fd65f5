"""Compiled rollout programs, held by the host code that runs them (``SpecRoll``).

``compiled(engine, *args)`` lowers and compiles ``engine(*args)`` once per engine (its static
settings) and argument shapes, dtypes and placements, and returns the executable; ``run`` calls
it. A call whose arguments do not match a compiled program compiles a new one here, never
silently inside ``jax.jit``, so a caller can compile every program it will need up front
(``SpecRoll.warmup``) and count what compiled when (``compile_seconds``).
"""

from __future__ import annotations

import time

import jax

_CACHE: dict = {}
_SECONDS: list[float] = [0.0]


def _key(engine, args):
  leaves, tree = jax.tree.flatten(args)
  sig = tuple((tuple(x.shape), str(x.dtype), bool(getattr(x, "committed", False)), _placement(x))
              if hasattr(x, "shape") else (type(x).__name__, x) for x in leaves)
  return engine, tree, sig


def _placement(x):
  """A mesh placement (``NamedSharding``: a model-parallel rollout's arguments), else None."""
  sharding = getattr(x, "sharding", None)
  return sharding if isinstance(sharding, jax.sharding.NamedSharding) else None


def compiled(engine, *args):
  """The executable of ``engine(*args)`` (compiled on the first call with these shapes)."""
  key = _key(engine, args)
  exe = _CACHE.get(key)
  if exe is None:
    t0 = time.perf_counter()
    exe = jax.jit(engine.__call__).lower(*args).compile()
    _SECONDS[0] += time.perf_counter() - t0
    _CACHE[key] = exe
  return exe


def run(engine, *args):
  """``engine(*args)`` through its compiled program."""
  return compiled(engine, *args)(*args)


def compile_seconds() -> float:
  """Seconds spent compiling programs here so far (this process)."""
  return _SECONDS[0]


def programs() -> int:
  """Programs compiled here and still held."""
  return len(_CACHE)


def clear() -> None:
  """Drop every held program (e.g. between unrelated experiments: each holds memory maps)."""
  _CACHE.clear()


__all__ = ["clear", "compile_seconds", "compiled", "programs", "run"]
