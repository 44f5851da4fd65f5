"""experiments/device_check.py runs end to end on CPU (--interpret, tiny shapes), so the script a
short device lease depends on cannot rot; and its time guard skips cleanly and still writes JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import xla_flags

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "device_check.py"


def _run(tmp_path, *args, timeout):
  proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *args],
                        capture_output=True, text=True, timeout=timeout,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads((tmp_path / "device_check.json").read_text())


@pytest.mark.slow  # every kernel case in interpret mode
def test_interpret_run_passes_every_case(tmp_path):
  report = _run(tmp_path, "--interpret", timeout=240)
  cases = report["cases"]
  errors = {k: v["error"] for k, v in cases.items() if "error" in v}
  assert not errors, errors
  assert report["summary"] == {"result": len(cases), "error": 0, "skipped": 0}
  kinds = {c["result"]["kind"] for k, c in cases.items() if k.startswith("attention/")}
  assert kinds == {"tree", "prefill"}
  assert any("T13" in k for k in cases) and any("L0_T64" in k for k in cases)
  assert list(cases)[0].startswith("attention/bfloat16/")  # bf16 first
  for name, c in cases.items():
    r = c["result"]
    if name.startswith("attention/"):
      assert r["ok"] and r["finite"], (name, r)
    elif name.startswith("sampler/"):
      assert r["token_agreement"] == 1.0 and r["finite"], (name, r)
    elif "token_identity" in r:
      assert r["token_identity"] == 1.0, (name, r)


def test_time_guard_skips_cleanly(tmp_path):
  report = _run(tmp_path, "--interpret", "--skip-engine", "--budget-s", "0", timeout=120)
  assert report["cases"] and all("skipped" in c for c in report["cases"].values())
  assert report["summary"]["skipped"] == len(report["cases"])


DEVICE_RUN = SCRIPT.with_name("device_run.py")


@pytest.mark.slow  # the engine against the references, then SpecRoll on a small widening
def test_device_run_smoke_on_cpu(tmp_path):
  """experiments/device_run.py --quick: every case runs on the CPU (a tiny widening of the
  embedded model), SpecRoll's rows commit the vanilla tokens, and the JSON holds every case; with
  two host devices the model-parallel case runs at model axis 2 (and records 4 and 8 as not
  run: more than the devices)."""
  proc = subprocess.run([sys.executable, str(DEVICE_RUN), "--quick", "--out", str(tmp_path),
                         "--budget-s", "3000"],
                        capture_output=True, text=True, timeout=1200,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2)))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "device_run.json").read_text())
  cases = report["cases"]
  errors = {k: v["error"] for k, v in cases.items() if "error" in v}
  assert not errors, errors
  rows = {k: c["result"] for k, c in cases.items() if k.startswith("rollout/")}
  assert set(rows) == {"rollout/synthetic_T1.0", "rollout/gsm8k_T1.0"}
  for r in rows.values():
    assert r["identical"] and r["tau"] > 1.0 and r["mode"] == "speculative"
  assert report["summary"]["error"] == 0 and report["summary"]["skipped"] == 0
  mesh = cases["mesh/model2"]["result"]
  assert mesh["vanilla_identical"] and mesh["specroll_identical"] and mesh["tau"] > 1.0, mesh
  assert "mesh/model4" not in cases
