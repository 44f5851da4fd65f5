"""GRPO (docs/design.md, "GRPO", "No rollout/trainer mismatch"): hand-computed advantages,
objective and
k3 KL; the trainer's logprobs equal the rollout's at step 0; speculative rollouts give the same
updates as vanilla ones. (1 vs 4 devices: ``test_grpo_sharded.py``.)"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from specroll_jax import grpo, models, rollout
from specroll_jax.heads import medusa as H
from specroll_jax.proposers import HeadsProposer
from specroll_jax.sampling import SamplingConfig

# --- config ---------------------------------------------------------------------------------


def test_config_defaults_and_optimizer():
  cfg = grpo.GRPOConfig()
  assert (cfg.group_size, cfg.clip_eps_low, cfg.clip_eps_high, cfg.beta) == (8, 0.2, 0.28, 0.0)
  assert cfg.aggregation == "token_mean" and cfg.micro_batches == 1
  assert hash(cfg) == hash(grpo.GRPOConfig())  # a static jit argument
  tx = cfg.optimizer()
  assert isinstance(tx, optax.GradientTransformation)
  # clip_by_global_norm then AdamW: a huge gradient moves a parameter by about lr, not more
  p = {"w": jnp.ones(3)}
  upd, _ = tx.update({"w": jnp.full(3, 1e6)}, tx.init(p), p)
  np.testing.assert_allclose(np.asarray(upd["w"]), -cfg.learning_rate, rtol=1e-3)


@pytest.mark.parametrize("field,value,limit", [
    ("group_size", 0, ">= 1"), ("micro_batches", 1.5, ">= 1"), ("clip_eps_low", 1.0, "[0.0, 1.0)"),
    ("clip_eps_high", -0.1, "finite number >= 0.0"), ("beta", float("nan"), ">= 0.0"),
    ("learning_rate", -1e-6, ">= 0.0"), ("max_grad_norm", 0.0, "(0.0, inf]"),
    ("adam_b2", 1.0, "[0.0, 1.0)"), ("adv_eps", True, ">= 0.0")])
def test_config_rejects_bad_values(field, value, limit):
  with pytest.raises(ValueError,
                     match=rf"GRPOConfig\.{field} .*{re.escape(limit)}.*{re.escape(repr(value))}"):
    grpo.GRPOConfig(**{field: value})


def test_config_rejects_bad_aggregation_and_sampling():
  with pytest.raises(ValueError, match=r"aggregation .*'token_mean', 'seq_mean'.*'mean'"):
    grpo.GRPOConfig(aggregation="mean")
  with pytest.raises(ValueError, match="sampling must be a SamplingConfig"):
    grpo.GRPOConfig(sampling={"temperature": 1.0})
  with pytest.raises(ValueError, match=r"old_policy must be one of \('rollout', 'trainer'\), "
                     r"got 'behaviour'"):
    grpo.GRPOConfig(old_policy="behaviour")


# --- advantages, objective, KL (hand-computed) ------------------------------------------------


def test_group_advantages_by_hand():
  # group [1, 0, 0, 1]: mean 0.5, std (ddof 0) sqrt(mean(0.25 x 4)) = 0.5,
  # so A = +-0.5 / (0.5 + eps); group [2, 2, 2, 2] is constant: exactly 0.
  eps = 1e-4
  adv = np.asarray(grpo.group_advantages(jnp.array([1., 0, 0, 1, 2, 2, 2, 2]), 4, eps))
  a = 0.5 / (0.5 + eps)
  np.testing.assert_allclose(adv[:4], [a, -a, -a, a], rtol=1e-6)
  assert (adv[4:] == 0).all()
  # a constant group whose mean is not exact in f32 still gives exactly 0
  assert (np.asarray(grpo.group_advantages(jnp.full((3,), 0.1), 3, 0.0)) == 0).all()
  # group [3, 1] with eps 0: mean 2, std 1, A = [1, -1]
  np.testing.assert_allclose(np.asarray(grpo.group_advantages(jnp.array([3., 1]), 2, 0.0)),
                             [1, -1], rtol=1e-6)
  with pytest.raises(ValueError, match="6 rows, not a multiple of group_size 4"):
    grpo.group_advantages(jnp.zeros(6), 4, eps)


def _clip_case():
  """Row 0 (A = +1) ratios [1.5, 0.5, 1.1]; row 1 (A = -1) ratios [0.5, 1.5, <past length>]."""
  ratios = np.array([[1.5, 0.5, 1.1], [0.5, 1.5, 7.0]], np.float32)
  old = np.array([[-2.0, -1.0, -3.0], [-0.5, -2.5, -1.0]], np.float32)
  return (jnp.asarray(np.log(ratios) + old), jnp.asarray(old), jnp.array([1.0, -1.0]),
          jnp.array([3, 2]))


def test_objective_clipping_by_hand():
  logp, old, adv, lens = _clip_case()
  cfg = grpo.GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.28)
  t = grpo.token_terms(logp, old, adv, cfg)
  # A > 0: ratio 1.5 > 1.28 clipped -> -1.28; ratio 0.5 < 0.8 is NOT clipped (min keeps 0.5 * A)
  #        -> -0.5; ratio 1.1 inside -> -1.1.
  # A < 0: ratio 0.5 < 0.8 clipped -> -(0.8 * -1) = 0.8; ratio 1.5 not clipped (min keeps -1.5)
  #        -> 1.5.
  np.testing.assert_allclose(np.asarray(t.loss)[0], [-1.28, -0.5, -1.1], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(t.loss)[1, :2], [0.8, 1.5], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(t.clipped)[:, :2], [[True, False], [True, False]])
  # token_mean over the 5 live tokens: (-1.28 - 0.5 - 1.1 + 0.8 + 1.5) / 5 = -0.116
  loss = grpo.grpo_loss(logp, old, adv, lens, cfg)
  np.testing.assert_allclose(float(loss), -0.116, rtol=1e-5)
  # seq_mean: mean(-2.88 / 3, 2.3 / 2) = mean(-0.96, 1.15) = 0.095
  seq = grpo.GRPOConfig(aggregation="seq_mean")
  np.testing.assert_allclose(float(grpo.grpo_loss(logp, old, adv, lens, seq)), 0.095, rtol=1e-5)
  # gradient in logp: -A * ratio / 5 where unclipped, 0 where clipped or past the length
  g = np.asarray(jax.grad(lambda lp: grpo.grpo_loss(lp, old, adv, lens, cfg))(logp))
  np.testing.assert_allclose(g, [[0, -0.5 / 5, -1.1 / 5], [0, 1.5 / 5, 0]], atol=1e-6)


def test_k3_kl_by_hand():
  # pi = [0.5, 0.5], ref = [0.25, 0.75]: KL(pi || ref) = 0.5 ln 2 + 0.5 ln(2/3) = 0.143841.
  # k3 = r - ln r - 1 with r = ref / pi: token 0 r = 0.5 -> 0.5 + ln 2 - 1 = 0.193147;
  # token 1 r = 1.5 -> 1.5 - ln 1.5 - 1 = 0.094535; the pi-weighted mean is the KL.
  logp, ref = jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.25, 0.75]))
  k3 = np.asarray(grpo.k3_kl(logp, ref))
  np.testing.assert_allclose(k3, [0.5 + math.log(2) - 1, 0.5 - math.log(1.5)], rtol=1e-5)
  np.testing.assert_allclose(0.5 * k3.sum(), 0.5 * math.log(2) + 0.5 * math.log(2 / 3), rtol=1e-5)
  assert float(grpo.k3_kl(logp, logp).max()) == 0.0
  # in the loss: ratio 1 and A = 0 leave only beta * mean k3 over live tokens
  cfg = grpo.GRPOConfig(beta=0.1)
  lp2, ref2 = logp.reshape(1, 2), ref.reshape(1, 2)
  loss = grpo.grpo_loss(lp2, lp2, jnp.zeros(1), jnp.array([2]), cfg, ref_logp=ref2)
  np.testing.assert_allclose(float(loss), 0.1 * k3.mean(), rtol=1e-5)


# --- trainer logprobs == rollout logprobs (trained model, GSM8K prompts) ---------------------

M_TRAINED = 40


@pytest.mark.parametrize("temperature", [pytest.param(0.7, marks=pytest.mark.slow), 1.0])
def test_trainer_logprobs_equal_rollout_at_step_0(trained_model, gsm8k_prompts, temperature):
  config, params, tok = trained_model
  samp = SamplingConfig(temperature=temperature, top_p=0.9)
  prompts = [p for p in gsm8k_prompts[:4] for _ in range(2)]
  batch = rollout.prepare_batch(config, prompts, max_new_tokens=M_TRAINED, eos_ids=tok.eos_ids,
                                sample_ids=np.arange(8))
  r = rollout.generate(config, params, prompts, sampling=samp, max_new_tokens=M_TRAINED, seed=11,
                       sample_ids=np.arange(8), eos_ids=tok.eos_ids)
  lens = np.asarray(r.lengths)
  assert lens.min() < M_TRAINED and lens.max() == M_TRAINED, lens  # ragged, some end with EOS
  fn = jax.jit(grpo.trainer_logprobs, static_argnames=("config", "sampling"))
  sc = fn(config, params, batch.tokens, batch.lengths, r.tokens, r.lengths, sampling=samp)
  live = np.arange(M_TRAINED)[None] < lens[:, None]
  gap = np.abs(np.asarray(sc.logprobs) - np.asarray(r.logprobs))
  print(f"T={temperature}: max |trainer - rollout logp| = {gap.max():.2e}, "
        f"mean = {gap[live].mean():.2e} over {live.sum()} tokens")
  assert gap.max() <= 1e-5
  assert (np.asarray(sc.logprobs)[~live] == 0).all()
  # so the importance ratio is 1 and nothing is clipped
  t = grpo.token_terms(sc.logprobs, r.logprobs, jnp.ones(8), grpo.GRPOConfig(sampling=samp))
  np.testing.assert_allclose(np.asarray(t.ratio)[live], 1.0, atol=1e-5)
  assert not np.asarray(t.clipped)[live].any()


# --- speculative rollouts give the same GRPO updates as vanilla ------------------------------

G, N_PROMPTS, M = 4, 4, 12
EOS = (5, 9)


def _reward(prompt_tokens, prompt_lengths, tokens, lengths, data):
  """A jnp reward: fraction of even tokens + 1 if the first token equals the prompt's target."""
  live = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
  even = ((tokens % 2 == 0) & live).sum(1) / jnp.maximum(lengths, 1)
  return even + (tokens[:, 0] == data)


