"""experiments/bench_tail.py in-process: the --quick run (a small widening of the embedded model)
writes one tail with the vanilla and a speculative engine, the speculative tokens equal to the
vanilla engine's, per-step times consistent with the rollout times, and bad flags fail in one line
with exit code 2."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

EXP = Path(__file__).resolve().parents[1] / "experiments"


@pytest.fixture(scope="module")
def bench():
  """The script as a module (its folder on sys.path, as when run as a script)."""
  if str(EXP) not in sys.path:
    sys.path.insert(0, str(EXP))
  spec = importlib.util.spec_from_file_location("_exp_bench_tail", EXP / "bench_tail.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.slow  # the quick benchmark: about 45 s
def test_quick_run_writes_a_consistent_tail(bench, tmp_path):
  out = tmp_path / "tail.json"
  bench.main(["--quick", "--out", str(out)])
  data = json.loads(out.read_text())
  assert data["meta"]["cpu"] and data["meta"]["layers"] == bench._common.quick_shape().num_layers
  (tail,) = data["tails"]
  assert tail["rows"] == 2 and tail["prefill_s"] > 0
  van, spec = tail["engines"]
  assert van["engine"] == "vanilla" and spec["engine"] == "2 nodes"
  assert van["tau"] == 1.0 and spec["tau"] >= 1.0
  assert spec["identical"]  # the speculative engine commits the vanilla engine's tokens
  for e in (van, spec):
    assert e["steps"] >= 1 and e["seconds"] > 0
    assert e["ms_per_step"] == pytest.approx(
        1e3 * (e["seconds"] - tail["prefill_s"]) / e["steps"])
    assert e["speedup"] == pytest.approx(van["seconds"] / e["seconds"])
  assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("flag", [["--rows", "0"], ["--nodes", "0"], ["--rounds", "0"]])
def test_bad_flags_fail_in_one_line(bench, flag, capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(flag)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: {flag[0]}=")
