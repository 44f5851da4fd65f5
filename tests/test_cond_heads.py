"""Root-conditioned heads: they read the root and the path (a different root gives different
logits, a Medusa head does not), save/load round trip, fitting lowers the loss and beats Medusa
heads on the same rollouts; ranked proposers (root-conditioned, Medusa, merged with the
group-aware lookup) give the vanilla rollout token for token."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax import calibration, rollout
from specroll_jax import cond_heads as CH
from specroll_jax import heads as H
from specroll_jax.proposers.group_lookup import GroupLookup
from specroll_jax.proposers.merged import Merged
from specroll_jax.proposers.ranked_heads import RankedHeads
from specroll_jax.rollout import SamplingConfig, SpecConfig

G = 4
SAMPLING = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def rollouts(trained_model, gsm8k_prompts):
  config, params, tok = trained_model
  prompts = [p for p in gsm8k_prompts[:8] for _ in range(G)]
  r = rollout.generate(config, params, prompts, sampling=SAMPLING, max_new_tokens=48, seed=3,
                       sample_ids=np.arange(len(prompts)), return_hidden=True,
                       eos_ids=tok.eos_ids)
  return np.asarray(r.tokens), np.asarray(r.lengths), np.asarray(r.hidden)


@pytest.fixture(scope="module")
def fitted(trained_model, rollouts):
  config, params, _ = trained_model
  ch = CH.init(jax.random.key(1), config, 3, width=64)
  ch, hist = CH.fit(config, params, ch, *rollouts, sampling=SAMPLING, steps=150, batch_size=128,
                    learning_rate=1e-2, progress=False)
  return ch, hist


def test_heads_read_the_root_and_the_path(trained_model):
  config, params, _ = trained_model
  ch = CH.init(jax.random.key(0), config, 3, width=32)
  ch = ch.replace(w_o=jax.random.normal(jax.random.key(1), ch.w_o.shape) * 0.1)
  h = jax.random.normal(jax.random.key(2), (2, config.hidden_size))
  ctx = jnp.array([[5, 6, 7], [5, 6, 7]])
  base = CH.states(config, params, ch, h, ctx)
  for j in range(3):  # changing context slot j changes heads k > j only
    alt = CH.states(config, params, ch, h, ctx.at[:, j].set(9))
    diff = np.abs(np.asarray(alt - base)).max(axis=(0, 2))
    assert (diff[:j] == 0).all() and (diff[j:] > 0).all(), (j, diff)
  # at init (w_o = 0) every head is the identity on the anchor
  z0 = CH.states(config, params, CH.init(jax.random.key(0), config, 3), h, ctx)
  np.testing.assert_array_equal(np.asarray(z0), np.broadcast_to(np.asarray(h)[:, None], z0.shape))


def test_save_load_round_trip(tmp_path, fitted, trained_model):
  ch, _ = fitted
  CH.save(tmp_path / "h.safetensors", ch)
  assert CH.is_file(tmp_path / "h.safetensors")
  back = CH.load(tmp_path / "h.safetensors")
  chex.assert_trees_all_equal(ch, back)
  assert back.vocab_size == ch.vocab_size
  H.save(tmp_path / "medusa.safetensors", H.init(jax.random.key(0), trained_model[0], 3))
  assert not CH.is_file(tmp_path / "medusa.safetensors")
  with pytest.raises(ValueError, match="not a root-conditioned heads file"):
    CH.load(tmp_path / "medusa.safetensors")


def test_fit_lowers_the_loss_and_beats_medusa(trained_model, fitted, rollouts):
  config, params, _ = trained_model
  ch, hist = fitted
  assert hist.shape == (150, 3)
  assert hist[-20:, 0].mean() < 0.8 * hist[:5, 0].mean()
  medusa = H.init(jax.random.key(0), config, 3)
  medusa, _ = H.fit_heads(config, params, medusa, rollouts[0], rollouts[1], rollouts[2],
                          steps=150, batch_size=128, progress=False)
  q_cond = CH.hit_rates(config, params, ch, *rollouts, sampling=SAMPLING)
  q_med = CH.hit_rates(config, params, medusa, *rollouts, sampling=SAMPLING)
  assert q_cond["mass@4"] > q_med["mass@4"]  # (in-sample: the property is that it reads the root)
  assert q_cond["mass@4"] <= q_cond["bound@4"] + 1e-6


def test_cond_heads_validation(trained_model):
  config = trained_model[0]
  with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
    CH.init(jax.random.key(0), config, 0)
  ch = CH.init(jax.random.key(0), config, 2, width=8)
  with pytest.raises(ValueError, match="heads has 2 heads, expected 3"):
    RankedHeads().validate(config, RankedHeads().params(ch))
  with pytest.raises(ValueError, match=r"heads has 2 heads but spec.num_heads=3"):
    rollout.resolve_proposer(SpecConfig(), ch, None, None)
  prop, _ = rollout.ranked_heads_proposer(SpecConfig(num_heads=2, max_nodes=5), ch)
  assert (prop.num_heads, prop.topk, prop.beams, prop.max_nodes) == (2, (4, 3), (1, 2), 5)
  with pytest.raises(ValueError, match="acceptance has shape"):
    RankedHeads(num_heads=2, topk=(2, 2), beams=(1, 1)).validate(
        config, RankedHeads(num_heads=2, topk=(2, 2), beams=(1, 1)).params(ch, np.ones((3, 3))))
  with pytest.raises(ValueError, match="beams\\[0\\] must be 1"):
    RankedHeads(beams=(2, 2, 2))


@pytest.mark.parametrize("cfg", [
    pytest.param(SamplingConfig(temperature=0.0), marks=pytest.mark.slow), SAMPLING], ids=str)
def test_ranked_proposers_equal_vanilla(trained_model, gsm8k_prompts, fitted, cfg):
  config, params, tok = trained_model
  ch, _ = fitted
  prompts = [p for p in gsm8k_prompts[8:12] for _ in range(G)]
  eos = list(tok.eos_ids) + tok.encode(" number")
  kw = dict(sampling=cfg, max_new_tokens=40, seed=5, sample_ids=np.arange(16), eos_ids=eos)
  ref = rollout.generate(config, params, prompts, **kw)
  spec = SpecConfig(bucket_fractions=(1.0, 0.5), nodes=(6, 6))
  rh = RankedHeads()
  medusa = H.init(jax.random.key(2), config, 3, scale=0.05)
  mg = Merged(lookup=GroupLookup(group_size=G, max_chain=4))
  cal = calibration.init(mg.default_acceptance())
  cases = [(rh, rh.params(ch)), (mg, mg.params(ch)), (mg, None)]
  if cfg.greedy:  # RankedHeads over Medusa heads: another compile, so with the slow case only
    cases.insert(1, (rh, rh.params(medusa)))
  for prop, pp in cases:
    if pp is None:  # a calibrated table from the previous rollout's counts
      cal = cal.update(got.stats.spec.proposer)  # noqa: F821 (set in the previous iteration)
      pp = mg.params(ch, cal.table())
    got = rollout.generate(config, params, prompts, spec=spec, proposer=prop, proposer_params=pp,
                           **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
    st = got.stats.spec.proposer
    tested, hit = np.asarray(st.tested), np.asarray(st.hit)
    assert tested.sum() > 0 and (hit <= tested).all()
    e = st.expected_per_row_step()
    assert e[0] == 0 and (np.diff(e) >= -1e-6).all()  # more nodes: more expected acceptance
    if prop is rh and pp is not None and pp.heads is ch:
      explicit = got
  # generate's heads= shorthand with root-conditioned heads is that RankedHeads proposer: the same
  # proposer (one compiled program), the same tokens and the same proposals
  spec_, prop_, pp_ = rollout.resolve_proposer(spec, ch, None, None)
  assert prop_ == rh and jax.tree.structure(pp_) == jax.tree.structure(rh.params(ch))
  short = rollout.generate(config, params, prompts, spec=spec, heads=ch, **kw)
  np.testing.assert_array_equal(np.asarray(short.tokens), np.asarray(ref.tokens))
  for f in ("tested", "hit"):
    np.testing.assert_array_equal(np.asarray(getattr(short.stats.spec.proposer, f)),
                                  np.asarray(getattr(explicit.stats.spec.proposer, f)))


@pytest.mark.slow  # about 20 s
def test_reflex_and_slow_path_on_root_conditioned_heads(trained_model, gsm8k_prompts, fitted):
  from specroll_jax import adaptation
  from specroll_jax.slow_path import SlowPathConfig
  config, params, tok = trained_model
  ch, _ = fitted
  prompts = [p for p in gsm8k_prompts[:4] for _ in range(G)]
  cfg = SamplingConfig(temperature=0.7, top_p=0.9)
  kw = dict(sampling=cfg, max_new_tokens=40, seed=8, sample_ids=np.arange(16),
            eos_ids=list(tok.eos_ids) + tok.encode(" number"))
  ref = rollout.generate(config, params, prompts, **kw)
  acfg = adaptation.AdaptationConfig(
      slow=SlowPathConfig.for_tests(mode="every_batch", learning_rate=1e-3)).for_sampling(cfg)
  state = adaptation.init(acfg, ch)
  assert state.config.reflex.conditioned  # follows the heads' family
  spec = SpecConfig(bucket_fractions=(1.0, 0.5), nodes=(4, 4))
  for _ in range(2):
    got = rollout.generate(config, params, prompts, spec=spec, adaptation=state, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
    rep = got.adaptation_report
    assert rep["reflex"]["records_matured"][0] > 0
    assert rep["slow"]["decision"] == "every_batch"
    state = got.adaptation
  assert state.slow.reservoir.path is not None and bool(state.slow.reservoir.valid.any())
  assert int(np.asarray(state.slow.tried).sum()) > 0
