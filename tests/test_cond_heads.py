"""Root-conditioned heads: they read the root and the path (a different root gives different
logits, a Medusa head does not), save/load round trip, fitting lowers the loss and beats Medusa
heads on the same rollouts; ranked proposers (root-conditioned, Medusa, merged with the
group-aware lookup) give the vanilla rollout token for token; the slow path's guarded refresh of
root-conditioned heads keeps, changes and rolls back (bit for bit) exactly the heads its held-out
evaluation says, on hand-made records and under Reflex in ``SpecRoll``'s rollouts."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LONG, head_slice, leaves_equal

from specroll_jax import models, rollout
from specroll_jax.adaptation import calibration
from specroll_jax.heads import conditioned as CH
from specroll_jax.heads import medusa as H
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
                       sample_ids=np.arange(len(prompts)), eos_ids=tok.eos_ids,
                       options=rollout.DecodeOptions(return_hidden=True))
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
  assert q_cond.at(4)[1] > q_med.at(4)[1]  # (in-sample: the property is that it reads the root)
  assert q_cond.at(4)[1] <= q_cond.at(4)[2] + 1e-6
  assert q_cond.to_dict()["mass@4"] == q_cond.at(4)[1]


def test_cond_heads_validation(trained_model):
  config = trained_model[0]
  with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
    CH.init(jax.random.key(0), config, 0)
  ch = CH.init(jax.random.key(0), config, 2, width=8)
  with pytest.raises(ValueError, match="heads has 2 heads, expected 3"):
    RankedHeads().validate(config, RankedHeads().params(ch))
  with pytest.raises(ValueError, match=r"heads has 2 heads but tree.num_heads=3"):
    rollout.Speculation.of_heads(ch, SpecConfig(), tree=RankedHeads())
  prop = rollout.Speculation.of_heads(ch, SpecConfig()).proposer
  assert (prop.num_heads, prop.topk, prop.beams, prop.max_nodes) == (2, (4, 3), (1, 2), 16)
  assert RankedHeads.for_heads(5).topk == (4, 3, 2, 2, 2)
  with pytest.raises(ValueError, match="acceptance has shape"):
    RankedHeads(num_heads=2, topk=(2, 2), beams=(1, 1)).validate(
        config, RankedHeads(num_heads=2, topk=(2, 2), beams=(1, 1)).params(ch, np.ones((3, 3))))
  with pytest.raises(ValueError, match="beams\\[0\\] must be 1"):
    RankedHeads(beams=(2, 2, 2))


@pytest.mark.parametrize("cfg", [
    pytest.param(SamplingConfig(temperature=0.0), marks=LONG),
    pytest.param(SAMPLING, marks=pytest.mark.slow)], ids=str)  # fast: test_specroll's Merged
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
    got = rollout.generate(config, params, prompts,
                           speculation=rollout.Speculation(prop, pp, spec), **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
    st = got.stats.spec.proposer
    tested, hit = np.asarray(st.tested), np.asarray(st.hit)
    assert tested.sum() > 0 and (hit <= tested).all()
    e = st.expected_per_row_step()
    assert e[0] == 0 and (np.diff(e) >= -1e-6).all()  # more nodes: more expected acceptance
    if prop is rh and pp is not None and pp.heads is ch:
      explicit = got
  # Speculation.of_heads with root-conditioned heads is that RankedHeads proposer: the same
  # proposer (one compiled program), the same tokens and the same proposals
  short_spec = rollout.Speculation.of_heads(ch, spec)
  assert short_spec.proposer == rh and short_spec.spec == spec
  assert jax.tree.structure(short_spec.params) == jax.tree.structure(rh.params(ch))
  short = rollout.generate(config, params, prompts, speculation=short_spec, **kw)
  np.testing.assert_array_equal(np.asarray(short.tokens), np.asarray(ref.tokens))
  for f in ("tested", "hit"):
    np.testing.assert_array_equal(np.asarray(getattr(short.stats.spec.proposer, f)),
                                  np.asarray(getattr(explicit.stats.spec.proposer, f)))


def _slices_equal(a, b, k) -> bool:
  """Head k's slice of a and b equal bit for bit."""
  return leaves_equal(head_slice(a, k), head_slice(b, k))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _held_out_and_train(cfg, config, params, heads, reservoir):
  """``slow_path.evaluate`` of the heads on the reservoir's held-out records and on the records a
  refresh trains on (the other valid ones)."""
  from specroll_jax.adaptation import slow_path as sp
  held = jnp.asarray(sp.holdout_slots(cfg, reservoir.capacity))[None] & reservoir.valid
  return (sp.evaluate(cfg, config, params, heads, reservoir, held),
          sp.evaluate(cfg, config, params, heads, reservoir, reservoir.valid & ~held))


