"""The machine a measurement was taken on (CPU ratios depend on it)."""

from __future__ import annotations

import functools
import os
import platform
import subprocess


@functools.cache
def cpu_model() -> str:
  """The CPU model from ``lscpu`` with the core count."""
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    for line in out.splitlines():
      if line.startswith("Model name"):
        return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
  except (OSError, subprocess.SubprocessError):
    pass
  return f"{platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"
