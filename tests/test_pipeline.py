"""Experiment glue: GRPO batches (each prompt G times; sample id = prompt index * G + member)."""

import numpy as np
import pytest

from specroll_jax import pipeline


def test_grpo_batch_sample_ids():
  rep, sids = pipeline.grpo_batch([[1], [2, 3]], 3, first_prompt_index=5)
  assert rep == [[1], [1], [1], [2, 3], [2, 3], [2, 3]]
  np.testing.assert_array_equal(sids, [15, 16, 17, 18, 19, 20])  # prompt index * G + member
  assert len(set(sids.tolist())) == len(sids)  # unique: generate refuses duplicates


def test_grpo_batch_rejects_bad_group_size():
  with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
    pipeline.grpo_batch([[1]], 0)


def test_run_config_vanilla_buckets():
  from specroll_jax.grpo.loop import RunConfig
  assert RunConfig().vanilla_buckets is None  # the engine's default buckets
  assert RunConfig(vanilla_buckets=[1.0, 0.5]).vanilla_buckets == (1.0, 0.5)
  for bad in ((0.5,), (1.0, 2.0), ()):
    with pytest.raises(ValueError, match=r"RunConfig.vanilla_buckets must start at 1.0"):
      RunConfig(vanilla_buckets=bad)


@pytest.mark.slow  # a Run with its warm-up compiles
def test_run_static_heads_rollout_with_root_conditioned_heads(trained_model, tmp_path):
  """RunConfig(rollout="static-heads") with root-conditioned heads proposes as SpecRoll's plain
  heads do (RankedHeads under the run's ReflexConfig, adaptation.heads_proposer) and commits the
  vanilla run's tokens."""
  import jax

  from specroll_jax import adaptation
  from specroll_jax import cond_heads as CH
  from specroll_jax.grpo.config import GRPOConfig
  from specroll_jax.grpo.loop import Run, RunConfig
  from specroll_jax.proposers import RankedHeads
  from specroll_jax.rollout import SpecConfig

  config, params, tok = trained_model
  heads = CH.init(jax.random.key(0), config, 3, width=32)
  heads = heads.replace(w_o=0.05 * jax.random.normal(jax.random.key(1), heads.w_o.shape))
  prop, pp = adaptation.heads_proposer(adaptation.AdaptationConfig(), heads)
  assert isinstance(prop, RankedHeads) and pp.heads is heads
  with pytest.raises(ValueError, match="heads must be"):
    adaptation.heads_proposer(adaptation.AdaptationConfig(), params)
  outs = {}
  for kind in ("static-heads", "vanilla"):
    run = RunConfig(grpo=GRPOConfig(group_size=2), prompts_per_step=2, max_new_tokens=12,
                    steps=1, rollout=kind, spec=SpecConfig(node_budget=8), vanilla_buckets=(1.0,))
    r = Run(run, config, params, tok, heads, tmp_path / kind, log=lambda *a: None)
    outs[kind], _ = r.trainer.rollout(r.local_params(), r.batch(0))
    r.close()
  s, v = outs["static-heads"], outs["vanilla"]
  assert (np.asarray(s.tokens) == np.asarray(v.tokens)).all()
  assert (np.asarray(s.lengths) == np.asarray(v.lengths)).all()
  assert s.stats.spec is not None and s.stats.forwards > 0


@pytest.mark.slow  # a train step and a rollout compile
def test_grpo_step_is_a_function_of_state_and_batch(trained_model, tmp_path):
  """``GRPOTrainer.step(state, batch)``: the same state and batch give the same next state and
  metrics (timings aside), the step counter advances, and the step writes nothing (the app,
  ``Run``, writes the trace, metrics line and checkpoint)."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  from conftest import leaves_equal

  from specroll_jax.grpo import GRPOConfig
  from specroll_jax.grpo.loop import Run, RunConfig
  from specroll_jax.grpo.trainer import StepMetrics

  config, params, tok = trained_model
  run = RunConfig(grpo=GRPOConfig(group_size=2), prompts_per_step=2, max_new_tokens=12, steps=1,
                  rollout="vanilla", vanilla_buckets=(1.0,))
  r = Run(run, config, params, tok, None, tmp_path, log=lambda *a: None)
  copy = lambda st: dataclasses.replace(st, train=jax.tree.map(jnp.array, st.train))
  batch = r.batch(0)
  (s1, a), (s2, b) = (r.trainer.step(copy(r.state), batch) for _ in range(2))
  assert s1.step == s2.step == r.state.step + 1 == 1
  assert leaves_equal(s1.train, s2.train)
  assert int(s1.train.step) == int(r.state.train.step) + 1  # one optimizer update
  untimed = lambda m: {k: v for k, v in m.to_dict().items() if not k.endswith("_seconds")}
  assert untimed(a.metrics) == untimed(b.metrics)
  assert StepMetrics.from_dict(a.metrics.to_dict()) == a.metrics  # a metrics line round-trips
  np.testing.assert_array_equal(a.rows.tokens, b.rows.tokens)
  assert r.metrics_path.read_text() == "" and r.ckpt.latest_step() is None
  r.close()
