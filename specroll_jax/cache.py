"""Where specroll-jax caches what it builds or measures once per machine: the embedded model when a
checkout lacks it, fitted heads, goodput cost models. ``SPECROLL_CACHE`` overrides the default
``~/.cache/specroll_jax``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
  """The cache root (``$SPECROLL_CACHE`` or ``~/.cache/specroll_jax``); not created here."""
  return Path(os.environ.get("SPECROLL_CACHE", Path.home() / ".cache" / "specroll_jax"))