def _records(config, params, rollouts, capacity, source=None, support=16, candidates=4):
  """``capacity`` slow-path records per head from the rollouts, as Reflex writes them for
  root-conditioned heads: head i (0-based) at anchor j read tokens j..j+i (its path) and predicts
  token j+i+1. The target distribution there is the target's own (the unembedding of hidden at
  j+i+1) or, with ``source`` heads, their head i's; support = its top ids with the token on it."""
  from specroll_jax.adaptation.records import Records
  tokens, lengths, hidden = rollouts
  k = 3
  cols = {f: [] for f in ("hidden", "path", "token", "logits")}
  for i in range(k):
    bb, jj = np.nonzero(np.arange(tokens.shape[1])[None] + i + 1 < lengths[:, None])
    bb, jj = bb[:capacity], jj[:capacity]
    path = np.full((capacity, k), -1, np.int32)
    path[:, :i + 1] = tokens[bb[:, None], jj[:, None] + np.arange(i + 1)]
    if source is None:
      logits = models.logits_from_hidden(config, params, jnp.asarray(hidden[bb, jj + i + 1]))
    else:
      logits = CH.apply(config, params, source, jnp.asarray(hidden[bb, jj]), jnp.asarray(path))
      logits = logits[:, i]
    for f, v in (("hidden", hidden[bb, jj]), ("path", path), ("token", tokens[bb, jj + i + 1]),
                 ("logits", np.asarray(logits, np.float64))):
      cols[f].append(v)
  h, path, token, logits = (np.stack(cols[f]) for f in ("hidden", "path", "token", "logits"))
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ids = np.argsort(-p, -1)[..., :support]
  on = (ids == token[..., None]).any(-1)
  ids[..., -1] = np.where(on, ids[..., -1], token)
  mass = np.take_along_axis(p, ids, -1)
  cands = ids[..., :candidates]
  f32, i32 = (lambda x: jnp.asarray(x, jnp.float32)), (lambda x: jnp.asarray(x, jnp.int32))
  return Records(hidden=f32(h), correction=f32(np.zeros_like(h)), support=i32(ids),
                 p=f32(mass / mass.sum(-1, keepdims=True)), p_tail=f32(1 - mass.sum(-1)),
                 token=i32(token), candidates=i32(cands),
                 hit=jnp.asarray((cands == token[..., None]).any(-1)),
                 tv=f32(np.zeros((k, capacity))),
                 position=i32(np.broadcast_to(np.arange(capacity), (k, capacity))),
                 valid=jnp.ones((k, capacity), bool), count=i32(np.full((k,), capacity)),
                 path=i32(path))


