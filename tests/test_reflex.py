"""Reflex (docs/design.md, "Reflex"): feedback and gate math against direct numpy computations, the
correction's bounds, exact no-op when ineligible, resets, group sharing and delayed maturity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax import models, proposers
from specroll_jax.adaptation import reflex
from specroll_jax.heads import medusa as H
from specroll_jax.proposers import tree as T
from specroll_jax.proposers.base import Feedback, Target
from specroll_jax.sampling import SamplingConfig

V, D = 12, 8


@pytest.fixture(scope="module")
def small():
  """A tied model with V = 12, D = 8 and a hand-set unembedding and final norm."""
  c = models.ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=8, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
  p = models.init_params(jax.random.key(0), c)
  rng = np.random.default_rng(0)
  w = rng.normal(size=(V, D)).astype(np.float32)
  scale = rng.uniform(0.5, 1.5, size=D).astype(np.float32)
  p = {**p, "embed": {"embedding": jnp.asarray(w)}, "final_norm": {"scale": jnp.asarray(scale)}}
  return c, p, w, scale


def _np_norm(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x * x) + eps) * scale


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_feedback_matches_numpy(small, temperature):
  c, p, w, scale = small
  cfg = reflex.ReflexConfig(top=3, topk=(3, 2, 2), weak=2)
  rng = np.random.default_rng(1)
  head_out = rng.normal(size=D).astype(np.float32)
  path_h = rng.normal(size=D).astype(np.float32)
  x_q = _np_norm(head_out, scale) @ w.T / temperature
  x_p = _np_norm(path_h, scale) @ w.T / temperature
  p_full = _softmax(x_p)
  lse = float(np.log(np.exp(x_p).sum()))
  ids_q = np.argsort(-x_q)[:3]
  ids_p = np.argsort(-x_p)[:3]
  token = int(ids_p[1])
  cand = np.array([int(ids_q[0]), int(ids_q[2]), -1])  # two candidates in the tree
  corr_top = np.array([int(i) for i in np.argsort(-x_q)[:3]])
  raw_top = np.array([0, 1, 2])
  target = Target(config=c, params=p, sampling=SamplingConfig(temperature=temperature))
  mt = reflex.feedback(cfg, target, jnp.asarray(head_out), jnp.asarray(ids_q), jnp.asarray(ids_p),
                       jnp.asarray(token), jnp.asarray(cand), jnp.asarray(corr_top),
                       jnp.asarray(raw_top), jnp.asarray(path_h), jnp.asarray(lse))
  # direct computation
  cset = {int(i) for i in cand if i >= 0}
  s = sorted({*map(int, ids_q), *map(int, ids_p), token, *cset})
  ps, qs = _softmax(x_p[s]), _softmax(x_q[s])
  tv = 0.5 * np.abs(ps - qs).sum()
  out = 1 - sum(p_full[i] for i in cset)
  dist = ((ps - qs)[:, None] * w[s]).sum(0)
  miss = [i for i in map(int, ids_p) if i not in cset]
  miss_mass = sum(ps[s.index(i)] for i in miss)
  weak = sorted(cset, key=lambda i: x_q[i])[:2]
  beta = _softmax(x_q[weak])
  cov = sum(ps[s.index(i)] * w[i] for i in miss) - miss_mass * (beta[:, None] * w[weak]).sum(0)
  g = 0.25 * dist + 1.0 * cov
  sev = np.clip(0.5 * tv + 0.5 * out, 0, 1)
  np.testing.assert_allclose(float(mt.tv), tv, atol=1e-5)
  np.testing.assert_allclose(float(mt.out), out, atol=1e-5)
  np.testing.assert_allclose(float(mt.severity), sev, atol=1e-5)
  np.testing.assert_allclose(np.asarray(mt.g), g, atol=1e-5)
  sup = np.asarray(mt.support)
  assert sorted(int(i) for i in sup if i >= 0) == s
  np.testing.assert_allclose(float(mt.p_tail), 1 - p_full[s].sum(), atol=1e-5)
  gain = p_full[corr_top].sum() - p_full[raw_top].sum()
  np.testing.assert_allclose(float(mt.gain), gain, atol=1e-5)
  # g moves the head toward the target: a small step along g lowers the sparse TV
  step = jnp.asarray(head_out) + 0.05 * mt.g / jnp.sqrt(jnp.mean(mt.g ** 2))
  mt2 = reflex.feedback(cfg, target, step, jnp.asarray(ids_q), jnp.asarray(ids_p),
                        jnp.asarray(token), jnp.asarray(cand), jnp.asarray(corr_top),
                        jnp.asarray(raw_top), jnp.asarray(path_h), jnp.asarray(lse))
  assert float(mt2.tv) < float(mt.tv)


def test_feedback_under_a_top_k_restriction_gives_disallowed_ids_no_mass(small):
  """With top-k sampling the target's p is the restricted softmax: an id on S below the
  restriction's floor (a head's top id, a candidate, top-m padding) gets p 0; the tail and the
  candidates' miss are of the allowed mass; floor -inf is no restriction."""
  c, p, w, scale = small
  cfg = reflex.ReflexConfig(top=3, topk=(3, 2, 2), weak=2)
  rng = np.random.default_rng(3)
  head_out = rng.normal(size=D).astype(np.float32)
  path_h = rng.normal(size=D).astype(np.float32)
  x_q = _np_norm(head_out, scale) @ w.T
  x_p = _np_norm(path_h, scale) @ w.T
  order = np.argsort(-x_p)
  allowed = order[:2]  # top-k 2
  p_full = np.zeros(V)
  p_full[allowed] = _softmax(x_p[allowed])
  lse = float(np.log(np.exp(x_p[allowed]).sum()))
  floor = float(x_p[order[1]])
  ids_q = np.argsort(-x_q)[:3]
  ids_p = order[:3]  # a top-m wider than the allowed set: its third id is masked
  token = int(order[1])
  cand = np.array([int(ids_q[0]), int(order[0]), -1])
  target = Target(config=c, params=p, sampling=SamplingConfig(temperature=1.0, top_k=2))
  args = [jnp.asarray(x) for x in (head_out, ids_q, ids_p, token, cand, cand, cand, path_h, lse)]
  mt = reflex.feedback(cfg, target, *args, jnp.float32(floor))
  s = sorted({*map(int, ids_q), *map(int, ids_p), token, *(int(i) for i in cand if i >= 0)})
  assert {int(i) for i in ids_q} - {int(i) for i in allowed}  # a disallowed id on S
  ps = p_full[s] / p_full[s].sum()
  sup, pp = np.asarray(mt.support), np.asarray(mt.p)
  got = {int(i): float(v) for i, v in zip(sup, pp, strict=True) if i >= 0}
  assert sorted(got) == s
  np.testing.assert_allclose([got[i] for i in s], ps, atol=1e-6)
  assert all(got[i] == 0.0 for i in s if i not in set(allowed.tolist()))
  np.testing.assert_allclose(float(mt.p_tail), 1 - p_full[s].sum(), atol=1e-6)
  np.testing.assert_allclose(float(mt.tv), 0.5 * np.abs(ps - _softmax(x_q[s])).sum(), atol=1e-5)
  cset = {int(i) for i in cand if i >= 0}
  np.testing.assert_allclose(float(mt.out), 1 - sum(p_full[i] for i in cset), atol=1e-6)
  # no restriction: floor -inf gives what no floor gives
  free = Target(config=c, params=p, sampling=SamplingConfig(temperature=1.0))
  a = reflex.feedback(cfg, free, *args)
  b = reflex.feedback(cfg, free, *args, jnp.float32(-jnp.inf))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("n_due", [12, 13])  # all R * K compact; one more: dense
