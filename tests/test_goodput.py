"""Goodput budgets: the cost model's checks and interpolation; where trees cannot pay no node is
verified, where the cost is flat and proposals are confident trees grow; a cost model is
tabulated from up to six measured steps (one compiled program each) and cached; per-bucket node
counts run exactly; calibration counts."""

import contextlib

import jax
import numpy as np
import pytest

from specroll_jax import rollout
from specroll_jax.adaptation import calibration, goodput
from specroll_jax.engines.config import DecodeSettings
from specroll_jax.kernels import Kernels
from specroll_jax.proposers import TreeStats
from specroll_jax.proposers.group_lookup import GroupLookup
from specroll_jax.rollout import SamplingConfig, SpecConfig

SPEC = SpecConfig(bucket_fractions=(1.0, 0.5, 0.25))


def _cost(per_node):
  rows, nodes = (64, 32, 16), (0, 1, 2, 4)
  sec = [[r * 1e-4 * (1 + per_node * n) for n in nodes] for r in rows]
  return goodput.CostModel(rows=rows, node_counts=nodes, seconds=sec)


def test_cost_model_checks_and_interpolates():
  with pytest.raises(ValueError, match=r"seconds has shape \(2, 2\), expected \(2, 3\)"):
    goodput.CostModel(rows=(8, 4), node_counts=(0, 1, 2), seconds=[[1, 2], [3, 4]])
  with pytest.raises(ValueError, match="node_counts must start at 0"):
    goodput.CostModel(rows=(8,), node_counts=(1, 2), seconds=[[1, 2]])
  with pytest.raises(ValueError, match="rows must be distinct"):
    goodput.CostModel(rows=(4, 8), node_counts=(0,), seconds=[[1], [1]])
  c = _cost(0.5)
  assert c.cost(64, 2) == pytest.approx(64e-4 * 2)
  assert c.cost(48, 0) == pytest.approx(48e-4)  # interpolated
  assert c.cost(128, 0) == pytest.approx(128e-4)  # in proportion beyond the largest
  with pytest.raises(ValueError, match="n=3 was not measured"):
    c.cost(64, 3)
  assert goodput.CostModel.from_json(c.to_json()) == c


def test_cost_fit_passes_through_its_measurements_and_grows_with_nodes_and_rows():
  """The table holds the measured row counts; at each, the plain step, the smallest and the
  largest tree as measured and the node counts between on the line through their neighbours
  (a fixed price per tree step: a 1-node tree costs more than a quarter of a 4-node one's extra);
  rows in between are interpolated; noise out of order is clamped monotone."""
  rows, nodes = (64, 32, 16), (0, 1, 2, 4)
  assert goodput.measured_points(rows, nodes) == ((64, 0), (64, 1), (64, 4), (16, 0), (16, 1),
                                                  (16, 4))
  assert goodput.measured_points(rows, (0, 4)) == ((64, 0), (64, 4), (16, 0), (16, 4))
  assert goodput.measured_points((8,), (0,)) == ((8, 0),)
  # by hand: plain 1 + R / 16 ms; a tree adds 3 ms + R / 32 ms per node (a fixed price per step)
  ms = lambda r, n: 1e-3 * (1 + r / 16 + (n > 0) * (3 + n * r / 32))
  measured = {p: ms(*p) for p in goodput.measured_points(rows, nodes)}
  c = goodput.fit_cost(rows, nodes, measured)
  assert c.rows == (64, 16) and c.node_counts == nodes
  for (r, n), sec in measured.items():
    assert c.cost(r, n) == pytest.approx(sec, rel=1e-12)  # through every measurement
  assert c.cost(64, 2) == pytest.approx(ms(64, 2))  # affine in n above the smallest tree
  assert c.cost(16, 2) == pytest.approx(ms(16, 2))
  assert c.cost(32, 2) == pytest.approx((ms(64, 2) + 2 * ms(16, 2)) / 3)  # between the rows
  assert c.cost(64, 1) - c.cost(64, 0) > (c.cost(64, 4) - c.cost(64, 0)) / 4  # not linear from 0
  sec = np.asarray(c.seconds)
  assert (np.diff(sec, axis=1) > 0).all() and (np.diff(sec[::-1], axis=0) > 0).all()
  # noise out of order: a tree below a smaller one is flat in n; fewer rows dearer is flat
  noisy = goodput.fit_cost(rows, (0, 4), {(64, 0): 2.0, (64, 4): 1.9, (16, 0): 2.1,
                                          (16, 4): 2.2})
  np.testing.assert_allclose(noisy.seconds, [[2.1, 2.2], [2.1, 2.2]])
  one = goodput.fit_cost((8,), (0, 2), {(8, 0): 1.0, (8, 2): 3.0})
  assert one.cost(4, 2) == pytest.approx(1.5)  # one row count: in proportion to rows
  with pytest.raises(ValueError, match=r"missing \[\(16, 0\), \(16, 4\)\]"):
    goodput.fit_cost(rows, (0, 4), {(64, 0): 1.0, (64, 4): 2.0})