def _prompt_batch(config):
  """N_PROMPTS random prompts (global indices 10..), each with a target token for ``_reward``."""
  rng = np.random.default_rng(0)
  v = config.vocab_size
  prompts = [rng.integers(0, v, rng.integers(2, 9)).tolist() for _ in range(N_PROMPTS)]
  b = rollout.prepare_batch(config, prompts, max_new_tokens=M)
  return grpo.StepPrompts(tokens=jnp.asarray(b.tokens), lengths=jnp.asarray(b.lengths),
                          indices=jnp.arange(10, 10 + N_PROMPTS, dtype=jnp.int32),
                          reward_data=jnp.asarray(rng.integers(0, v, N_PROMPTS), jnp.int32))


@pytest.fixture(scope="module")
def small_model():
  """A random tiny model with a 32-token vocab: EOS ids 5 and 9 end rows early, and random heads
  get some tokens accepted."""
  config = models.ModelConfig.tiny(vocab_size=32, max_position_embeddings=128)
  return config, models.init_params(jax.random.key(0), config)


@pytest.mark.slow  # (a compile-heavy exactness check; the main job's test checks it end to end)
def test_speculative_rollouts_give_vanilla_updates(small_model):
  config, params = small_model
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  # lr 2e-4: see test_grpo_sharded.py (Adam scales rounding-level gradient components to O(lr))
  cfg = grpo.GRPOConfig(group_size=G, learning_rate=2e-4, micro_batches=2,
                        sampling=SamplingConfig(temperature=1.0))
  pb = _prompt_batch(config)
  hd = H.init(jax.random.key(1), config, 3, scale=0.05)
  spec = rollout.SpecConfig(node_budget=16, bucket_fractions=(1.0, 0.5))
  runs = {}
  for name, kw, pp in (("vanilla", {}, None),
                       ("spec", {"proposer": HeadsProposer(), "spec": spec}, hd)):
    step = grpo.make_rollout_train_step(config, cfg, _reward, max_new_tokens=M, eos_ids=EOS,
                                        mesh=mesh, rollout_kernels="reference", **kw)
    state = grpo.init_train_state(params, cfg)
    outs = []
    for seed in (3, 4):
      state, met, ro = step(state, pb, seed, pp)
      outs.append((jax.device_get(met), jax.device_get(ro)))
    runs[name] = (jax.device_get(state.params), outs)
  (pv, ov), (ps, os_) = runs["vanilla"], runs["spec"]
  for (mv, rv), (ms, rs) in zip(ov, os_, strict=True):
    np.testing.assert_array_equal(rs.tokens, rv.tokens)  # the target's own samples
    np.testing.assert_array_equal(rs.lengths, rv.lengths)
    np.testing.assert_allclose(rs.logprobs, rv.logprobs, atol=1e-5)
    np.testing.assert_array_equal(rs.rewards, rv.rewards)
    assert ms.logp_gap_max <= 1e-5 and mv.logp_gap_max <= 1e-5, (ms, mv)
    print(f"row forwards: spec {rs.row_forwards}, vanilla {rv.row_forwards}; "
          f"logp gap spec {ms.logp_gap_max:.1e}, vanilla {mv.logp_gap_max:.1e}")
    np.testing.assert_allclose(ms.loss, mv.loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ms.grad_norm, mv.grad_norm, rtol=1e-5)
  assert sum(r.row_forwards for _, r in os_) < sum(r.row_forwards for _, r in ov)  # speculated
  assert 0 < ov[0][1].lengths.min() and ov[0][1].lengths.min() < M  # ragged (EOS)
  assert np.abs(ov[0][1].advantages).max() > 0  # the rewards gave a signal
  moved = max(float(np.abs(a - b).max())
              for a, b in zip(jax.tree.leaves(pv), jax.tree.leaves(params), strict=True))
  assert moved > 2e-4  # two updates of about lr each: the 1e-5 comparison below is meaningful
  gap = max(float(np.abs(a - b).max())
            for a, b in zip(jax.tree.leaves(ps), jax.tree.leaves(pv), strict=True))
  print(f"params after 2 steps: max |spec - vanilla| = {gap:.1e} (max update {moved:.1e})")
  assert gap <= 1e-5