def test_feedback_of_due_records_only_equals_dense(small, n_due):
  """The matured records' feedback is computed on the due ones alone (gathered, R * K = 12 of
  R * K * S = 60 slots here) unless more are due (the dense path): the same values wherever a
  record is due, zeros or the dense values elsewhere (never read)."""
  c, p, _, _ = small
  cfg = reflex.ReflexConfig(top=3, topk=(3, 2, 2), weak=2)
  prop = proposers.ReflexProposer(cfg)
  target = Target(config=c, params=p, sampling=SamplingConfig(temperature=0.7))
  r, k, s, cm = 4, 3, cfg.slots, cfg.max_candidates
  rng = np.random.default_rng(n_due)
  ids = lambda *sh: jnp.asarray(rng.integers(-1, V, size=(r, k, s) + sh), jnp.int32)
  args = (jnp.asarray(rng.normal(size=(r, k, s, D)), jnp.float32), ids(3), ids(3),
          jnp.asarray(rng.integers(0, V, size=(r, k, s)), jnp.int32), ids(cm), ids(cm), ids(cm),
          jnp.asarray(rng.normal(size=(r, k, s, D)), jnp.float32),
          jnp.asarray(rng.normal(size=(r, k, s)) + 3.0, jnp.float32))
  due = np.zeros(r * k * s, bool)
  due[rng.permutation(r * k * s)[:n_due]] = True
  due = jnp.asarray(due.reshape(r, k, s))
  ours = jax.jit(lambda d, a: prop._feedback_due(target, d, a))(due, args)
  dense = jax.jit(lambda a: reflex.feedback(cfg, target, *a))(args)
  mask = np.asarray(due)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(dense), strict=True):
    np.testing.assert_allclose(np.asarray(a)[mask], np.asarray(b)[mask], rtol=1e-5, atol=1e-6)
  if 0 < n_due <= r * k:  # the compact path: nothing computed where no record is due
    assert not np.asarray(ours.tv)[~mask].any() and not np.asarray(ours.g)[~mask].any()