def test_slow_path_refresh_of_root_conditioned_heads(trained_model, rollouts):
  """A guarded refresh of heads 0 and 2 of root-conditioned heads on records of the rollouts
  (2 AdamW steps at 1e-2; the default 1e-5 barely moves them): its held-out CE / TV are
  ``slow_path.evaluate``'s before and after; it kept exactly the heads the keep rule passes
  (at least one); a kept head changed and fits the records it trained on better (CE and TV lower
  there, as on the held-out ones); head 1 (not selected) and a rolled-back head come back with
  their parameters and optimiser state bit for bit. Then held-out records that carry the
  refreshed heads' own distribution: any update raises their CE and TV, so a refresh of every
  head rolls all three back, leaving parameters and optimiser state bit-identical."""
  from specroll_jax.adaptation import records as records_lib
  from specroll_jax.adaptation import slow_path as sp
  config, params, _ = trained_model
  cfg = sp.SlowPathConfig.for_tests(learning_rate=1e-2)
  ecfg = cfg.refresh_settings()  # what after_batch compiles the refresh with
  c = cfg.per_head(3)
  ch = CH.init(jax.random.key(1), config, 3, width=64)
  state = sp.init(cfg, ch, support_size=16, num_candidates=4)
  merge = jax.jit(records_lib.merge)
  recs = _records(config, params, rollouts, c)
  reservoir = merge(state.reservoir, recs)
  mask = np.array([True, False, True])
  heads, opt, res = sp.refresh_jit(ecfg, config, params, ch, state.opt_state, reservoir,
                                   jnp.asarray(mask), jnp.int32(2))
  res = jax.device_get(res)
  held0, train0 = jax.device_get(_held_out_and_train(ecfg, config, params, ch, reservoir))
  held1, train1 = jax.device_get(_held_out_and_train(ecfg, config, params, heads, reservoir))
  assert res.trained.tolist() == mask.tolist() and res.before.n.tolist() == held0.n.tolist()
  assert held0.n[0] > 0 and train0.n[0] > 0
  keep = (res.after.ce <= np.float32(cfg.keep_ce_ratio) * res.before.ce) & (
      res.after.tv < res.before.tv)
  assert res.keep.tolist() == (mask & keep).tolist() and res.keep.any(), res
  for k in np.flatnonzero(mask):
    np.testing.assert_allclose([res.before.ce[k], res.before.tv[k]], [held0.ce[k], held0.tv[k]],
                               rtol=1e-5)
  for k in range(3):
    if res.keep[k]:
      np.testing.assert_allclose([res.after.ce[k], res.after.tv[k]], [held1.ce[k], held1.tv[k]],
                                 rtol=1e-5)
      assert held1.ce[k] < held0.ce[k] and held1.tv[k] < held0.tv[k], (k, held0, held1)
      assert train1.ce[k] < train0.ce[k] and train1.tv[k] < train0.tv[k], (k, train0, train1)
      assert not _slices_equal(heads, ch, k)
    else:
      assert _slices_equal(heads, ch, k) and _slices_equal(opt, state.opt_state, k), k
  # rollback: training records as before, held-out ones from the refreshed heads themselves
  held = sp.holdout_slots(cfg, c)
  own = _records(config, params, rollouts, c, source=heads)
  mixed = jax.tree.map(lambda a, b: np.where(held.reshape((1, c) + (1,) * (a.ndim - 2)), b, a)
                       if a.ndim > 1 else a, recs, own)
  back, back_opt, r = sp.refresh_jit(ecfg, config, params, heads, opt,
                                     merge(state.reservoir, mixed), jnp.ones(3, bool),
                                     jnp.int32(2))
  r = jax.device_get(r)
  assert r.trained.all() and not r.keep.any()
  assert (r.after.ce > r.before.ce).all() and (r.after.tv > r.before.tv).all(), r
  for k in range(3):
    assert _slices_equal(back, heads, k) and _slices_equal(back_opt, opt, k), k