@pytest.mark.slow
def test_trainer_old_policy_makes_the_update_independent_of_the_rollout_logprobs(small_model):
  """old_policy="trainer": the ratio's old logprobs are the trainer's own (stop_gradient), so
  the update is bit-identical whatever logprobs the rollout reported (a speculative and a vanilla
  run give the same parameters); "rollout" uses them (perturbing them changes the update), and
  at the rollout's true logprobs both give the same update up to rounding."""
  config, params = small_model
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  samp = SamplingConfig(temperature=1.0)
  pb = _prompt_batch(config)
  rep = np.repeat(np.asarray(pb.tokens), G, axis=0)
  lens = np.repeat(np.asarray(pb.lengths), G)
  sids = np.arange(len(rep))
  r = rollout.generate(config, params, rep, prompt_lengths=lens, sampling=samp, seed=3,
                       max_new_tokens=M, eos_ids=EOS, sample_ids=sids)
  rewards = np.asarray(_reward(None, None, r.tokens, r.lengths, np.repeat(
      np.asarray(pb.reward_data), G)))
  batch = grpo.Batch.from_rollout(rep, lens, r, rewards)
  noisy = batch.replace(logprobs=batch.logprobs + 0.3 * jnp.asarray(
      np.random.default_rng(1).normal(size=batch.logprobs.shape), jnp.float32))
  out = {}
  for old in ("trainer", "rollout"):
    cfg = grpo.GRPOConfig(group_size=G, learning_rate=2e-4, old_policy=old, sampling=samp)
    step = grpo.make_train_step(config, cfg, mesh=mesh)
    for name, b in (("exact", batch), ("noisy", noisy)):
      st, met = step(grpo.init_train_state(params, cfg), b)
      out[old, name] = (jax.device_get(st.params), jax.device_get(met))
  leaves = lambda k: jax.tree.leaves(out[k][0])
  for a, b in zip(leaves(("trainer", "exact")), leaves(("trainer", "noisy")), strict=True):
    np.testing.assert_array_equal(a, b)
  assert float(out["trainer", "noisy"][1].clip_fraction) == 0.0  # the ratio is exactly 1
  assert float(out["rollout", "noisy"][1].clip_fraction) > 0.1  # the noise hits the clip
  gap = lambda k1, k2: max(float(np.abs(a - b).max())
                           for a, b in zip(leaves(k1), leaves(k2), strict=True))
  assert gap(("rollout", "exact"), ("rollout", "noisy")) > 1e-5
  moved = max(float(np.abs(a - b).max())
              for a, b in zip(leaves(("trainer", "exact")), jax.tree.leaves(params), strict=True))
  assert moved > 1e-4  # an update of about lr: the equalities above are not trivially true
  np.testing.assert_allclose(float(out["trainer", "exact"][1].grad_norm),
                             float(out["rollout", "exact"][1].grad_norm), rtol=1e-4)