def test_choose_verifies_nothing_where_trees_cannot_pay_and_grows_trees_where_they_do():
  modest = np.array([0.0, 0.3, 0.45, 0.55, 0.6])
  spec, why = goodput.choose(_cost(0.5), modest, 64, SPEC, capacity=8)
  assert spec.nodes == (0, 0, 0) and all(w.nodes == 0 for w in why)
  confident = np.array([0.0, 0.9, 1.7, 2.4, 3.0])
  spec, _ = goodput.choose(_cost(0.0), confident, 64, SPEC, capacity=8)  # flat: GPU-like
  assert spec.nodes == (4, 4, 4)
  spec, _ = goodput.choose(_cost(0.0), confident, 64, SPEC, capacity=2)  # the proposer's cap
  assert spec.nodes == (2, 2, 2)
  spec, _ = goodput.choose(_cost(0.6), confident, 64, SPEC, capacity=8)  # (1 + e) / cost peaks
  assert spec.nodes == (2, 2, 2)  # at n = 2: 1.19, 1.23, 1.18 for n = 1, 2, 4
  with pytest.raises(ValueError, match="expected must be a 1-D array"):
    goodput.choose(_cost(0.0), np.zeros((2, 2)), 64, SPEC, capacity=8)


def test_spec_config_nodes_per_bucket():
  with pytest.raises(ValueError,
                     match=r"SpecConfig.nodes must hold len\(bucket_fractions\)=2 ints >= 0"):
    SpecConfig(bucket_fractions=(1.0, 0.5), nodes=(1,))
  s = SpecConfig(bucket_fractions=(1.0, 0.5, 0.25), nodes=(0, 2, 9))
  assert s.bucket_shapes(8, capacity=4) == [(8, 0), (4, 2), (2, 4)]
  assert s.bucket_shapes(2, capacity=4) == [(2, 0), (1, 2)]  # repeated row counts dropped


