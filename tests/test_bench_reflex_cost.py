"""experiments/bench_reflex_cost.py in-process: the --quick run (the tiny model and a 2-layer cut of
the Qwen2.5-1.5B shape) writes a row per proposer variant with positive times, Reflex's share
equal to its extra over the static heads divided by the verify forward, and bad flags fail in one
line with exit code 2."""

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
  spec = importlib.util.spec_from_file_location("_exp_bench_reflex_cost",
                                                EXP / "bench_reflex_cost.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.slow  # the quick benchmark: 40-60 s cold
@pytest.mark.long
def test_quick_run_writes_consistent_rows(bench, tmp_path):
  out = tmp_path / "cost.json"
  bench.main(["--quick", "--out", str(out)])
  data = json.loads(out.read_text())
  assert data["meta"]["cpu"] and data["meta"]["quick"]
  models = data["models"]
  assert len(models) == 2 and "1.5B" in models[1]["label"]
  assert models[1]["config"]["vocab_size"] == 151936 and models[1]["config"]["num_layers"] == 2
  for m in models:
    variants = {(r["variant"], r["regime"]) for r in m["rows"]}
    assert ("static heads", "full") in variants and ("reflex, gates open", "tail") in variants
    assert any(v.startswith("reflex stride 4") for v, _ in variants)
    for r in m["rows"]:
      for key in ("verify_ms", "verify_top16_ms", "static_ms", "proposer_ms"):
        assert r[key] > 0, (key, r)
      assert r["extra_ms"] == pytest.approx(r["proposer_ms"] - r["static_ms"])
      assert r["share"] == pytest.approx(r["extra_ms"] / r["verify_ms"])
      assert r["heads_share"] == pytest.approx(r["static_ms"] / r["verify_ms"])
    # the slow path's host work: a refresh at 1 and 3 steps and the trainer records, all timed;
    # the fixed / per-step split reproduces both refreshes, the replay's refresh scales it
    sp = m["slow_path"]
    tiny = m is models[0]  # the tiny model's slow path: its root-conditioned heads, + the preset
    assert m["slow_heads"] == ("CondHeads" if tiny else "Heads")
    assert len(sp["measured_ms"]) == (10 if tiny else 7)
    assert all(v > 0 for v in sp["measured_ms"].values())
    if tiny:  # the main job's refresh, timed whole: one head, two heads, one in chunks of 64
      pr = sp["preset"]
      assert (pr["records"], pr["steps"], pr["step_share"]) == (1536, 10, 0.5)
      assert [pr["one_head_ms"], pr["two_heads_ms"], pr["one_head_chunks64_ms"]] == \
          list(sp["measured_ms"].values())[7:]
      assert pr["one_head_verify_forwards"] == pytest.approx(pr["one_head_ms"] / sp["verify_ms"])
    else:
      assert sp["preset"] is None
    got = list(sp["measured_ms"].values())
    # the full-vocabulary refresh at 0, 1 and 3 steps, the support-only refresh, the records
    for x, (r0, r1, r3) in ((sp, got[:3]), (sp["support"], got[3:6])):
      assert x["refresh_fixed_ms"] + x["refresh_per_step_ms"] == pytest.approx(r1)
      assert x["refresh_fixed_ms"] + 3 * x["refresh_per_step_ms"] == pytest.approx(r3)
      assert x["refresh_passes_ms"] == pytest.approx(r0)
      assert x["refresh_passes_ms"] + x["refresh_first_step_extra_ms"] == pytest.approx(
          x["refresh_fixed_ms"])
      rp = x["replay_refresh"]  # for_small_models: 10 steps, each over half of 1536 records
      assert (rp["records"], rp["steps"], rp["step_share"]) == (1536, 10, 0.5)
      assert rp["ms"] == pytest.approx((x["refresh_fixed_ms"] + 5 * x["refresh_per_step_ms"])
                                       * 1536 / sp["records"])
      assert rp["verify_forwards"] == pytest.approx(rp["ms"] / sp["verify_ms"])
    assert sp["trainer_records_verify_forwards"] == pytest.approx(
        sp["trainer_records_ms"] / sp["verify_ms"])
    assert sp["records"] == 16 and sp["anchors"] == 8


@pytest.mark.parametrize("flags,name", [(["--models", "gpt"], "--models"),
                                        (["--rows", "0"], "--rows"),
                                        (["--accept", "5"], "--accept"),
                                        (["--layers", "29"], "--layers"),
                                        (["--dtype", "float16"], "--dtype"),
                                        (["--refresh-records", "1"], "--refresh-records"),
                                        (["--trainer-anchors", "0"], "--trainer-anchors")])
def test_bad_flag_is_one_line_and_exit_2(bench, flags, name, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    bench.main([*flags, "--out", str(tmp_path / "x.json")])
  err = capsys.readouterr().err
  lines = [x for x in err.splitlines() if x.strip()]
  assert e.value.code == 2 and len(lines) == 1 and name in lines[0], err