def test_welford_lcb_and_trust_match_direct_computation():
  cos = np.array([0.3, 0.1, 0.25, -0.05, 0.4, 0.2, 0.15, 0.35, 0.05, 0.3], np.float32)
  cfg = reflex.ReflexConfig(min_obs=(8, 8, 8), min_severity=(0.0, 0.0, 0.0))
  z = jnp.zeros((1, 1))
  one = reflex.FastState(m=jnp.full((1, 1, 4), 0.02), count=z, mean=z, m2=z, severity=z)
  batched = one
  for x in cos:  # one observation at a time: Welford
    one = reflex.welford_merge(one, jnp.ones((1, 1)), jnp.full((1, 1), x), jnp.full((1, 1), x * x))
  for chunk in (cos[:3], cos[3:7], cos[7:]):  # or several per step: Chan's parallel merge
    batched = reflex.welford_merge(batched, jnp.full((1, 1), len(chunk)),
                                   jnp.full((1, 1), chunk.sum()),
                                   jnp.full((1, 1), (chunk * chunk).sum()))
  n = len(cos)
  mean, sd = cos.mean(), cos.std(ddof=1)
  want_lcb = mean - 1.0 * sd / np.sqrt(n)
  for st in (one, batched):
    np.testing.assert_allclose(float(st.count[0, 0]), n)
    np.testing.assert_allclose(float(st.mean[0, 0]), mean, atol=1e-6)
    np.testing.assert_allclose(float(reflex.lcb(st, 1.0)[0, 0]), want_lcb, atol=1e-6)
  eligible, trust, ratio, low = reflex.gate(cfg, one, jnp.ones((1,)))
  rms_m = 0.02
  want_trust = np.sqrt(np.clip(want_lcb / 0.10, 0, 1) * np.clip(rms_m / 0.03, 0, 1))
  np.testing.assert_allclose(float(trust[0, 0]), want_trust, atol=1e-6)
  np.testing.assert_allclose(float(ratio[0, 0]), 0.010 + 0.020 * want_trust, atol=1e-7)
  assert bool(eligible[0, 0]) == (want_lcb > 0)


def _fast(rng, r, k, d, count=100.0, mean=0.3, severity=10.0, m_scale=0.05):
  return reflex.FastState(m=jnp.asarray(rng.normal(size=(r, k, d)) * m_scale, jnp.float32),
                          count=jnp.full((r, k), count), mean=jnp.full((r, k), mean),
                          m2=jnp.full((r, k), 0.5), severity=jnp.full((r, k), severity))


