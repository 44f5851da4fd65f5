"""Concurrency buckets shared by both engines: a batch of B rows runs through a few compiled row
counts (descending), and the live rows move into the next smaller bucket once no more of them are
active than it holds (docs/design.md, "Buckets and compaction").

``bucket_rows`` turns fractions of the batch into the static row counts; ``compact`` moves the
active slots first and keeps that many (one ``tree_map`` over a per-slot pytree, so the KV cache,
the history and a proposer's per-row state move with their row). Results are written by global
row, so which slot a row sits in never changes what it samples.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_FRACTIONS = (1.0, 0.5, 0.25, 0.125)


def check_fractions(fractions, owner: str) -> tuple[float, ...]:
  """``fractions`` as a tuple, or ValueError naming ``owner`` (e.g. "SpecConfig.bucket_fractions")
  unless it starts at 1.0 and descends within (0, 1]."""
  fr = tuple(float(f) for f in fractions)
  if not fr or fr[0] != 1.0 or any(not (0 < b <= 1) for b in fr) or list(fr) != sorted(fr)[::-1]:
    raise ValueError(f"{owner} must start at 1.0 and descend within (0, 1], got {tuple(fractions)}")
  return fr


def bucket_rows(batch: int, fractions: tuple[float, ...]) -> tuple[int, ...]:
  """Static row counts of the buckets of a ``batch``-row batch: ceil(batch * f), strictly
  descending (repeats dropped)."""
  return tuple(r for r, _ in kept_buckets(batch, fractions))


def kept_buckets(batch: int, fractions: tuple[float, ...]) -> tuple[tuple[int, int], ...]:
  """(rows, index of its fraction) of every bucket a ``batch``-row batch keeps."""
  kept = []
  for i, f in enumerate(fractions):
    r = max(1, int(np.ceil(batch * f)))
    if kept and r >= kept[-1][0]:
      continue
    kept.append((r, i))
  return tuple(kept)


def compact(slots, done, rows: int):
  """Active slots first (stable), ``rows`` slots kept (static); every leaf of ``slots`` has a
  leading slot axis and moves with its row."""
  order = jnp.argsort(done, stable=True)[:rows]
  return jax.tree.map(lambda x: x[order], slots)


def exit_rows(rows: tuple[int, ...], bucket: int) -> int:
  """A bucket's loop runs while more rows are active than the next bucket holds (0 for the last)."""
  return rows[bucket + 1] if bucket + 1 < len(rows) else 0
