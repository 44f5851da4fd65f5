"""The main job end to end on a test-sized model: one step runs (its bad flags:
test_experiments_cli.py), and a run killed with SIGKILL mid-run resumes to exactly the
uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from specroll_jax import models
from specroll_jax.heads import conditioned as CH

pytestmark = pytest.mark.slow  # the main job end to end, in subprocesses: minutes

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gsm8k.py"
TIMING = "seconds"  # wall-clock fields differ between runs; every other metric must not


@pytest.fixture(scope="module")
def job_model(trained_model, tmp_path_factory):
  """(model folder, root-conditioned heads file) of the tiny test model."""
  d = tmp_path_factory.mktemp("job")
  config, params, tok = trained_model
  models.save_pretrained(d / "model", config, params)
  tok.save(d / "model")
  ch = CH.init(jax.random.key(0), config, 3, width=32)
  ch = ch.replace(w_o=0.05 * jax.random.normal(jax.random.key(1), ch.w_o.shape))
  CH.save(d / "heads.safetensors", ch)
  return d / "model", d / "heads.safetensors"


def _cmd(job_model, out, *extra):
  model, heads = job_model
  return [sys.executable, str(SCRIPT), "--model", str(model), "--heads", str(heads),
          "--prompts", "2", "--group", "4", "--max-new-tokens", "24", "--out", str(out), *extra]


def _env(cache=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  if cache is not None:  # the job's caches (e.g. the measured cost model) stay in the test's tmp
    env["SPECROLL_CACHE"] = str(cache)
  return env


def test_one_step_end_to_end(job_model, tmp_path):
  """Two steps through ``SpecRoll`` with its defaults (goodput budgets: on this CPU the first
  batch probes the trees, the slow path's bootstrap refreshes every head from the rollout's own
  records); the run still gives exactly the vanilla run's rewards and parameters."""
  out = tmp_path / "run"
  proc = subprocess.run(_cmd(job_model, out, "--steps", "2", "--eval-prompts", "4",
                             "--max-new-tokens", "16"),
                        capture_output=True, text=True, env=_env(tmp_path / "cache"), timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  # the main job scores the old policy with the trainer (--old-policy trainer): the two engines'
  # runs give bit-identical parameters, not merely close ones
  assert summary["table"]["same_rewards"] and summary["table"]["max_param_diff"] == 0.0
  for kind in ("specroll", "vanilla"):
    recs = [json.loads(x) for x in (out / kind / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(r["logp_gap_max"] < 1e-4 for r in recs)
    assert (out / kind / "traces" / "zarr.json").exists()
    if kind == "specroll":
      # the first batch verifies trees (a probe where goodput verifies none): their tau shows,
      # and the bootstrap refreshes every head on their records; the second verifies trees where
      # goodput, reading this machine's measured cost, finds they pay (records, the bootstrap's
      # second refresh), else runs the vanilla engine (no records: no refresh)
      assert recs[0]["mode"] in ("probe", "speculative") and recs[0]["probe_tau"] >= 1.0
      assert recs[1]["mode"] in ("vanilla", "speculative"), recs[1]["mode"]
      trees = [r for r in recs if r["mode"] != "vanilla"]
      assert [r["slow"]["decision"] for r in trees] == ["bootstrap"] * len(trees)
      assert all(r["slow"]["heads"] == [0, 1, 2] for r in trees)  # on the rollout's records
      assert all(r["adaptation_seconds"] > 0 for r in trees)
      assert all(r["slow"] is None for r in recs if r["mode"] == "vanilla")
      assert recs[1]["compile_seconds"] == 0.0  # the first batch compiled every program
    held = summary["table"][kind]["held_out"]
    assert 0 <= held["before"] <= 1 and 0 <= held["after"] <= 1
  assert (out / "gsm8k.png").stat().st_size > 10_000
  assert "step 2/2" in proc.stdout  # one plain line per step in a log
  assert proc.stdout.startswith("task: gsm8k")  # with --model, GSM8K is the default task
  assert "SpecRoll: CondHeads heads + group lookup (G = 4" in proc.stdout  # what is on
  assert len(list((tmp_path / "cache" / "cost").glob("cost-*.json"))) == 1  # measured once


def _records(path):
  def strip(x):
    if isinstance(x, dict):
      return {k: strip(v) for k, v in x.items() if TIMING not in k}
    return x
  return [strip(json.loads(x)) for x in Path(path).read_text().splitlines()]


def _final_params(out):
  from app.checkpoint import Checkpointer
  ck = Checkpointer(out / "specroll" / "checkpoints", async_save=False)
  meta = ck.restore_meta()
  import orbax.checkpoint as ocp
  raw = ocp.StandardCheckpointer().restore(
      os.path.join(ck.directory, str(ck.latest_step()), "state"))
  ck.close()
  return meta, raw


def test_sigkill_mid_run_resumes_to_the_uninterrupted_run(job_model, tmp_path):
  # every decision time-free: the fixed node budget, and learning refreshes of the preset's
  # step count (with --slow-learn-budget > 0 their steps are sized from wall-clock, which differs
  # between two runs of a loaded machine, and so would the heads and tau after them)
  steps = ["--steps", "4", "--no-compare", "--budget", "fixed", "--buckets", "1.0",
           "--slow-learn-budget", "0"]
  full, cut = tmp_path / "full", tmp_path / "cut"
  proc = subprocess.run(_cmd(job_model, full, *steps), capture_output=True, text=True,
                        env=_env(), timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # the same run, killed with SIGKILL as soon as two steps are on record (inside step 3, or while
  # step 2's checkpoint is being written)
  p = subprocess.Popen(_cmd(job_model, cut, *steps), stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, env=_env())
  metrics = cut / "specroll" / "metrics.jsonl"
  deadline = time.time() + 600
  while time.time() < deadline and p.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
      p.send_signal(signal.SIGKILL)
      break
    time.sleep(0.05)
  p.wait(timeout=60)
  assert p.returncode == -signal.SIGKILL, "the run ended before it could be killed"
  done = len(metrics.read_text().splitlines())
  assert done < 4
  proc = subprocess.run(_cmd(job_model, cut, *steps, "--resume"), capture_output=True, text=True,
                        env=_env(), timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resumed from step" in proc.stdout or done == 0
  a, b = _records(full / "specroll" / "metrics.jsonl"), _records(metrics)
  assert [r["step"] for r in b] == [0, 1, 2, 3]
  assert a == b  # every metric of every step, the adaptation state's effects included
  meta_a, pa = _final_params(full)
  meta_b, pb = _final_params(cut)
  assert meta_a["step"] == meta_b["step"] == 3
  assert pa.keys() == pb.keys() and any(k.startswith("train_params") for k in pa)
  for key in pa:  # policy, optimizer and adaptation state; the monitor's clocks excepted
    if "seconds" in key:
      continue
    np.testing.assert_allclose(np.asarray(pa[key], np.float64), np.asarray(pb[key], np.float64),
                               atol=1e-6, err_msg=key)