# --- bad input -------------------------------------------------------------------------------


def test_steps_reject_bad_input(small_model):
  config, params = small_model
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  cfg = grpo.GRPOConfig(group_size=2, micro_batches=4)
  step = grpo.make_train_step(config, cfg, mesh=mesh)
  b = 12
  batch = grpo.Batch(prompt_tokens=jnp.zeros((b, 8), jnp.int32), prompt_lengths=jnp.ones(b, int),
                     tokens=jnp.zeros((b, 6), jnp.int32), lengths=jnp.ones(b, int),
                     logprobs=jnp.zeros((b, 6)), rewards=jnp.zeros(b))
  state = grpo.init_train_state(params, cfg)
  with pytest.raises(ValueError, match=r"batch has 10 rows, not a multiple of n_devices 1 x "
                                       r"micro_batches 4 = 4"):
    step(state, jax.tree.map(lambda x: x[:10], batch))
  with pytest.raises(ValueError, match=r"batch has 9 rows, not a multiple of group_size 2"):
    step(state, jax.tree.map(lambda x: x[:9], batch))
  with pytest.raises(ValueError, match=r"batch.logprobs has shape \(12, 5\), expected \(12, 6\)"):
    step(state, batch.replace(logprobs=jnp.zeros((b, 5))))
  with pytest.raises(ValueError, match="ref_params is given but GRPOConfig.beta is 0"):
    grpo.init_train_state(params, cfg, ref_params=params)
  with pytest.raises(ValueError, match=r"eos_ids must hold ints in \[0, 31\], got \[40\]"):
    grpo.make_rollout_train_step(config, cfg, _reward, max_new_tokens=4, eos_ids=[40], mesh=mesh)
  ro = grpo.make_rollout_train_step(config, cfg, _reward, max_new_tokens=4, eos_ids=[5], mesh=mesh)
  pb = grpo.StepPrompts(tokens=jnp.zeros((3, 4), jnp.int32), lengths=jnp.ones(3, jnp.int32),
                        indices=jnp.arange(3, dtype=jnp.int32))
  with pytest.raises(ValueError, match=r"prompts has 3 rows, not a multiple of n_devices 1 x "
                                       r"micro_batches 4"):
    ro(state, pb, 0)
  with pytest.raises(ValueError, match="proposer_params must be given exactly when"):
    ro(state, jax.tree.map(lambda x: jnp.concatenate([x, x[:1]]), pb), 0,
       H.init(jax.random.key(0), config, 3))


def test_group_sample_ids_rule_numpy_jnp_and_traced():
  """The sample-id rule, written once: member i of global prompt p has id p * G + i, rows in
  prompt-major order, the same from numpy, jnp and inside jit (the loop, pipeline and on-device
  step all call it)."""
  from app import pipeline
  from specroll_jax.sampling import group_sample_ids
  want = np.array([21, 22, 23, 27, 28, 29])
  np.testing.assert_array_equal(group_sample_ids(np.array([7, 9]), 3), want)
  np.testing.assert_array_equal(np.asarray(group_sample_ids(jnp.array([7, 9]), 3)), want)
  np.testing.assert_array_equal(
      np.asarray(jax.jit(lambda i: group_sample_ids(i, 3))(jnp.array([7, 9], jnp.int32))), want)
  _, sids = pipeline.grpo_batch([[1], [2]], 3, first_prompt_index=7)
  np.testing.assert_array_equal(sids, [21, 22, 23, 24, 25, 26])
  with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
    group_sample_ids(np.array([1]), 0)