@contextlib.contextmanager
def _programs_compiled():
  """The names of the programs XLA compiles (or loads from jax's persistent cache) inside."""
  names = []

  def listen(event, duration, **kw):
    del duration
    if event == "/jax/core/compile/backend_compile_duration":
      names.append(kw.get("fun_name"))

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.slow  # a cost-model measurement: about 20 s
def test_zero_nodes_verify_nothing_and_measured_cost_is_cached(trained_model, gsm8k_prompts,
                                                                tmp_path, monkeypatch):
  config, params, tok = trained_model
  prompts = gsm8k_prompts[:8]
  kw = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=24, seed=1,
            eos_ids=tok.eos_ids)
  ref = rollout.generate(config, params, prompts, **kw)
  gl = GroupLookup()
  spec = SpecConfig(bucket_fractions=(1.0, 0.5), nodes=(0, 0))
  got = rollout.generate(config, params, prompts,
                         speculation=rollout.Speculation(gl, gl.context(), spec), **kw)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
  assert int(got.stats.spec.nodes_verified) == 0
  pb = rollout.prepare_batch(config, prompts, max_new_tokens=24)
  settings = DecodeSettings(sampling=kw["sampling"], max_new_tokens=24,
                            cache_length=pb.cache_length, kernels=Kernels.resolve("reference"))
  args = dict(settings=settings, rows=(4, 2), node_counts=(0, 2), steps=2, repeats=1,
              cache_dir=tmp_path, progress=False)
  fits, fit_cost = [], goodput.fit_cost
  monkeypatch.setattr(goodput, "fit_cost", lambda *a, **k: fits.append(a) or fit_cost(*a, **k))
  with _programs_compiled() as programs:  # one per measured point, and the per-layer slicing
    cost = goodput.measure_cost(config, params, gl, gl.context(), pb.tokens, pb.lengths, **args)
  assert programs.count("jit(unstack_layers)") == 1, programs
  timed = [p for p in programs if p != "jit(unstack_layers)"]
  assert len(timed) == len(goodput.measured_points((4, 2), (0, 2))) == 4, programs
  assert cost.rows == (4, 2) and cost.node_counts == (0, 2)
  (_, _, measured), = fits
  assert sorted(measured) == [(2, 0), (2, 2), (4, 0), (4, 2)]
  # the plain step at the most rows as measured, unless noise made the fewest rows' step slower
  # (fit_cost clamps: more rows never cost less)
  assert cost.cost(4, 0) == pytest.approx(max(measured[(4, 0)], measured[(2, 0)]), rel=1e-12)
  assert cost.cost(2, 0) == pytest.approx(measured[(2, 0)], rel=1e-12)
  assert all(s > 0 for r in cost.seconds for s in r)
  assert all(r[0] <= r[1] for r in cost.seconds)  # monotone in nodes
  assert len(list(tmp_path.glob("cost-*.json"))) == 1
  with _programs_compiled() as programs:
    assert goodput.measure_cost(config, params, gl, gl.context(), pb.tokens, pb.lengths,
                                **args) == cost
  assert programs == []  # read from the cache


def test_calibration_counts_and_checks():
  counts = lambda t, h: TreeStats.zeros(len(t), 1).replace(tested=np.asarray(t),
                                                           hit=np.asarray(h))
  cal = calibration.init(np.array([0.5, 0.1]), strength=2.0, decay=0.5)
  np.testing.assert_allclose(cal.table(), [0.5, 0.1])
  cal = cal.update(counts([10, 0], [9, 0]))
  np.testing.assert_allclose(cal.table(), [(9 + 1) / 12, 0.1], rtol=1e-6)
  cal = cal.update(counts([0, 0], [0, 0]))  # older counts decay
  np.testing.assert_allclose(cal.table(), [(4.5 + 1) / 7, 0.1], rtol=1e-6)
  with pytest.raises(ValueError, match="Calibration has 2 bins"):
    cal.update(counts(np.zeros(3), np.zeros(3)))
  with pytest.raises(ValueError, match="hit counts must lie in"):
    cal.update(counts([1, 1], [2, 0]))
  with pytest.raises(ValueError, match="Calibration.update takes a TreeStats, got tuple"):
    cal.update((np.array([1, 1]), np.array([1, 0])))
  with pytest.raises(ValueError, match="prior must be probabilities"):
    calibration.init(np.array([1.5]))
  leaves = jax.tree.leaves(cal)
  assert len(leaves) == 3  # a pytree of arrays (orbax-checkpointable)