def test_correction_bounds_and_exact_noop_when_ineligible(trained_model):
  config, params, _ = trained_model
  d = config.hidden_size
  cfg = reflex.ReflexConfig()
  heads = H.init(jax.random.key(3), config, 3, scale=0.05)
  rng = np.random.default_rng(2)
  h = jnp.asarray(rng.normal(size=(6, d)), jnp.float32)
  fast = _fast(rng, 6, 3, d)
  # rows 0..2 eligible; row 3 too few observations, row 4 LCB <= 0, row 5 state too small
  fast = fast.replace(count=fast.count.at[3].set(3.0), mean=fast.mean.at[4].set(-0.1),
                      m=fast.m.at[5].set(1e-4))
  target = Target(config=config, params=params)
  for safety in (1.0, 0.25):
    glob = reflex.init_global(cfg).replace(safety=jnp.full((3,), safety))
    z, zc, c, eligible, ratio, _ = reflex.corrected_head_states(target, heads, glob, cfg, fast, h)
    np.testing.assert_array_equal(np.asarray(eligible).any(1), [1, 1, 1, 0, 0, 0])
    rms = lambda x: np.sqrt(np.mean(np.square(np.asarray(x, np.float64)), -1))
    bound = safety * np.asarray(cfg.r_max)[None] * rms(z)
    assert (rms(c) <= bound * (1 + 1e-5) + 1e-9).all()
    assert (rms(c)[:3] > 0).all()
    np.testing.assert_array_equal(np.asarray(c)[3:], 0.0)
    # ineligible rows: head outputs and logits are the static heads', bit for bit
    np.testing.assert_array_equal(np.asarray(zc)[3:], np.asarray(z)[3:])
    static = H.apply(config, params, heads, h)
    ours = models.logits_from_hidden(config, params, zc)
    np.testing.assert_array_equal(np.asarray(ours)[3:], np.asarray(static)[3:])


def _feedback(r, d1, dm, *, position, path_len, tokens, keep, done=None, active=None):
  n1 = 1
  topm = jnp.tile(jnp.arange(16, dtype=jnp.int32)[None, None], (r, d1, 1))
  return Feedback(
      tree=T.root_only(jnp.zeros((r,), jnp.int32)), target_tokens=jnp.zeros((r, n1), jnp.int32),
      accepted=jnp.ones((r, n1), bool), path=jnp.zeros((r, d1), jnp.int32),
      path_len=jnp.asarray(path_len, jnp.int32), tokens=jnp.asarray(tokens, jnp.int32),
      keep=jnp.asarray(keep, bool), position=jnp.asarray(position, jnp.int32),
      hidden=jnp.ones((r, dm)), path_hidden=jnp.ones((r, d1, dm)),
      active=jnp.ones((r,), bool) if active is None else jnp.asarray(active),
      done=jnp.zeros((r,), bool) if done is None else jnp.asarray(done),
      row=jnp.arange(r, dtype=jnp.int32), sample_ids=jnp.arange(r, dtype=jnp.int32),
      topm_ids=topm, topm_logprobs=jnp.full((r, d1, 16), -3.0), lse=jnp.zeros((r, d1)))


def _rows_init(r, d):
  from specroll_jax.proposers.base import RowsInit
  return RowsInit(prompt_tokens=jnp.zeros((r, 4), jnp.int32),
                  prompt_lengths=jnp.full((r,), 4, jnp.int32),
                  sample_ids=jnp.arange(r, dtype=jnp.int32), row=jnp.arange(r, dtype=jnp.int32),
                  first_token=jnp.zeros((r,), jnp.int32), hidden=jnp.zeros((r, d)))


