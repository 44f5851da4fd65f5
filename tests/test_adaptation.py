"""Adaptation through ``SpecRoll``: Reflex corrections and slow-path refreshes between batches never
change a committed token (the vanilla engine's, token for token); the state ``generate`` carries
compiles once and checkpoints by orbax as is; Reflex runs on root-conditioned heads only, sleeps
after a batch whose corrections did not pay (the plain heads propose) and wakes for a probe."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LONG

from app.checkpoint import Checkpointer
from specroll_jax import SpecRoll, rollout
from specroll_jax.adaptation import reflex
from specroll_jax.adaptation import slow_path as SP
from specroll_jax.engines import executables as _exe
from specroll_jax.heads import conditioned as CH
from specroll_jax.heads import medusa as H
from specroll_jax.proposers import Merged, MergedReflex
from specroll_jax.rollout import SamplingConfig, SpecConfig

# gates opened wide (a negative LCB z passes almost any alignment) so that corrections really
# happen within a few short rollouts: exactness must hold whatever the proposals are
EAGER = reflex.ReflexConfig(min_obs=(2, 2, 2), min_severity=(0.05, 0.05, 0.05), stride_rows=1.0,
                            lcb_z=-5.0, record_capacity=0)
SPEC = SpecConfig(node_budget=24, bucket_fractions=(1.0, 0.5))
G = 2


def _heads(config, seed):
  """Random root-conditioned heads (what Reflex corrects), away from the identity."""
  ch = CH.init(jax.random.key(seed), config, 3, width=32)
  return ch.replace(w_o=0.05 * jax.random.normal(jax.random.key(seed + 1), ch.w_o.shape))


def _vanilla(config, params, sr, batch, seed):
  """The vanilla engine on the rows of ``batch`` (same sample ids, EOS ids and cache length)."""
  return rollout.generate(config, params, batch.tokens, prompt_lengths=batch.lengths,
                          sample_ids=batch.sample_ids, max_new_tokens=sr.max_new_tokens,
                          seed=seed, sampling=sr.sampling, eos_ids=list(sr.eos_ids),
                          options=rollout.DecodeOptions(cache_length=batch.cache_length))


@pytest.mark.parametrize("sampling", [
    pytest.param(SamplingConfig(temperature=0.0), marks=LONG),
    pytest.param(SamplingConfig(temperature=0.7, top_p=0.9), marks=LONG),
    pytest.param(SamplingConfig(temperature=1.0, top_k=3), marks=LONG),
    pytest.param(SamplingConfig(temperature=1.0), marks=pytest.mark.slow)], ids=str)
def test_reflex_and_slow_path_never_change_tokens(trained_model, gsm8k_prompts, sampling,
                                                  tmp_path):
  """Three batches of a SpecRoll with Reflex awake (gates open wide) and the slow path refreshing
  every batch: the vanilla tokens every time, Reflex corrections and slow-path refreshes really
  happen, new heads and safety compile nothing after the first batch, the state checkpoints as
  is."""
  config, params, tok = trained_model
  prompts, ids = gsm8k_prompts[:8], np.arange(8)  # one row each: greedy rows differ too
  slow = SP.SlowPathConfig.for_tests(mode="every_batch", learning_rate=1e-3, guard=False)
  base = SpecRoll(config, max_new_tokens=40, sampling=sampling, group_size=1, eos_ids=(),
                  reflex=EAGER, slow=slow, records_per_batch=128, spec=SPEC, budget="fixed")
  free = np.asarray(_vanilla(config, params, base, base.batch(prompts, ids), 0).tokens)
  eos = sorted({*tok.eos_ids, int(free[0, 12]), int(free[3, 25])})  # tokens met mid-response
  sr = dataclasses.replace(base, eos_ids=tuple(eos))
  batch = sr.batch(prompts, ids)
  state = sr.init(_heads(config, 4))
  assert sr.has_reflex(state) and state.slow is not None
  corrected = refreshed = 0
  programs = []
  for b in range(3):
    ref = _vanilla(config, params, sr, batch, b)
    out, rep, new = sr.generate(params, batch, state, seed=b)
    programs.append(_exe.programs())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)
    lens = np.asarray(ref.lengths)
    assert lens.min() < 40  # EOS inside trees: some rows end early
    assert int(np.asarray(out.stats.spec.bucket_forwards)[1]) > 0  # compacted into bucket 2
    assert rep.mode == "speculative" and rep.reflex == "awake"
    corrected += int(np.asarray(out.stats.spec.proposer.reflex.applied).sum()) > 0
    refreshed += len(rep.slow.heads) > 0
    assert int(new.batches) == b + 1
    assert jax.tree.structure(new) == jax.tree.structure(state)
    if rep.slow.kept:
      assert any(not np.array_equal(np.asarray(x), np.asarray(y))
                 for x, y in zip(jax.tree.leaves(state.heads), jax.tree.leaves(new.heads),
                                 strict=True))
    if b > 0:  # new heads, safety, store and calibration: nothing compiles
      assert rep.compile_seconds == 0.0 and rep.slow.compile_seconds == 0.0
    state = new
    if sampling.top_k:  # the records' p is the restricted target's: at most top_k ids carry mass
      res = state.slow.reservoir
      valid = np.asarray(res.valid)
      held = (np.asarray(res.p) > 0).sum(-1)[valid]
      assert valid.sum() > 0 and held.max() <= sampling.top_k
      assert (np.asarray(res.support)[valid] >= 0).sum(-1).max() > sampling.top_k
  assert corrected > 0 and refreshed > 0  # both paths really acted between and inside batches
  assert programs[1] == programs[0] and programs[2] == programs[0]
  with Checkpointer(tmp_path / "ckpt", async_save=False) as ck:
    ck.save(3, state, {"batch": 3})
    back, meta = ck.restore(like=state)
  assert meta["batch"] == 3
  chex.assert_trees_all_equal(state, back)  # same structure, types, shapes, dtypes and values
  sr.check_state(back)  # this object's state, carried on as is


def test_adaptation_follows_the_object(trained_model):
  """Reflex and the slow path take their settings from the object (the heads' tree, the sampling
  temperature); Reflex corrects root-conditioned heads only (Medusa heads propose plainly); heads
  of another size are refused."""
  config, params, _ = trained_model
  sr = SpecRoll(config, max_new_tokens=4, group_size=G, sampling=SamplingConfig(temperature=0.7),
                reflex=EAGER, budget="fixed", spec=SPEC)
  h = sr.heads_tree
  assert (sr.reflex.topk, sr.reflex.beams, sr.reflex.max_nodes) == (h.topk, h.beams, h.max_nodes)
  assert sr.reflex.conditioned and sr.reflex.coupled == h.coupled
  assert sr.slow.temperature == 0.7
  assert dataclasses.replace(sr, sampling=SamplingConfig(temperature=0.0)).slow.temperature == 1.0
  batch = sr.batch([[1, 2]], [0])
  medusa = sr.init(H.init(jax.random.key(5), config, 3))
  assert medusa.reflex is None and not sr.has_reflex(medusa) and medusa.slow is not None
  plan = sr.plan(medusa, batch)
  assert plan.reflex == "off" and type(plan.proposer) is Merged
  with pytest.raises(ValueError, match="heads has 2 heads, expected 3"):
    sr.init(CH.init(jax.random.key(5), config, 2))
  with pytest.raises(ValueError, match="heads has 2 heads"):
    sr.init(H.init(jax.random.key(5), config, 2))
  with pytest.raises(ValueError, match="SpecRoll.reflex"):
    SpecRoll(config, max_new_tokens=4, reflex={"sleep_batches": 2})


def test_reflex_sleeps_after_an_unpaid_batch_and_wakes_for_a_probe(trained_model, gsm8k_prompts):
  """ReflexConfig.sleep_batches: an awake batch whose corrections did not pay (here: none can be
  applied) puts Reflex to sleep; while ``reflex.sleep`` > 0 the plain heads propose (``Merged``,
  no Reflex in the decode loop), each sleeping batch counts the sleep down, and the batch after
  it is awake again (a probe); unpaid again, it sleeps twice as long (up to
  ``sleep_max_batches``). The committed tokens are the vanilla ones throughout."""
  config, params, _ = trained_model
  never = reflex.ReflexConfig(sleep_batches=2, sleep_max_batches=4, min_obs=(10**6,) * 3,
                              record_capacity=0)
  sr = SpecRoll(config, max_new_tokens=16, group_size=G, sampling=SamplingConfig(temperature=1.0),
                eos_ids=(), reflex=never, slow=SP.SlowPathConfig(mode="off"), budget="fixed",
                spec=SpecConfig(node_budget=8, bucket_fractions=(1.0,)))
  batch = sr.batch(gsm8k_prompts[:2], np.arange(2))
  state = sr.init(_heads(config, 6))
  plan = sr.plan(state, batch)
  assert plan.reflex == "awake" and isinstance(plan.proposer, MergedReflex)
  sleepy = sr.plan(state.replace(reflex=state.reflex.replace(sleep=jnp.int32(2))), batch)
  assert sleepy.reflex == "asleep" and type(sleepy.proposer) is Merged
  ref = np.asarray(_vanilla(config, params, sr, batch, 0).tokens)
  safety = np.asarray(state.reflex.safety)
  modes, sleeps = [], []
  for _ in range(5):
    out, rep, state = sr.generate(params, batch, state, seed=0)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    assert out.stats.tokens_per_forward > 1.0  # the tree really proposed
    if rep.reflex == "awake":  # nothing applied: no gain measured, so the batch did not pay
      assert int(np.asarray(out.stats.spec.proposer.reflex.gain_n).max()) < 2
    modes.append(str(rep.reflex))
    sleeps.append(int(state.reflex.sleep))
  assert modes == ["awake", "asleep", "asleep", "awake", "asleep"]
  assert sleeps == [2, 1, 0, 4, 3]  # the second unpaid batch doubles the sleep
  assert int(state.batches) == 5 and rep.safety == tuple(float(x) for x in safety)