@pytest.mark.slow  # about 17 s
@pytest.mark.long
def test_gated_steps_run_the_plain_step_exactly(trained_model, gsm8k_prompts):
  config, params, tok = trained_model
  prompts = [p for p in gsm8k_prompts[:4] for _ in range(2)]
  kw = dict(sampling=SamplingConfig(temperature=0.7), max_new_tokens=24, seed=3,
            sample_ids=np.arange(8), eos_ids=tok.eos_ids)
  ref = rollout.generate(config, params, prompts, **kw)
  gl = GroupLookup(group_size=2)
  runs = {}
  for gate in (0.0, 1e9):
    spec = SpecConfig(bucket_fractions=(1.0, 0.5), nodes=(3, 3), gate=(gate, gate))
    got = rollout.generate(config, params, prompts,
                           speculation=rollout.Speculation(gl, gl.context(), spec), **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
    runs[gate] = got.stats
  assert int(runs[0.0].spec.skipped) == 0 and int(runs[0.0].spec.nodes_verified) > 0
  never = runs[1e9]
  assert int(never.spec.skipped) == int(never.target_forwards)  # every step gated off
  assert int(never.spec.nodes_verified) == 0 and int(never.spec.proposer.tested.sum()) == 0
  with pytest.raises(ValueError, match="SpecConfig.gate must hold one None or number"):
    SpecConfig(bucket_fractions=(1.0, 0.5), gate=(1.0,))
  spec, _ = goodput.choose(_cost(0.5), np.array([0.0, 0.3, 0.45, 0.55, 0.6]), 64, SPEC,
                           capacity=8, gated=True)
  assert spec.nodes[0] == 1 and spec.gate[0] == pytest.approx(0.5)  # break-even of n = 1


def test_choices_run_any_node_count_per_bucket_from_one_program(trained_model, gsm8k_prompts):
  """``SpecConfig.choices``: one compiled program runs every per-bucket choice of node counts
  given at run time (goodput's per batch), each exactly as the program compiled for that choice
  (the vanilla tokens; nodes verified only where the count is > 0); a count outside the choices
  runs the plain step; shapes are checked by name."""
  from specroll_jax.engines import SpecEngine, executables
  config, params, tok = trained_model
  prompts = [p for p in gsm8k_prompts[:4] for _ in range(2)]
  pb = rollout.prepare_batch(config, prompts, max_new_tokens=24, sample_ids=np.arange(8),
                             eos_ids=tok.eos_ids)
  sampling = SamplingConfig(temperature=1.0)
  ref = rollout.generate(config, params, pb.tokens, prompt_lengths=pb.lengths, max_new_tokens=24,
                         sample_ids=pb.sample_ids, seed=3, eos_ids=tok.eos_ids, sampling=sampling,
                         options=rollout.DecodeOptions(cache_length=pb.cache_length))
  gl = GroupLookup(group_size=2)
  spec = SpecConfig(bucket_fractions=(1.0, 0.5), choices=(0, 3))
  engine = SpecEngine.build(config, proposer=gl, max_new_tokens=24, cache_length=pb.cache_length,
                            sampling=sampling, spec=spec, kernels="reference")
  before = executables.programs()
  verified = {}
  for nodes in ((0, 3), (3, 0), (0, 0), (3, 3), (0, 2)):
    out = executables.run(engine, params, gl.context(), pb.device(3), np.asarray(nodes, np.int32))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    fwd = np.asarray(out.stats.spec.bucket_forwards)
    verified[nodes] = int(out.stats.spec.nodes_verified)
    if nodes[0] == 3:  # (the second bucket runs only if rows finish early)
      assert verified[nodes] > 0
    elif fwd[1] == 0:  # the plain step in the first bucket (2 is not a choice: plain too)
      assert verified[nodes] == 0
  assert executables.programs() == before + 1  # one program for every choice
  # counts per bucket fraction: the first bucket compiled for the plain step alone (no switch)
  per = SpecEngine.build(config, proposer=gl, max_new_tokens=24, cache_length=pb.cache_length,
                         sampling=sampling, kernels="reference", spec=SpecConfig(
                             bucket_fractions=(1.0, 0.5), choices=((0,), (0, 3))))
  assert per.spec.choices == ((0,), (0, 3))
  out = executables.run(per, params, gl.context(), pb.device(3), np.asarray((3, 3), np.int32))
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  if int(out.stats.spec.bucket_forwards[1]) == 0:  # (3 is not a count of the first bucket)
    assert int(out.stats.spec.nodes_verified) == 0
  with pytest.raises(ValueError, match="nodes must hold one count per bucket fraction"):
    engine(params, gl.context(), pb.device(3), np.zeros((3,), np.int32))
  with pytest.raises(ValueError, match="goes with SpecConfig.choices"):
    engine(params, gl.context(), pb.device(3))
  with pytest.raises(ValueError, match="excludes nodes and gate"):
    SpecConfig(bucket_fractions=(1.0,), choices=(0, 2), nodes=(2,))
  with pytest.raises(ValueError, match="SpecConfig.choices must be distinct"):
    SpecConfig(choices=(2, 0))
  with pytest.raises(ValueError, match="or one per bucket fraction"):
    SpecConfig(bucket_fractions=(1.0, 0.5), choices=((0,), (0, 2), (0, 4)))
