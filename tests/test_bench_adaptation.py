"""experiments/bench_adaptation.py in-process: the --quick run (a GRPO policy sequence saved with
orbax, replayed by every quick arm, each a ``SpecRoll`` carrying its own state, with the vanilla
tokens), reuse of a saved sequence, each arm's ``SpecRoll`` settings, and bad input (a --policies
folder of another model's checkpoints, an unknown arm, Reflex arms without the lookup, bad
--buckets): one line, exit 2."""

import json

import jax
import numpy as np
import pytest
from conftest import load_script

from app import pipeline
from app.checkpoint import Checkpointer


def _one_line_exit_2(capsys, fn, name):
  with pytest.raises(SystemExit) as e:
    fn()
  err = capsys.readouterr().err
  lines = [x for x in err.splitlines() if x.strip()]
  assert e.value.code == 2, err[-2000:]
  assert len(lines) == 1 and name in lines[0] and "Traceback" not in err, err
  return lines[0]


@pytest.mark.long
@pytest.mark.slow  # a GRPO run + 3 SpecRoll arms (3 rollout programs), one row bucket: ~3 min
def test_quick_run_replays_a_grpo_policy_sequence(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  mod = load_script("bench_adaptation.py")
  pol, out = tmp_path / "policies", tmp_path / "out" / "bench.json"
  res = mod.main(["--quick", "--policies", str(pol), "--out", str(out)])
  data = json.loads(out.read_text())
  assert out.with_suffix(".png").stat().st_size > 0
  # the policy sequence: steps 0..2 with the model and the GRPO settings in every meta
  ck = Checkpointer(pol, max_to_keep=None, async_save=False)
  assert ck.all_steps() == [0, 1, 2]
  metas = [ck.restore_meta(s) for s in (0, 1, 2)]
  assert [m["step"] for m in metas] == [0, 1, 2]
  assert all(m["grpo"]["learning_rate"] == 3e-4 and m["grpo"]["task"] == "synthetic"
             and m["model"]["weights_hash"] == metas[0]["model"]["weights_hash"] for m in metas)
  assert metas[0]["metrics"] is None and "reward_mean" in metas[1]["metrics"]
  # every quick arm replayed the 3 batches with the vanilla tokens, and has a tau per batch
  assert list(data["arms"]) == list(mod.QUICK_ARMS)
  for arm, rec in data["arms"].items():
    assert [r["batch"] for r in rec] == [0, 1, 2], arm
    assert all(r["same"] for r in rec), arm
    assert all(np.isfinite(r["tau"]) and r["tau"] >= 1.0 for r in rec), arm
    assert data["summary"][arm]["all_same"] is True
  # the arms take turns within each batch, the first of them rotating by one per batch
  arms = list(data["arms"])
  for b in range(3):
    assert sorted(data["arms"][x][b]["turn"] for x in arms) == list(range(len(arms)))
  firsts = [next(x for x in arms if data["arms"][x][b]["turn"] == 0) for b in range(3)]
  assert len(set(firsts)) == 3
  # every batch verified trees (the fixed budget); arm both: the slow path's records drawn from
  # the rollout's hidden states each batch, the arms without it none
  assert all(r["mode"] == "speculative" for rec in data["arms"].values() for r in rec)
  for r in data["arms"]["both"]:
    assert r["slow"]["decision"] in mod.SP.REASONS and sum(r["slow"]["records"]) > 0
  assert data["summary"]["both"]["records"] > 0
  assert all(r["slow"] is None and r["reflex"] is None for x in ("static", "ceiling")
             for r in data["arms"][x])
  # arm both's Reflex sleeps (--reflex-sleep 3) after an awake batch whose corrections did not
  # pay: the sleep counts down batch by batch, and the first batch (a fresh state) is awake
  tr = [r["reflex"] for r in data["arms"]["both"]]
  assert tr[0]["asleep"] is False and tr[0]["mode"] == "awake" and len(tr[0]["safety"]) == 3
  for before, now in zip(tr, tr[1:], strict=False):
    assert now["asleep"] == (before["sleep_left"] > 0)
    if now["asleep"]:
      assert now["sleep_left"] == before["sleep_left"] - 1
  assert data["summary"]["both"]["asleep_batches"] == sum(x["asleep"] for x in tr)
  assert [g["goal"][:3] for g in data["goals"]] == ["(d)"] * 3
  assert "SpecRoll" in data["meta"]["arms"]["both"]["specroll"]
  # the policies drift: KL to step 0 is 0 at step 0, positive after; the parameters moved
  p = data["policies"]
  assert [x["step"] for x in p] == [0, 1, 2]
  assert p[0]["kl_to_step0"] == 0.0 and p[0]["param_change"] == 0.0
  assert all(x["kl_to_step0"] > 0 and x["param_change"] > 0 for x in p[1:])
  assert all(np.isfinite(x["entropy"]) and x["entropy"] >= 0 for x in p)
  assert data["ceiling"]["fit_seconds"][0] > 0
  # --start-heads ceiling (the default): the heads arms start from the ceiling's step-0 fit, so
  # at batch 0 (policy 0, the same heads) static and ceiling propose alike
  assert data["meta"]["args"]["start_heads"] == "ceiling"
  s0, c0 = data["arms"]["static"][0], data["arms"]["ceiling"][0]
  assert (s0["tau"], s0["forwards"], s0["acceptance"]) == (c0["tau"], c0["forwards"],
                                                            c0["acceptance"])
  # the ceiling's fits are cached beside the policies: a second fit reads them back bit for bit
  cached = sorted((pol / "ceiling").glob("*.safetensors"))
  assert len(cached) == 2  # policies 0 and 2 (every 2nd)
  assert {g["status"] for g in data["goals"]} <= {"PASS", "MISS", "SKIP"}
  assert res["summary"].keys() == data["summary"].keys()
  # a second run reuses the complete sequence (same model and settings): no GRPO step
  capsys.readouterr()
  config, params, tok, path = pipeline.load_model(None)
  a = mod.parse(["--quick", "--policies", str(pol), "--out", str(out)])
  again = mod.ensure_policies(a, config, params, tok, mod.model_identity(params, path))
  assert "reusing the 3 saved policies" in capsys.readouterr().out
  assert again.steps == [0, 1, 2]
  sampling = mod.rollout.SamplingConfig(temperature=a.temperature)
  heads0 = pipeline.default_heads(config, params, tok, path, conditioned=True)
  monkeypatch.setattr(mod.CH, "fit", None)  # a refit would fail: every fit comes from the cache
  hs, secs, _ = mod.fit_ceilings(a, config, again, tok, mod.Task(name="synthetic", level=a.level),
                                 sampling, heads0, a.batches)
  assert secs == data["ceiling"]["fit_seconds"]
  assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(
      jax.tree.leaves(hs[0]), jax.tree.leaves(mod.CH.load(cached[0])), strict=True))
  first = jax.tree.leaves(again.get(0))
  assert all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(first, jax.tree.leaves(params), strict=True))
  # --no-drift: as many policies, every one step 0's
  frozen = again.frozen()
  assert frozen.steps == [0, 0, 0]
  assert all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(frozen.get(2)), first, strict=True))


