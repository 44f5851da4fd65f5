"""Shared by the experiment scripts: make the repo importable when run as a plain script, and
name the machine a measurement was taken on."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))


def cpu_model() -> str:
  """The CPU model from ``lscpu`` with the core count (ratios on CPU depend on it)."""
  from specroll_jax._machine import cpu_model as _cpu_model
  return _cpu_model()
