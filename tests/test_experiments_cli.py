"""Every experiment script answers a bad flag value with one line naming the flag and exit code 2,
never a traceback (and never after minutes of work: flags are checked first)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXP = Path(__file__).resolve().parents[1] / "experiments"

CASES = [
    ("bench_decode.py", ["--batches", "0"], "--batches"),
    ("bench_kernels.py", ["--reps", "0"], "--reps"),
    ("device_check.py", ["--budget-s", "-1"], "--budget-s"),
    ("bench_rollout.py", ["--prompts", "0"], "--prompts"),
    ("bench_rollout.py", ["--top-p", "2"], "--top-p"),
    ("bench_engine.py", ["--rounds", "0"], "--rounds"),
    ("bench_engine.py", ["--compare-to", "no-such-ref"], "--compare-to"),
    ("bench_adaptation.py", ["--batches", "1"], "--batches"),
    ("bench_adaptation.py", ["--arms", "fastest"], "--arms"),
    ("build_default_model.py", ["--steps", "0"], "--steps"),
    ("gsm8k.py", ["--prompts", "x"], "--prompts"),
]


@pytest.mark.parametrize("script,flags,name", CASES, ids=lambda x: str(x))
def test_bad_flag_is_one_line_and_exit_2(script, flags, name, tmp_path):
  proc = subprocess.run([sys.executable, str(EXP / script), *flags], capture_output=True,
                        text=True, timeout=300, cwd=tmp_path)
  lines = [x for x in proc.stderr.splitlines() if x.strip()]
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  assert len(lines) == 1 and name in lines[0], proc.stderr