def test_delayed_maturity_and_dropped_rows(trained_model):
  config, params, _ = trained_model
  d = config.hidden_size
  cfg = reflex.ReflexConfig(record_capacity=16)
  prop = proposers.ReflexProposer(cfg)
  target = Target(config=config, params=params)
  heads = H.init(jax.random.key(3), config, 3, scale=0.05)
  pp = prop.params(heads, reflex.init_global(cfg))
  rows, shared = prop.init(target, pp, _rows_init(3, d))
  assert all(float(jnp.abs(x).sum()) == 0 for x in jax.tree.leaves(rows.fast))  # starts at zero
  # head 1 of every row has pending records for positions 11, 12 and 13
  pos = rows.pending.position
  for t in (11, 12, 13):
    pos = pos.at[:, 0, t % cfg.slots].set(t)
  rows = rows.replace(pending=rows.pending.replace(position=pos))
  # row 0: L = 10, 2 tokens committed (11, 12); row 1: L = 10, 1 token (11);
  # row 2: L = 10, 3 tokens offered but an EOS cut after the first and the row is done
  fb = _feedback(3, 4, d, position=[10, 10, 10], path_len=[2, 1, 3],
                 tokens=np.full((3, 4), 5), keep=[[1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]],
                 done=[False, False, True])
  (rows2, shared2), stats = prop.update(target, pp, (rows, shared), fb)
  left = np.asarray(rows2.pending.position)[:, 0]
  assert sorted(t for t in left[0] if t >= 0) == [13]  # 11, 12 matured; 13 waits
  assert sorted(t for t in left[1] if t >= 0) == [12, 13]
  assert (left[2] == -1).all()  # matured 11, dropped 12 and 13 (row done)
  assert int(stats.matured[0]) == 2 + 1 + 1
  assert int(shared2.records.count[0]) == 4
  written = np.asarray(shared2.records.position)[0]
  assert sorted(written[np.asarray(shared2.records.valid)[0]].tolist()) == [11, 11, 11, 12]
  # the same feedback again matures nothing more: never twice
  (_, shared3), stats3 = prop.update(target, pp, (rows2, shared2), fb)
  assert int(stats3.matured[0]) == 0 and int(shared3.records.count[0]) == 4


def test_nonfinite_feedback_resets_only_that_row_head(trained_model):
  config, params, _ = trained_model
  d = config.hidden_size
  cfg = reflex.ReflexConfig(record_capacity=0)
  prop = proposers.ReflexProposer(cfg)
  target = Target(config=config, params=params)
  pp = prop.params(H.init(jax.random.key(3), config, 3, scale=0.05), reflex.init_global(cfg))
  rows, shared = prop.init(target, pp, _rows_init(2, d))
  rng = np.random.default_rng(0)
  rows = rows.replace(fast=_fast(rng, 2, 3, d))
  pend = rows.pending
  for k in range(3):
    sl = 11 % cfg.slots
    pend = pend.replace(position=pend.position.at[:, k, sl].set(11),
                        has_sigma=pend.has_sigma.at[:, k, sl].set(True),
                        sigma=pend.sigma.at[:, k, sl].set(1 / np.sqrt(cfg.sketch_dim)))
  pend = pend.replace(head=pend.head.at[1, 2].set(jnp.nan))  # row 1, head 3: NaN prediction
  rows = rows.replace(pending=pend)
  fb = _feedback(2, 4, d, position=[10, 10], path_len=[1, 1], tokens=np.full((2, 4), 5),
                 keep=[[1, 0, 0, 0], [1, 0, 0, 0]])
  (rows2, _), stats = prop.update(target, pp, (rows, shared), fb)
  f0, f1 = rows.fast, rows2.fast
  assert float(f1.count[1, 2]) == 0 and float(jnp.abs(f1.m[1, 2]).sum()) == 0
  assert np.asarray(stats.resets).tolist() == [0, 0, 1]
  for r, k in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
    assert float(f1.count[r, k]) >= float(f0.count[r, k])  # kept, and updated normally
    assert np.isfinite(np.asarray(f1.m[r, k])).all() and float(jnp.abs(f1.m[r, k]).sum()) > 0


