"""Experiment glue: GRPO batches (each prompt G times; sample id = prompt index * G + member)."""

import numpy as np
import pytest

from app import pipeline


def test_grpo_batch_sample_ids():
  rep, sids = pipeline.grpo_batch([[1], [2, 3]], 3, first_prompt_index=5)
  assert rep == [[1], [1], [1], [2, 3], [2, 3], [2, 3]]
  np.testing.assert_array_equal(sids, [15, 16, 17, 18, 19, 20])  # prompt index * G + member
  assert len(set(sids.tolist())) == len(sids)  # unique: generate refuses duplicates


def test_grpo_batch_rejects_bad_group_size():
  with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
    pipeline.grpo_batch([[1]], 0)


def test_run_config_vanilla_buckets():
  from app.loop import RunConfig
  assert RunConfig().vanilla_buckets is None  # the engine's default buckets
  assert RunConfig(vanilla_buckets=[1.0, 0.5]).vanilla_buckets == (1.0, 0.5)
  for bad in ((0.5,), (1.0, 2.0), ()):
    with pytest.raises(ValueError, match=r"RunConfig.vanilla_buckets must start at 1.0"):
      RunConfig(vanilla_buckets=bad)


def _heads(config):
  import jax

  from specroll_jax.heads import conditioned as CH
  heads = CH.init(jax.random.key(0), config, 3, width=32)
  return heads.replace(w_o=0.05 * jax.random.normal(jax.random.key(1), heads.w_o.shape))


def test_static_heads_propose_as_specrolls_plain_heads(trained_model):
  """The static-heads rollout's proposer (``rollout.Speculation.of_heads`` of root-conditioned
  heads) is the tree of a SpecRoll with Reflex, lookup and slow path off: the same
  ``RankedHeads`` and, before any calibration, the same acceptance table."""
  from specroll_jax import SpecRoll, rollout
  from specroll_jax.adaptation.slow_path import SlowPathConfig
  from specroll_jax.proposers import RankedHeads
  from specroll_jax.rollout import SpecConfig

  config, params, tok = trained_model
  heads = _heads(config)
  spec = SpecConfig(node_budget=8)
  static = rollout.Speculation.of_heads(heads, spec)
  sr = SpecRoll(config, max_new_tokens=12, group_size=2, lookup=None, reflex=None,
                slow=SlowPathConfig(mode="off"), spec=spec, budget="fixed")
  state, batch = sr.init(heads), sr.batch([[1, 2, 3]], [0])
  plan = sr.plan(state, batch)
  assert plan.mode == "speculative" and plan.reflex == "off"
  assert isinstance(static.proposer, RankedHeads) and static.proposer == plan.proposer
  assert static.params.heads is heads
  table = state.calibration.table().reshape(np.shape(static.params.acceptance))
  np.testing.assert_array_equal(np.asarray(static.params.acceptance), table)
  with pytest.raises(ValueError, match="heads has 3 heads but tree.num_heads=2"):
    rollout.Speculation.of_heads(heads, spec, tree=RankedHeads.for_heads(2))
  with pytest.raises(ValueError, match="heads is None"):
    rollout.Speculation.of_heads(None, spec)


@pytest.mark.slow  # a Run with its warm-up compiles
def test_run_static_heads_rollout_with_root_conditioned_heads(trained_model, tmp_path):
  """RunConfig(rollout="static-heads") with root-conditioned heads (SpecRoll with Reflex, lookup
  and slow path off: the plain heads of ``test_static_heads_propose_as_specrolls_plain_heads``)
  commits the vanilla run's tokens."""
  from app.loop import Run, RunConfig
  from specroll_jax.grpo.config import GRPOConfig
  from specroll_jax.rollout import SpecConfig

  config, params, tok = trained_model
  heads = _heads(config)
  outs = {}
  for kind in ("static-heads", "vanilla"):
    run = RunConfig(grpo=GRPOConfig(group_size=2), prompts_per_step=2, max_new_tokens=12,
                    steps=1, rollout=kind, spec=SpecConfig(node_budget=8), vanilla_buckets=(1.0,))
    r = Run(run, config, params, tok, heads, tmp_path / kind, log=lambda *a: None)
    outs[kind], _, _ = r.trainer.rollout(r.local_params(), r.batch(0), r.state.specroll)
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

  from app.loop import Run, RunConfig
  from app.trainer import StepMetrics
  from specroll_jax.grpo import GRPOConfig

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


def test_assets_load_is_the_pipelines_embedded_model(tmp_path, monkeypatch):
  """``specroll_jax.assets.load()`` (the library's way, no app needed) reads the model, tokenizer
  and root-conditioned heads that ``pipeline.load_model()`` and ``default_heads(...,
  conditioned=True)`` read for the embedded model; a missing shipped file is refused by name."""
  from conftest import leaves_equal

  from specroll_jax import assets

  config, params, tok, heads = assets.load()
  config2, params2, tok2, path = pipeline.load_model(progress=False)
  assert path == assets.path() and config == config2 and leaves_equal(params, params2)
  text = "Question: Mia has 12 apples. She gives 5 of them to Leo."
  assert tok.encode(text) == tok2.encode(text) and tok.eos_ids == tok2.eos_ids
  assert leaves_equal(heads, pipeline.default_heads(config2, params2, tok2, path, conditioned=True))
  monkeypatch.setattr(assets, "path", lambda: tmp_path)
  with pytest.raises(FileNotFoundError, match="the embedded model's config.json is missing"):
    assets.load()
