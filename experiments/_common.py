"""Shared by the experiment scripts: make the repo importable when run as a plain script, and
name the machine a measurement was taken on."""

import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))


def cpu_model() -> str:
  """The CPU model from ``lscpu`` with the core count (ratios on CPU depend on it)."""
  try:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
      if line.startswith("Model name"):
        return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
  except OSError:
    pass
  return f"{platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"