def test_group_sharing(trained_model):
  config, params, _ = trained_model
  d = config.hidden_size
  cfg = reflex.ReflexConfig(share_group=2, record_capacity=0)
  prop = proposers.ReflexProposer(cfg)
  target = Target(config=config, params=params)
  pp = prop.params(H.init(jax.random.key(3), config, 3, scale=0.05), reflex.init_global(cfg))
  rows, shared = prop.init(target, pp, _rows_init(4, d))
  assert rows.fast is None and shared.group.m.shape == (2, 3, d)
  rng = np.random.default_rng(1)
  shared = shared.replace(group=_fast(rng, 2, 3, d))
  view = prop._view(rows, shared, jnp.arange(4))
  np.testing.assert_array_equal(np.asarray(view.m[0]), np.asarray(view.m[1]))  # one state
  assert not np.array_equal(np.asarray(view.m[0]), np.asarray(view.m[2]))
  sl = 11 % cfg.slots
  pend = rows.pending
  pend = pend.replace(position=pend.position.at[:2, 0, sl].set(11),
                      has_sigma=pend.has_sigma.at[:2, 0, sl].set(True),
                      sigma=pend.sigma.at[:2, 0, sl].set(1 / np.sqrt(cfg.sketch_dim)))
  rows = rows.replace(pending=pend)
  # only rows 0 and 1 (group 0) are active and commit a token
  fb = _feedback(4, 4, d, position=[10] * 4, path_len=[1, 1, 0, 0], tokens=np.full((4, 4), 5),
                 keep=[[1, 0, 0, 0], [1, 0, 0, 0], [0] * 4, [0] * 4],
                 active=[True, True, False, False])
  (_, shared2), stats = prop.update(target, pp, (rows, shared), fb)
  assert int(stats.matured[0]) == 2
  g0, g1 = shared.group, shared2.group
  assert float(g1.count[0, 0]) == float(g0.count[0, 0]) + 2  # both rows' observations
  for leaf0, leaf1 in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
    np.testing.assert_array_equal(np.asarray(leaf0)[1], np.asarray(leaf1)[1])  # group 1 as is
  assert not np.array_equal(np.asarray(g0.m[0]), np.asarray(g1.m[0]))


def test_end_batch_safety_rules():
  cfg = reflex.ReflexConfig()
  glob = reflex.init_global(cfg)

  def stats(mean, n=50, sd=0.01):
    g = np.random.default_rng(0).normal(mean, sd, size=n)
    return reflex.ReflexStats.zeros(3).replace(
        gain_sum=jnp.full((3,), g.sum()), gain_sq=jnp.full((3,), (g * g).sum()),
        gain_n=jnp.full((3,), n))

  g1 = reflex.end_batch(cfg, glob, stats(-0.05))
  assert np.asarray(g1.safety).tolist() == [1.0] * 3  # one bad batch: not yet
  g2 = reflex.end_batch(cfg, g1, stats(-0.05))
  np.testing.assert_allclose(np.asarray(g2.safety), 0.5)  # twice in a row: halved
  g = g2
  for _ in range(2):
    g = reflex.end_batch(cfg, g, stats(0.05))
  np.testing.assert_allclose(np.asarray(g.safety), 0.5)
  g = reflex.end_batch(cfg, g, stats(0.05))  # third batch above zero: x 1.25
  np.testing.assert_allclose(np.asarray(g.safety), 0.625)
  low = glob.replace(safety=jnp.full((3,), 0.125))
  for _ in range(4):
    low = reflex.end_batch(cfg, low, stats(-0.05))
  np.testing.assert_allclose(np.asarray(low.safety), 0.125)  # never below the floor
  noisy = reflex.end_batch(cfg, glob, stats(0.0, sd=0.5))
  assert np.asarray(noisy.safety).tolist() == [1.0] * 3 and int(noisy.below[0]) == 0
  assert int(g.sleep) == 0 and int(noisy.sleep) == 0  # sleep_batches = 0: Reflex never sleeps
  # sleep_batches > 0: asleep after a batch whose corrections did not pay, awake after one that did
  sleepy = reflex.ReflexConfig(sleep_batches=3)
  g0 = reflex.init_global(sleepy)
  assert int(g0.sleep) == 0  # the first batch is awake
  assert int(reflex.end_batch(sleepy, g0, stats(0.05)).sleep) == 0  # paid: stays awake
  assert int(reflex.end_batch(sleepy, g0, stats(-0.05)).sleep) == 3  # cost acceptance
  assert int(reflex.end_batch(sleepy, g0, stats(0.0, sd=0.5)).sleep) == 3  # not shown to pay
  assert int(reflex.end_batch(sleepy, g0, reflex.ReflexStats.zeros(3)).sleep) == 3  # no gain seen
  one = reflex.ReflexStats.zeros(3).replace(  # one head paid, the others saw nothing: awake
      gain_sum=jnp.asarray([2.5, 0.0, 0.0]), gain_sq=jnp.asarray([0.1251, 0.0, 0.0]),
      gain_n=jnp.asarray([50, 0, 0]))
  assert int(reflex.end_batch(sleepy, g0, one).sleep) == 0
  with pytest.raises(ValueError, match="sleep_batches must be an int >= 0"):
    reflex.ReflexConfig(sleep_batches=-1)
  # without a backoff every sleep is sleep_batches; with sleep_max_batches each further unpaid
  # awake batch doubles the sleep up to the cap, and a paid batch starts over
  def sleeps(cfg, outcomes):
    g, out = reflex.init_global(cfg), []
    for paid in outcomes:
      g = reflex.end_batch(cfg, g, stats(0.05 if paid else -0.05))
      out.append(int(g.sleep))
    return out

  unpaid6 = [False] * 6
  assert sleeps(sleepy, unpaid6) == [3] * 6
  assert sleeps(reflex.ReflexConfig(sleep_batches=3, sleep_max_batches=2), unpaid6) == [3] * 6
  backoff = reflex.ReflexConfig(sleep_batches=3, sleep_max_batches=20)
  assert sleeps(backoff, unpaid6) == [3, 6, 12, 20, 20, 20]
  assert sleeps(backoff, [False, False, True, False, False]) == [3, 6, 0, 3, 6]
  with pytest.raises(ValueError, match="sleep_max_batches must be an int >= 0"):
    reflex.ReflexConfig(sleep_max_batches=-1)