def test_policies_of_another_model_shape_exit_2(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  pol = tmp_path / "policies"
  rng = np.random.default_rng(0)
  with Checkpointer(pol, max_to_keep=None, async_save=False) as ck:
    ck.save(0, {"embed": {"embedding": rng.normal(size=(16, 8)).astype(np.float32)},
                "w": rng.normal(size=(8, 8)).astype(np.float32)}, {"step": 0})
  main = load_script("bench_adaptation.py").main
  line = _one_line_exit_2(capsys, lambda: main(["--quick", "--policies", str(pol), "--out",
                                                str(tmp_path / "o.json")]), "--policies")
  assert str(pol) in line and "do not match the model" in line


def test_policies_of_another_model_meta_exit_2(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  pol = tmp_path / "policies"
  _, params, _, _ = pipeline.load_model(None)
  with Checkpointer(pol, max_to_keep=None, async_save=False) as ck:  # the right tree, other model
    ck.save(0, params, {"step": 0, "model": {"path": "/elsewhere", "config_hash": "0" * 16,
                                             "weights_hash": "1" * 16}})
  main = load_script("bench_adaptation.py").main
  line = _one_line_exit_2(capsys, lambda: main(["--quick", "--policies", str(pol), "--out",
                                                str(tmp_path / "o.json")]), "--policies")
  assert "another model" in line


def test_unknown_arm_exit_2(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  main = load_script("bench_adaptation.py").main
  _one_line_exit_2(capsys, lambda: main(["--arms", "static", "fastest"]), "--arms")


@pytest.mark.parametrize("buckets", [["0.5"], ["1.0", "2.0"], ["1.0", "0"]])
def test_bad_buckets_exit_2(tmp_path, monkeypatch, capsys, buckets):
  monkeypatch.chdir(tmp_path)
  parse = load_script("bench_adaptation.py").parse
  line = _one_line_exit_2(capsys, lambda: parse(["--buckets", *buckets]), "--buckets")
  assert "bucket_fractions" in line


def test_quick_replays_in_one_bucket():
  mod = load_script("bench_adaptation.py")
  a = mod.parse(["--quick"])
  assert a.buckets == [1.0] and a.arms == list(mod.QUICK_ARMS) == ["static", "both", "ceiling"]
  assert mod.parse([]).arms == list(mod.ARMS)


def test_each_arm_is_a_specroll_configuration():
  """Every arm: one tree (heads + lookup, no store), the script's fixed SpecConfig; static and
  ceiling: Reflex off, slow path "off"; both: Reflex and the slow path on degradation (the
  flags' records per batch and Reflex sleep); every_batch: a refit every batch."""
  mod = load_script("bench_adaptation.py")
  a = mod.parse(["--records-per-batch", "64", "--reflex-sleep", "2", "--reflex-sleep-max", "8",
                 "--slow-steps", "3"])
  config, _, tok, _ = pipeline.load_model(None)
  spec = mod.rollout.SpecConfig(node_budget=40, bucket_fractions=(1.0, 0.5))
  sr = {x: mod.arm_specroll(arm, a, config, sampling=mod.rollout.SamplingConfig(1.0), spec=spec,
                            num_heads=3, prompt_width=48, eos_ids=tuple(tok.eos_ids))
        for x, arm in mod.ARMS.items()}
  for x, s in sr.items():
    assert (s.budget, s.spec, s.store_prompts, s.prompt_width) == ("fixed", spec, 0, 48), x
    assert s.lookup is not None and s.records_per_batch == 64 and s.group_size == a.group, x
    assert s.slow.refresh_steps == 3 and s.slow.learning_rate == a.slow_lr, x
  assert {x: (s.reflex is not None, s.slow.mode) for x, s in sr.items()} == {
      "static": (False, "off"), "reflex": (True, "off"), "slow": (False, "degradation"),
      "both": (True, "degradation"), "every_batch": (False, "every_batch"),
      "scheduled": (True, "scheduled"), "ceiling": (False, "off")}
  assert sr["static"] == sr["ceiling"]  # the ceiling differs by its heads alone
  r = sr["both"].reflex
  assert (r.sleep_batches, r.sleep_max_batches, r.record_capacity) == (2, 8, 0)
  heads_alone = mod.arm_specroll(mod.ARMS["static"], mod.parse(["--no-lookup"]), config,
                                 sampling=mod.rollout.SamplingConfig(1.0), spec=spec, num_heads=3,
                                 prompt_width=48, eos_ids=tuple(tok.eos_ids))
  assert heads_alone.lookup is None


def test_no_lookup_drops_or_refuses_the_reflex_arms(tmp_path, monkeypatch, capsys):
  """Reflex runs on the heads + lookup tree: --no-lookup leaves the Reflex arms out by default
  and refuses them when named."""
  monkeypatch.chdir(tmp_path)
  mod = load_script("bench_adaptation.py")
  assert mod.parse(["--no-lookup"]).arms == ["static", "slow", "every_batch", "ceiling"]
  assert mod.parse(["--no-lookup", "--quick"]).arms == ["static", "ceiling"]
  line = _one_line_exit_2(capsys, lambda: mod.parse(["--no-lookup", "--arms", "static", "both"]),
                          "--arms")
  assert "both" in line and "lookup" in line


def test_in_loop_cost_is_charged_on_awake_batches_against_static_on_the_same_batches():
  """summarize: the in-loop cost compares an arm's ms per forward with static's on the same
  batches where Reflex ran; the batches where it slept (static's own program) give the noise
  figure apart and are not charged."""
  a = load_script("bench_adaptation.py").parse([])
  mod = load_script("_drift_report.py")

  def rec(b, seconds, forwards, asleep=None, tau=1.5):
    return {"batch": b, "seconds": seconds, "forwards": forwards, "tau": tau, "acceptance": [0.5],
            "same": True, "host_seconds": 0.01, "compile_seconds": 0.0,
            "reflex": None if asleep is None else {"asleep": asleep}}

  static = [rec(0, 1.0, 10), rec(1, 2.0, 10), rec(2, 1.0, 10), rec(3, 1.0, 10)]
  # awake batches 0 and 1: 10% slower per forward than static there; asleep 2, 3: 4% faster
  reflex = [rec(0, 1.1, 10, False), rec(1, 2.2, 10, False), rec(2, 0.96, 10, True),
            rec(3, 0.96, 10, True)]
  s = mod.summarize({"static": static, "reflex": reflex}, [1.0] * 4, a)["reflex"]
  assert s["in_loop_cost"] == pytest.approx(0.10)
  assert s["in_loop_asleep_cost"] == pytest.approx(-0.04)
  roll = 1.1 + 2.2 + 0.96 + 0.96
  assert s["in_loop_share"] == pytest.approx(0.3 / roll)  # (3.3 - 3.0) s over the rollout
  assert s["host_share"] == pytest.approx(0.04 / roll)
  assert s["asleep_batches"] == 2
  assert mod.summarize({"static": static}, [1.0] * 4, a)["static"]["in_loop_asleep_cost"] is None
  # with the slow path's records (the anchor hidden states) an asleep batch is no longer static's
  # program: every batch is charged, none gives the noise figure
  both = [{**r, "slow": {"records": [4]}} for r in reflex]
  s = mod.summarize({"static": static, "both": both}, [1.0] * 4, a)["both"]
  assert s["in_loop_asleep_cost"] is None and s["asleep_batches"] == 2
  assert s["in_loop_cost"] == pytest.approx((1.1 + 2.2 + 0.96 + 0.96) / 5.0 - 1)
  assert s["in_loop_share"] == pytest.approx(0.22 / roll) and s["records"] == 16