@pytest.mark.slow  # about 35 s (the warm-up compiles Reflex awake and asleep)
def test_reflex_and_slow_path_on_root_conditioned_heads(trained_model, gsm8k_prompts, fitted):
  """A SpecRoll with Reflex awake and the every-batch slow path over root-conditioned heads keeps
  the vanilla tokens, and each batch's refresh did what it reports: its held-out CE / TV are
  ``slow_path.evaluate``'s on the reservoir it read, before and after; it kept exactly the heads
  the keep rule passes (CE <= 1.01 x before and TV lower; no held-out records: rolled back); a
  kept head changed and fits the records it trained on better (CE and TV lower there); a
  rolled-back or untouched head, and its optimiser state, are bit-identical to before; the
  counters add up. Over the two batches at least one head is kept and one rolled back."""
  from specroll_jax import SpecRoll
  from specroll_jax.adaptation.reflex import ReflexConfig
  from specroll_jax.adaptation.slow_path import SlowPathConfig
  config, params, tok = trained_model
  ch, _ = fitted
  cfg = SamplingConfig(temperature=0.7, top_p=0.9)
  eos = tuple(tok.eos_ids) + tuple(tok.encode(" number"))
  sr = SpecRoll(config, max_new_tokens=40, sampling=cfg, group_size=G, eos_ids=eos,
                reflex=ReflexConfig(record_capacity=0),  # awake every batch (no sleep)
                slow=SlowPathConfig.for_tests(mode="every_batch", learning_rate=1e-3),
                spec=SpecConfig(bucket_fractions=(1.0,), nodes=(4,)), budget="fixed")
  batch = sr.batch(gsm8k_prompts[:4], np.arange(4))
  assert batch.sample_ids.tolist() == list(range(16))
  ref = rollout.generate(config, params, batch.tokens, prompt_lengths=batch.lengths,
                         sampling=cfg, max_new_tokens=40, seed=8, sample_ids=batch.sample_ids,
                         eos_ids=list(eos),
                         options=rollout.DecodeOptions(cache_length=batch.cache_length))
  state = sr.init(ch)
  assert sr.has_reflex(state) and sr.reflex.conditioned  # Reflex on root-conditioned heads
  scfg = sr.slow
  kept, rolled_back = [], []
  for _ in range(2):
    got, rep, new = sr.generate(params, batch, state, seed=8)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
    assert rep.reflex == "awake" and rep.records[0] > 0
    assert int(np.asarray(got.stats.spec.proposer.reflex.matured)[0]) > 0  # Reflex's own records
    slow = rep.slow
    assert slow.decision == "every_batch"
    # the refresh read the reservoir with this batch's records merged in (it does not change it)
    ev_cfg = scfg.refresh_settings()
    held0, train0 = jax.device_get(_held_out_and_train(ev_cfg, config, params, state.heads,
                                                       new.slow.reservoir))
    held1, train1 = jax.device_get(_held_out_and_train(ev_cfg, config, params, new.heads,
                                                       new.slow.reservoir))
    ks = list(slow.heads)  # every head with training records
    assert ks == [k for k in range(3) if train0.n[k] > 0] and ks
    assert sorted(slow.kept + slow.rolled_back) == ks
    f32 = np.float32
    for i, k in enumerate(ks):
      before = (slow.ce_before[i], slow.tv_before[i])
      after = (slow.ce_after[i], slow.tv_after[i])
      np.testing.assert_allclose(before, (held0.ce[k], held0.tv[k]), rtol=1e-5)  # NaN == NaN
      keep = (f32(after[0]) <= f32(scfg.keep_ce_ratio) * f32(before[0])
              and f32(after[1]) < f32(before[1]))
      assert (k in slow.kept) == keep, (k, before, after, slow)
      if keep:
        np.testing.assert_allclose(after, (held1.ce[k], held1.tv[k]), rtol=1e-5)
        assert train1.ce[k] < train0.ce[k] and train1.tv[k] < train0.tv[k], (k, train0, train1)
        assert not _slices_equal(new.heads, state.heads, k)
    for k in set(range(3)) - set(slow.kept):
      assert _slices_equal(new.heads, state.heads, k), k
      assert _slices_equal(new.slow.opt_state, state.slow.opt_state, k), k
    for name, heads in (("tried", ks), ("kept", slow.kept),
                        ("rolled_back", slow.rolled_back)):
      added = np.asarray(getattr(new.slow, name)) - np.asarray(getattr(state.slow, name))
      np.testing.assert_array_equal(added, np.isin(np.arange(3), heads), err_msg=name)
    kept += slow.kept
    rolled_back += slow.rolled_back
    state = new
  assert kept and rolled_back, (kept, rolled_back)
  assert state.slow.reservoir.path is not None and bool(state.slow.reservoir.valid.any())
  assert int(np.asarray(state.slow.tried).sum()) > 0