# ------------------------------------------------------------ stride and skipped bookkeeping

EAGER = dict(min_obs=(2, 2, 2), min_severity=(0.05, 0.05, 0.05), lcb_z=-5.0, stride_rows=1.0,
             record_capacity=64)


def test_stride_default_and_checks():
  assert reflex.ReflexConfig().stride == 1  # the default keeps the row-adaptive stride alone
  for bad in (0, -2, True, 1.5):
    with pytest.raises(ValueError, match="stride"):
      reflex.ReflexConfig(stride=bad)


def _always_true_branch(pred, true_fn, false_fn, *operands):
  return true_fn(*operands)


@pytest.mark.parametrize("case", ["idle", "busy"])
def test_skipped_bookkeeping_is_exact(trained_model, monkeypatch, case):
  """A step with no record to write or to mature skips that work (lax.cond); the result is what
  the work would have given, bit for bit (checked by forcing every branch to run)."""
  config, params, _ = trained_model
  d = config.hidden_size
  cfg = reflex.ReflexConfig(**{**EAGER, "stride": 3})
  prop = proposers.ReflexProposer(cfg)
  target = Target(config=config, params=params)
  pp = prop.params(H.init(jax.random.key(3), config, 3, scale=0.05), reflex.init_global(cfg))
  r = 3
  rows, shared = prop.init(target, pp, _rows_init(r, d))
  rng = np.random.default_rng(4)
  rows = rows.replace(fast=_fast(rng, r, 3, d), steps=jnp.full((r,), 0 if case == "busy" else 1))
  pend = rows.pending
  for k in range(3):  # pending records at positions 11 and 14 of every head
    for t in (11, 14):
      sl = t % cfg.slots
      pend = pend.replace(position=pend.position.at[:, k, sl].set(t),
                          head=pend.head.at[:, k, sl].set(jnp.asarray(rng.normal(size=(r, d)))),
                          has_sigma=pend.has_sigma.at[:, k, sl].set(True),
                          sigma=pend.sigma.at[:, k, sl].set(1 / np.sqrt(cfg.sketch_dim)))
  state = (rows.replace(pending=pend), shared)
  from specroll_jax.proposers.base import ProposeInput
  # busy: L = 10 commits 11 (and 12); idle: L = 11 commits 12, 13 (no record there, no round)
  l0 = 10 if case == "busy" else 11
  inp = ProposeInput(hidden=jnp.asarray(rng.normal(size=(r, d)), jnp.float32),
                     root=jnp.array([1, 2, 3], jnp.int32), position=jnp.full((r,), l0),
                     history=jnp.zeros((r, 32), jnp.int32), budget=jnp.full((r,), 4),
                     row=jnp.arange(r), sample_ids=jnp.arange(r),
                     seed=jnp.zeros((r,), jnp.uint32))
  fb = _feedback(r, 4, d, position=[l0] * r, path_len=[2] * r, tokens=np.full((r, 4), 5),
                 keep=[[1, 1, 0, 0]] * r)

  def step(st):
    tr, st = prop.propose(target, pp, st, inp, num_nodes=4)
    st, stats = prop.update(target, pp, st, fb.replace(tree=tr))
    return tr, st, stats

  skipped = jax.jit(step)(state)
  monkeypatch.setattr(jax.lax, "cond", _always_true_branch)
  forced = jax.jit(step)(state)
  for a, b in zip(jax.tree.leaves(skipped), jax.tree.leaves(forced), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # busy: the round writes 11, 12, 13 (heads 1..3); 11 (every head) and 12 (head 2) mature,
  # 13 (head 3) and 14 (every head) wait. idle: nothing written, nothing due, all 6 wait
  matured = np.asarray(skipped[2].matured).tolist()
  assert matured == ([r, 2 * r, r] if case == "busy" else [0, 0, 0])
  waiting = (np.asarray(skipped[1].rows.pending.position) >= 0).sum((0, 2)).tolist()
  assert waiting == ([r, r, 2 * r] if case == "busy" else [2 * r] * 3)


@pytest.fixture(scope="module")
def stride_rollouts(trained_model, gsm8k_prompts):
  """Vanilla and Reflex rollouts (gates opened wide) with stride 1 and 3, one compile each."""
  from specroll_jax import rollout
  from specroll_jax.rollout import SpecConfig
  config, params, tok = trained_model
  prompts = gsm8k_prompts[:4]
  heads = H.init(jax.random.key(4), config, 3, scale=0.05)
  sampling = SamplingConfig(temperature=1.0)
  kw = dict(sampling=sampling, max_new_tokens=32, seed=1, eos_ids=tok.eos_ids)
  out = {"vanilla": rollout.generate(config, params, prompts, **kw)}
  for s in (1, 3):
    cfg = reflex.ReflexConfig(**EAGER, stride=s)
    prop = proposers.ReflexProposer(cfg)
    spec = SpecConfig(node_budget=16, bucket_fractions=(1.0,))
    pp = prop.params(heads, reflex.init_global(cfg))
    out[s] = rollout.generate(config, params, prompts, **kw,
                              speculation=rollout.Speculation(prop, pp, spec))
  return out


@pytest.mark.slow  # two more adaptive compiles; Reflex exactness stays in test_adaptation
def test_stride_keeps_vanilla_tokens(stride_rollouts):
  ref = stride_rollouts["vanilla"]
  for s in (1, 3):
    out = stride_rollouts[s]
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    assert int(np.asarray(out.stats.spec.proposer.applied).sum()) > 0  # it corrected


@pytest.mark.slow
def test_stride_records_every_stride_th_step(stride_rollouts):
  for s in (1, 3):
    st = stride_rollouts[s].stats.spec.proposer
    row_steps = int(st.row_head_steps[0])
    matured = int(st.matured[0])  # head 1's record matures in the step that wrote it
    if s == 1:  # stride_rows = 1: every row records on every step
      assert matured == row_steps
    else:  # a row records on its steps 0, s, 2s, ...
      assert row_steps / s <= matured <= row_steps / s + 4
  one, three = (stride_rollouts[s].stats.spec.proposer for s in (1, 3))
  for key in ("matured", "updates"):
    assert int(np.asarray(getattr(three, key)).sum()) < int(np.asarray(getattr(one, key)).sum())
