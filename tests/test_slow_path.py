"""Slow path: degradation monitor, guarded head refresh (keep / exact rollback), compile-once,
modes, checkpointable state."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import head_slice, leaves_equal

from app.checkpoint import Checkpointer
from specroll_jax import models
from specroll_jax.adaptation import records as records_lib
from specroll_jax.adaptation import slow_path as sp
from specroll_jax.adaptation.records import Records
from specroll_jax.adaptation.slow_path import retrain
from specroll_jax.heads import medusa as heads_lib

K, S, KC, TOP = 3, 20, 4, 16  # heads, support width (4 unused entries), candidates, used support
# 2 Adam steps at the DESIGN lr (1e-5) barely move a random tiny model; 1e-2 makes the effect of
# a refresh (and of a bad one) large against float noise.
TRAIN_CFG = sp.SlowPathConfig.for_tests(learning_rate=1e-2)
REFRESH_CFG = TRAIN_CFG.refresh_settings()  # what after_batch compiles with: one program for all


@pytest.fixture(scope="module")
def tiny():
  """(config, params, student heads, teacher heads). The refresh reads only the target's final
  norm and unembedding, so params holds just those (a full init_params costs seconds on CPU).
  The teacher is the student drifted by N(0, 0.1^2) on W and b: a fixed target at sparse TV ~0.3."""
  config = models.ModelConfig.tiny(vocab_size=64)
  d, v = config.hidden_size, config.vocab_size
  rng = np.random.default_rng(0)
  params = {"embed": {"embedding": jnp.asarray(0.3 * rng.standard_normal((v, d)), jnp.float32)},
            "final_norm": {"scale": jnp.ones((d,), jnp.float32)}}
  student = heads_lib.init(jax.random.key(1), config, K, scale=0.05)
  drift = lambda x: x + jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype)
  teacher = student.replace(w=drift(student.w), b=drift(student.b))
  return config, params, student, teacher


@functools.partial(jax.jit, static_argnums=0)
def _source_logits(config, params, source, h):
  per = heads_lib.apply(config, params, source, h)  # [K, n, K, V]: head k reads h[k]
  return jnp.stack([per[k, :, k] for k in range(K)])


def make_records(config, params, source, seed, n, tv=0.1) -> Records:
  """A fresh buffer of n records per head whose target distribution is ``source`` head k's (a
  fixed target): support = its top-16 plus 4 unused ids, committed token sampled from it."""
  rng = np.random.default_rng(seed)
  h = rng.standard_normal((K, n, config.hidden_size)).astype(np.float32)
  logits = np.asarray(_source_logits(config, params, source, h), np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ids = np.argsort(-p, -1)[..., :TOP]
  vals = np.take_along_axis(p, ids, -1)
  pad = lambda x, v: np.concatenate([x, np.full(x.shape[:-1] + (S - TOP,), v, x.dtype)], -1)
  token = (p.cumsum(-1) < rng.random((K, n, 1))).sum(-1).clip(0, p.shape[-1] - 1)
  cands = ids[..., :KC]
  f32, i32 = lambda x: jnp.asarray(x, jnp.float32), lambda x: jnp.asarray(x, jnp.int32)
  return Records(hidden=f32(h), correction=f32(np.zeros_like(h)), support=i32(pad(ids, -1)),
                 p=f32(pad(vals / vals.sum(-1, keepdims=True), 0.0)), p_tail=f32(1 - vals.sum(-1)),
                 token=i32(token), candidates=i32(cands),
                 hit=jnp.asarray((cands == token[..., None]).any(-1)),
                 tv=f32(np.broadcast_to(np.asarray(tv, np.float32).reshape(-1, 1), (K, n))),
                 position=i32(np.broadcast_to(np.arange(n), (K, n))),
                 valid=jnp.ones((K, n), bool), count=i32(np.full((K,), n)))


_merge = jax.jit(records_lib.merge)


def fill(state, recs):
  return state.replace(reservoir=_merge(state.reservoir, recs))


# --- monitor ------------------------------------------------------------------------------------

MON_CFG = sp.SlowPathConfig.for_tests(calibration_batches=10, check_every=2, min_records=16,
                                      patience=2, cooldown_batches=6)


def run_monitor(cfg, shifts, n_batches, records=20, seed=0, noise=0.02, refresh_cost=0.0):
  """Feed synthetic per-batch stats: TV 0.3 and acceptance 0.6 plus N(0, noise) per head, plus
  ``shifts(b) -> (dtv [K], dacc [K])`` at batch b (1-based), 1 s of rollout per batch; a refresh
  is charged ``refresh_cost`` seconds (as ``after_batch`` commits it). Returns per batch (reason,
  refresh)."""
  rng = np.random.default_rng(seed)
  upd = jax.jit(sp.monitor_update, static_argnums=0)
  m, out = sp.monitor_init(cfg, K), []
  for b in range(1, n_batches + 1):
    dtv, dacc = shifts(b)
    tv = 0.3 + noise * rng.standard_normal(K) + dtv
    acc = 0.6 + noise * rng.standard_normal(K) + dacc
    m, d = upd(cfg, m, jnp.asarray(tv, jnp.float32), jnp.asarray(acc, jnp.float32),
               jnp.full((K,), records, jnp.float32), jnp.float32(1.0))
    out.append((sp.REASONS[int(d.reason)], np.asarray(d.refresh)))
    if out[-1][1].any():
      m = m.replace(refresh_seconds=m.refresh_seconds + refresh_cost,
                    last_refresh_seconds=jnp.float32(refresh_cost))
  return m, out


def fires(out):
  return [(b + 1, r.nonzero()[0].tolist()) for b, (_, r) in enumerate(out) if r.any()]


def sustained(start=11):
  return lambda b: ((np.array([0.10, 0.20, 0.15]), np.full(K, -0.1)) if b >= start
                    else (np.zeros(K), np.zeros(K)))


def test_monitor_fires_on_sustained_degradation_worst_two_heads_after_patience_with_cooldown():
  _, out = run_monitor(MON_CFG, sustained(), 30)
  reasons = [r for r, _ in out]
  assert reasons[:10] == ["calibrating"] * 10
  assert reasons[10] == "waiting" and reasons[11] == "degraded"  # first degraded check: patience
  f = fires(out)
  assert f[0] == (14, [1, 2])  # second consecutive degraded check; the 2 worst of 3 degraded
  assert all(len(heads) <= 2 for _, heads in f)
  gaps = np.diff([b for b, _ in f])
  assert len(f) >= 3 and (gaps >= MON_CFG.cooldown_batches).all(), f
  assert "cooldown" in reasons[14:20]


def _refresh_result(before, after, keep=(True, True, True)):
  """A ``RefreshResult`` of every head with held-out TV ``before`` -> ``after``."""
  f = lambda x: jnp.asarray(x, jnp.float32)
  ev = lambda tv: sp.Evaluation(ce=f([1.0] * K), tv=f(tv), token_ce=f([1.0] * K), n=f([9] * K))
  return sp.RefreshResult(trained=jnp.ones((K,), bool), keep=jnp.asarray(keep),
                          before=ev(before), after=ev(after), loss=f([0.0] * K),
                          n_train=f([9] * K))


def test_refresh_gain_averages_the_relative_tv_drop_and_counts_a_rollback_as_none():
  r = _refresh_result([0.4, 0.5, 0.2], [0.3, 0.5, 0.1], keep=(True, True, False))
  assert sp.refresh_gain(r) == pytest.approx((0.25 + 0.0 + 0.0) / 3)
  assert sp.refresh_gain(r.replace(trained=jnp.zeros((K,), bool))) == 0.0


def test_learning_goes_on_while_refits_pay_and_ends_when_they_stop():
  """A learning phase runs its first ``bootstrap_batches`` refreshes, then as long as each lowers
  the held-out TV by ``learn_gain``; with ``learn_gain`` 0 it runs exactly its refreshes; a
  refresh after sustained degradation that pays starts a new phase. Batches without records
  neither refresh nor end it, and the calibration's clock starts where it ends."""
  from specroll_jax.adaptation.slow_path import _learn_after
  from specroll_jax.adaptation.slow_path.config import _R
  cfg = MON_CFG.replace(bootstrap_batches=2, learn_gain=0.05, calibration_batches=3)
  m = sp.monitor_init(cfg, K)
  assert int(m.learning) == 1 and int(m.phases) == 1
  flags = []
  for gain in (0.0, 0.2, 0.1, 0.01, 0.3):  # the bootstrap's 2 refreshes, then while they pay
    m = _learn_after(cfg, m, _R["bootstrap"] if int(m.learn_refreshes) < 2 else _R["learning"],
                     3, gain)
    flags.append(int(m.learning))
    if not flags[-1]:
      break
  assert flags == [1, 1, 1, 0] and int(m.learn_refreshes) == 4
  fixed = cfg.replace(learn_gain=0.0)
  m2 = sp.monitor_init(fixed, K)
  m2 = _learn_after(fixed, m2, _R["bootstrap"], 3, 0.9)
  assert int(m2.learning) == 1
  m2 = _learn_after(fixed, m2, _R["bootstrap"], 3, 0.9)
  assert int(m2.learning) == 0  # exactly bootstrap_batches refreshes
  again = _learn_after(cfg, m, _R["sustained_degradation"], 3, 0.2)  # a task shift that pays
  assert int(again.learning) == 1 and int(again.phases) == 2 and int(again.learn_refreshes) == 0
  assert int(_learn_after(cfg, m, _R["sustained_degradation"], 3, 0.01).learning) == 0
  # through the monitor: records-free batches keep the phase, then it ends and calibration runs
  upd = jax.jit(sp.monitor_update, static_argnums=0)
  m = sp.monitor_init(cfg, K)
  tv, acc = jnp.full((K,), 0.3), jnp.full((K,), 0.6)
  reasons = []
  for b in range(8):
    n = jnp.full((K,), 0.0 if b % 2 else 20.0)  # records on every other batch only
    m, d = upd(cfg, m, tv, acc, n, jnp.float32(1.0))
    reasons.append(sp.REASONS[int(d.reason)])
    assert bool(d.refresh.any()) == (b % 2 == 0 and int(m.learning) == 1)
    if d.refresh.any():  # as after_batch does: the phase ends at the second refresh (no gain)
      m = _learn_after(cfg, m, int(d.reason), int(d.steps), 0.0)
  assert reasons[:3] == ["bootstrap"] * 3  # two refreshes, over three batches
  assert reasons[3:6] == ["calibrating"] * 3 and int(m.learn_end) == 3


def test_learning_is_judged_over_bootstrap_steps_of_refreshes():
  """Refreshes held to a few steps each (a small budget) are judged together: learning goes on
  until their steps since the last verdict reach ``bootstrap_steps``, and then on only if their
  compounded held-out TV drop reaches ``learn_gain``; a refresh of ``bootstrap_steps`` steps is
  judged alone."""
  from specroll_jax.adaptation.slow_path import _learn_after
  from specroll_jax.adaptation.slow_path.config import _R
  cfg = MON_CFG.replace(bootstrap_batches=2, bootstrap_steps=20, learn_gain=0.01)
  m = sp.monitor_init(cfg, K)
  flags = []
  for gain in [0.002] * 10 + [0.0005] * 10:  # 2 steps each: a verdict every 10 refreshes
    m = _learn_after(cfg, m, _R["bootstrap"] if int(m.learn_refreshes) < 2 else _R["learning"],
                     2, gain)
    flags.append(int(m.learning))
  # 1 - 0.998 ** 10 = 0.0198 pays at the first verdict; 1 - 0.9995 ** 10 = 0.005 does not
  assert flags == [1] * 19 + [0], flags
  assert int(m.verdict_steps) == 0 and float(m.verdict_keep) == 1.0
  m = sp.monitor_init(cfg, K)
  for gain in (0.5, 0.5, 0.005):  # whole refreshes: the third is judged alone and ends it
    m = _learn_after(cfg, m, _R["bootstrap"] if int(m.learn_refreshes) < 2 else _R["learning"],
                     20, gain)
  assert int(m.learning) == 0 and int(m.learn_refreshes) == 3


def test_a_probes_refresh_spends_the_budget_of_the_batches_since_the_last_trees():
  from types import SimpleNamespace

  from specroll_jax.specroll.fold import batches_since_trees
  st = lambda b, nxt, gap: SimpleNamespace(batches=b, next_probe=nxt, probe_gap=gap)
  assert batches_since_trees(st(0, 0, 4)) == 1  # the first batch
  assert batches_since_trees(st(4, 4, 4)) == 4  # a probe every 4 batches
  assert batches_since_trees(st(20, 20, 16)) == 16  # probes backed off to every 16
  assert batches_since_trees(st(7, 7, 1)) == 1  # trees every batch
  assert batches_since_trees(st(7, 7, 0)) == 1  # (no probes: goodput's trees every batch)
  assert batches_since_trees(st(9, 7, 4)) == 6  # goodput's trees after a stretch of vanilla


def test_learning_steps_fit_the_budget_and_a_collapse_refits_and_learns():
  """A learning refresh takes the steps that fit ``learn_budget`` of the batch's rollout at the
  last refresh's seconds per step, and waits where that is no step; head 1's acceptance near
  nothing over enough records is a collapse: every head with records refreshes and a learning
  phase starts."""
  cfg = MON_CFG.replace(bootstrap_batches=1, bootstrap_steps=20, learn_budget=0.05,
                        collapse_acceptance=0.02, collapse_records=16, calibration_batches=2)
  upd = jax.jit(sp.monitor_update, static_argnums=0)
  m = sp.monitor_init(cfg, K)
  tv, n = jnp.full((K,), 0.3), jnp.full((K,), 20.0)
  m, d = upd(cfg, m, tv, jnp.full((K,), 0.6), n, jnp.float32(2.0))
  assert int(d.steps) == 1  # nothing timed yet: one step
  # 0.06 s for 4 steps and two evaluation passes: 0.01 s a pass; 0.05 * 2 s fits 10 passes, 8
  # of them steps
  m = m.replace(last_refresh_seconds=jnp.float32(0.06), last_refresh_steps=jnp.int32(4))
  m, d = upd(cfg, m, tv, jnp.full((K,), 0.6), n, jnp.float32(2.0))
  assert int(d.steps) == 8
  m, d = upd(cfg, m, tv, jnp.full((K,), 0.6), n, jnp.float32(1.0), jnp.float32(4.0))
  assert int(d.steps) == 18  # the step around the rollout (4 s) bounds it when given
  m, d = upd(cfg, m, tv, jnp.full((K,), 0.6), n, jnp.float32(100.0))
  assert int(d.steps) == 20  # at most bootstrap_steps
  # past the bootstrap, a budget that holds no step (0.05 * 0.5 s: 2.5 passes) waits; the records
  # stay for the next refresh
  m = m.replace(learn_refreshes=jnp.int32(1))
  m, d = upd(cfg, m, tv, jnp.full((K,), 0.6), n, jnp.float32(0.5))
  assert sp.REASONS[int(d.reason)] == "learning" and not np.asarray(d.refresh).any()
  assert float(m.since_n.sum()) > 0 and int(m.learning) == 1
  m, d = upd(cfg, m, tv, jnp.full((K,), 0.6), n, jnp.float32(0.8))  # 4 passes: 2 steps
  assert np.asarray(d.refresh).all() and int(d.steps) == 2
  m = m.replace(learning=jnp.int32(0))
  for _ in range(4):  # calibrated and healthy
    m, d = upd(cfg, m, tv, jnp.full((K,), 0.6), n, jnp.float32(2.0))
  assert sp.REASONS[int(d.reason)] in ("calibrating", "healthy", "waiting")
  m, d = upd(cfg, m, tv, jnp.asarray([0.01, 0.6, 0.6]), jnp.full((K,), 8.0), jnp.float32(2.0))
  assert sp.REASONS[int(d.reason)] != "collapse"  # too few records to call it
  m, d = upd(cfg, m, tv, jnp.asarray([0.01, 0.6, 0.6]), n, jnp.float32(2.0))
  assert sp.REASONS[int(d.reason)] == "collapse" and np.asarray(d.refresh).all()
  assert int(m.learning) == 1 and int(m.phases) == 2


def test_monitor_degradation_budget_bounds_the_refresh_share_and_fires_once_it_fits():
  """degradation_budget: a refresh fires only while the refresh seconds so far plus the last
  refresh's fit in the budget's share of the rollout seconds so far; over budget the decision
  says so and the heads keep their degraded checks, firing at the first check that fits."""
  _, free = run_monitor(MON_CFG, sustained(), 60, refresh_cost=4.0)
  cfg = MON_CFG.replace(degradation_budget=0.25)
  _, out = run_monitor(cfg, sustained(), 60, refresh_cost=4.0)
  f, f_free = fires(out), fires(free)
  assert f[0] == f_free[0] == (14, [1, 2])  # the first refresh always fits
  assert len(f) < len(f_free), (f, f_free)
  for i, (b, _) in enumerate(f):  # before each refresh: 4 s x (refreshes so far + 1) <= 0.25 b
    assert i == 0 or 4.0 * (i + 1) <= 0.25 * b, f
  reasons = [r for r, _ in out]
  assert "over_budget" in reasons and "over_budget" not in [r for r, _ in free]
  # the fire after an over-budget stretch comes at the first check the budget allows: batch 32
  # (8 s <= 0.25 x 32), a check batch, with the degraded checks kept through the wait
  assert f[1][0] == 32 and reasons[31] == "sustained_degradation"
  assert all(reasons[b - 1] == "over_budget" for b in range(22, 32, 2)), reasons[20:32]
  _, same = run_monitor(MON_CFG.replace(degradation_budget=0.0), sustained(), 60,
                        refresh_cost=4.0)
  assert fires(same) == f_free  # 0: no cap


def test_monitor_refresh_selection_degraded_takes_a_newly_degraded_head_along():
  """refresh_selection: head 1 degrades from batch 11 and fires at the check of batch 14; head 0
  degrades from batch 13, one degraded check short of patience then. "firing" refreshes head 1
  alone and leaves head 0 for after the cooldown; "degraded" takes head 0 along."""
  def shifts(b):
    return (np.array([0.2 * (b >= 13), 0.2 * (b >= 11), 0.0]),
            np.array([-0.1 * (b >= 13), -0.1 * (b >= 11), 0.0]))
  _, out = run_monitor(MON_CFG, shifts, 24)
  assert fires(out)[:2] == [(14, [1]), (20, [0, 1])]  # head 0 waits out the cooldown
  _, out = run_monitor(MON_CFG.replace(refresh_selection="degraded"), shifts, 24)
  assert fires(out)[0] == (14, [0, 1])
  with pytest.raises(ValueError, match="refresh_selection"):
    sp.SlowPathConfig(refresh_selection="worst")


@pytest.mark.parametrize("patience", [1, 3])
def test_monitor_patience(patience):
  _, out = run_monitor(MON_CFG.replace(patience=patience), sustained(), 18)
  assert fires(out)[0][0] == 12 + 2 * (patience - 1)  # checks at 12, 14, 16


def test_monitor_quiet_on_noise_and_on_a_one_batch_dip():
  _, out = run_monitor(MON_CFG, lambda b: (np.zeros(K), np.zeros(K)), 80, seed=1)
  assert not fires(out) and {r for r, _ in out} <= {"calibrating", "waiting", "healthy"}
  dip = lambda b: (np.full(K, 0.3), np.full(K, -0.3)) if b == 15 else (np.zeros(K), np.zeros(K))
  _, out = run_monitor(MON_CFG, dip, 40, seed=2)
  assert not fires(out)
  assert out[15][0] == "degraded" and out[17][0] == "healthy"  # one degraded check, then reset


def test_monitor_regret_signal_fires_when_acceptance_holds_and_regret_rises():
  """A policy that gets easier: the heads' acceptance stays, the mass they leave on the table
  rises. The TV signal needs an acceptance drop and stays quiet; the regret signal fires."""
  rises = lambda b: (np.array([0.0, 0.10, 0.0]) if b >= 11 else np.zeros(K), np.zeros(K))
  _, out = run_monitor(MON_CFG, rises, 30)
  assert not fires(out)
  _, out = run_monitor(MON_CFG.replace(signal="regret"), rises, 30)
  assert fires(out)[0] == (14, [1])
  _, out = run_monitor(MON_CFG.replace(signal="regret"), lambda b: (np.zeros(K), np.zeros(K)),
                       80, seed=1)
  assert not fires(out)  # noise alone: quiet


def test_regret_matches_numpy():
  rng = np.random.default_rng(3)
  k, c, s, kc = 3, 7, 6, 3
  ids = np.stack([np.stack([rng.permutation(50)[:s] for _ in range(c)]) for _ in range(k)])
  ids[0, 0, 4:] = -1  # unused support entries
  p = rng.random((k, c, s)) * (ids >= 0)
  p = p / p.sum(-1, keepdims=True)
  tail = rng.random((k, c)) * 0.3
  cand = np.where(rng.random((k, c, kc)) < 0.7, ids[..., rng.integers(0, s, kc)],
                  60 + np.arange(kc))
  cand[1, 2] = -1  # a record without candidates
  cand[2, 3, 1:] = -1
  rec = records_lib.empty(k, c, 4, s, kc).replace(
      support=jnp.asarray(ids, jnp.int32), p=jnp.asarray(p, jnp.float32),
      p_tail=jnp.asarray(tail, jnp.float32), candidates=jnp.asarray(cand, jnp.int32))
  got = np.asarray(records_lib.regret(rec))
  for a in range(k):
    for b in range(c):
      mass = {int(t): p[a, b, j] * (1 - tail[a, b]) for j, t in enumerate(ids[a, b]) if t >= 0}
      cs = [int(t) for t in cand[a, b] if t >= 0]
      best = sum(sorted(mass.values(), reverse=True)[:len(cs)])
      on = sum(mass.get(t, 0.0) for t in set(cs))
      np.testing.assert_allclose(got[a, b], np.clip(best - on, 0, 1), atol=1e-6)
  assert got[1, 2] == 0.0 and (got >= 0).all() and (got <= 1).all()


def test_monitor_needs_records_and_an_acceptance_drop():
  # 5 records per batch: the check at 12 has 10 < 16 records; the window grows to the next check
  m, out = run_monitor(MON_CFG, sustained(), 14, records=5)
  assert out[11][0] == "too_few_records" and out[13][0] == "degraded"
  # TV up but acceptance unchanged: never degraded
  _, out = run_monitor(MON_CFG, lambda b: (np.full(K, 0.3 * (b > 10)), np.zeros(K)), 30)
  assert not fires(out) and "degraded" not in {r for r, _ in out}


# --- refresh -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refreshed(tiny):
  """A kept refresh of heads 0 and 2 on records of a fixed target (the teacher heads)."""
  config, params, student, teacher = tiny
  state = fill(sp.init(TRAIN_CFG, student, support_size=S, num_candidates=KC),
               make_records(config, params, teacher, 0, TRAIN_CFG.per_head(K)))
  mask = jnp.array([True, False, True])
  heads, opt, res = sp.refresh_jit(REFRESH_CFG, config, params, student, state.opt_state,
                                   state.reservoir, mask, jnp.int32(2))
  return state, heads, opt, jax.device_get(res)


def test_refresh_lowers_heldout_ce_and_tv_and_is_kept_other_heads_bit_identical(tiny, refreshed):
  _, _, student, _ = tiny
  state, heads, opt, res = refreshed
  assert res.trained.tolist() == [True, False, True] and res.keep.tolist() == [True, False, True]
  assert res.before.n[0] == res.after.n[0] > 0  # the held-out records
  for k in (0, 2):
    assert res.after.ce[k] < res.before.ce[k] and res.after.tv[k] < res.before.tv[k]
    assert not leaves_equal(head_slice(heads, k), head_slice(student, k))
  assert leaves_equal(head_slice(heads, 1), head_slice(student, 1))
  assert leaves_equal(head_slice(opt, 1), head_slice(state.opt_state, 1))


def test_a_heads_refresh_does_not_depend_on_which_other_heads_refresh(tiny, refreshed):
  """Only trained heads are computed (the others skip their unembeddings and report NaN); head
  0 refreshed alone comes out as in the refresh of heads 0 and 2 (own loss, clip and optimiser
  state per head)."""
  config, params, student, _ = tiny
  state, heads, opt, res = refreshed
  alone = sp.refresh_jit(REFRESH_CFG, config, params, student, state.opt_state, state.reservoir,
                         jnp.array([True, False, False]), jnp.int32(2))
  r = jax.device_get(alone[2])
  assert r.trained.tolist() == [True, False, False] and r.keep.tolist() == [True, False, False]
  for ev in (r.before, r.after, res.before, res.after):
    assert np.isnan(ev.ce[1]) and np.isnan(ev.tv[1])
  for a, b in zip(jax.tree.leaves(head_slice(alone[0], 0)), jax.tree.leaves(head_slice(heads, 0)),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose([r.before.ce[0], r.after.ce[0]], [res.before.ce[0], res.after.ce[0]],
                             rtol=1e-6)
  assert leaves_equal(head_slice(alone[0], 2), head_slice(student, 2))
  # every head selected: head 0 agrees with it too
  every = sp.refresh_jit(REFRESH_CFG, config, params, student, state.opt_state, state.reservoir,
                         jnp.ones(K, bool), jnp.int32(2))
  e = jax.device_get(every[2])
  assert e.trained.all() and np.isfinite(e.before.ce).all() and np.isfinite(e.after.tv).all()
  np.testing.assert_allclose(e.before.ce[0], r.before.ce[0], rtol=1e-6)
  assert e.keep[0]  # equal up to float rounding; an update step moves weights by ~lr = 1e-2
  for a, b in zip(jax.tree.leaves(head_slice(every[0], 0)),
                  jax.tree.leaves(head_slice(alone[0], 0)), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_evaluate_matches_a_dense_reference_at_any_chunk_size(tiny):
  """Sparse CE (support + tail bucket), sparse TV and token CE against numpy on full-vocab
  softmaxes; chunk 48 pads 128 records to 3 chunks."""
  config, params, student, teacher = tiny
  recs = make_records(config, params, teacher, 3, 128)
  q = np.asarray(_source_logits(config, params, student, recs.hidden), np.float64)
  q = np.exp(q - q.max(-1, keepdims=True))
  q /= q.sum(-1, keepdims=True)
  sup, p, pt = np.asarray(recs.support), np.asarray(recs.p, np.float64), np.asarray(recs.p_tail)
  used = sup >= 0
  q_s = np.where(used, np.take_along_axis(q, np.maximum(sup, 0), -1), 0.0)
  ce = -(np.where(used, p * (1 - pt[..., None]) * np.log(np.maximum(q_s, 1e-300)), 0).sum(-1)
         + pt * np.log(1 - q_s.sum(-1)))
  tv = 0.5 * np.abs(p - q_s / q_s.sum(-1, keepdims=True)).sum(-1)
  tok = -np.log(np.take_along_axis(q, np.asarray(recs.token)[..., None], -1)[..., 0])
  ev = jax.jit(sp.evaluate, static_argnums=(0, 1))
  for chunk in (128, 48):
    got = ev(sp.SlowPathConfig.for_tests(chunk_size=chunk), config, params, student, recs,
             recs.valid)
    np.testing.assert_allclose(got.ce, ce.mean(1), rtol=1e-5)
    np.testing.assert_allclose(got.tv, tv.mean(1), rtol=1e-5)
    np.testing.assert_allclose(got.token_ce, tok.mean(1), rtol=1e-5)
    assert got.n.tolist() == [128] * K


def test_support_only_log_probs_are_the_head_softmax_renormalised_on_the_support(tiny):
  """refresh_vocab="support": the head's log-probs over each record's support alone equal its
  full-vocabulary softmax renormalised there (numpy), from |S| unembedding rows; the token's
  log-prob is its entry there (0 when it is off the support: no gradient), and the tail bucket
  carries no mass."""
  from specroll_jax.adaptation.slow_path import retrain as R
  config, params, student, teacher = tiny
  recs = make_records(config, params, teacher, 5, 64)
  q = np.asarray(_source_logits(config, params, student, recs.hidden), np.float64)
  q = np.exp(q - q.max(-1, keepdims=True))
  q /= q.sum(-1, keepdims=True)
  sup, tok = np.asarray(recs.support), np.asarray(recs.token)
  used = sup >= 0
  q_s = np.where(used, np.take_along_axis(q, np.maximum(sup, 0), -1), 0.0)
  want = np.where(used, np.log(np.maximum(q_s / q_s.sum(-1, keepdims=True), 1e-300)), 0.0)
  lq_s, lq_tail, lq_tok = jax.jit(functools.partial(R._log_probs, sparse=True),
                                  static_argnums=(0, 1))(TRAIN_CFG, config, params, student, recs)
  np.testing.assert_allclose(np.asarray(lq_s), want, rtol=1e-5, atol=1e-6)
  on = (sup == tok[..., None]) & used
  assert on.any(-1).mean() > 0.5  # most committed tokens are on the support, as in real records
  np.testing.assert_allclose(np.asarray(lq_tok), np.where(on, want, 0.0).sum(-1), rtol=1e-5,
                             atol=1e-6)
  assert (np.asarray(lq_tail) == R._NO_TAIL).all()  # exp(-100): no mass (and p_tail is zeroed)


def test_support_only_refresh_learns_and_its_guard_reads_the_full_vocabulary(tiny, refreshed):
  """A refresh with the support-only objective is a different run (other gradients) that still
  learns the fixed target: held-out CE and TV go down and the heads are kept. Its before/after
  evaluations are the full-vocabulary ones (``evaluate`` on the held-out slots, tail bucket
  included), so the guard judges both objectives alike; untrained heads stay bit for bit. (Head
  0 of this fixture is marginal: its TV moves by 1e-3 either way, so heads 1 and 2 train.)"""
  config, params, student, _ = tiny
  state, full_heads, _, full = refreshed
  cfg = TRAIN_CFG.replace(refresh_vocab="support").refresh_settings()
  mask = jnp.array([False, True, True])
  heads, opt, res = sp.refresh_jit(cfg, config, params, student, state.opt_state,
                                   state.reservoir, mask, jnp.int32(2))
  res = jax.device_get(res)
  assert res.trained.tolist() == [False, True, True] and res.keep.tolist() == [False, True, True]
  held = jnp.asarray(sp.holdout_slots(TRAIN_CFG, TRAIN_CFG.per_head(K)))[None] \
      & state.reservoir.valid
  ev = jax.jit(sp.evaluate, static_argnums=(0, 1))
  before = jax.device_get(ev(REFRESH_CFG, config, params, student, state.reservoir, held))
  after = jax.device_get(ev(REFRESH_CFG, config, params, heads, state.reservoir, held))
  for k in (1, 2):
    np.testing.assert_allclose([res.before.ce[k], res.before.tv[k]],
                               [before.ce[k], before.tv[k]], rtol=1e-5)
    np.testing.assert_allclose([res.after.ce[k], res.after.tv[k]], [after.ce[k], after.tv[k]],
                               rtol=1e-5)
    assert res.after.ce[k] < res.before.ce[k] and res.after.tv[k] < res.before.tv[k]
  assert not leaves_equal(head_slice(heads, 2), head_slice(full_heads, 2))  # another objective
  assert leaves_equal(head_slice(heads, 0), head_slice(student, 0))
  assert leaves_equal(head_slice(opt, 0), head_slice(state.opt_state, 0))
  # a reservoir still half empty (slots with no support ids, weight 0): finite heads, kept
  half = fill(sp.init(TRAIN_CFG, student, support_size=S, num_candidates=KC),
              make_records(config, params, tiny[3], 0, TRAIN_CFG.per_head(K) // 2))
  heads, _, res = sp.refresh_jit(cfg, config, params, student, half.opt_state, half.reservoir,
                                 mask, jnp.int32(2))
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(heads))
  assert jax.device_get(res.keep).tolist() == [False, True, True]


def test_after_evaluation_reads_only_the_held_out_slots_and_matches_evaluate(tiny, refreshed):
  config, params, _, _ = tiny
  state, heads, _, res = refreshed
  c = TRAIN_CFG.per_head(K)
  held = jnp.asarray(sp.holdout_slots(TRAIN_CFG, c))[None] & state.reservoir.valid
  ev = jax.device_get(jax.jit(sp.evaluate, static_argnums=(0, 1))(
      REFRESH_CFG, config, params, heads, state.reservoir, held))
  for k in (0, 2):  # the kept heads: what refresh returned is what it evaluated "after"
    np.testing.assert_allclose([res.after.ce[k], res.after.tv[k]], [ev.ce[k], ev.tv[k]],
                               rtol=1e-5)
    assert res.after.n[k] == ev.n[k] == held[k].sum()


@pytest.mark.slow
def test_minibatch_steps_read_only_their_group_of_chunks(tiny, refreshed):
  """step_chunks = 2 of 8 chunks (each strided over the ring): 4 groups covering every chunk
  once; one step reads group 0 alone, so replacing every training record outside it leaves the
  step's result unchanged, while a full-batch step (and a second minibatch step, group 1) does
  change."""
  config, params, student, _ = tiny
  state, _, _, _ = refreshed
  c = TRAIN_CFG.per_head(K)
  cfg = TRAIN_CFG.replace(chunk_size=16, step_chunks=2).refresh_settings()
  groups = sp.step_groups(cfg, c)
  assert groups.shape == (4, 2) and sorted(groups.ravel().tolist()) == list(range(8))
  assert sp.step_groups(cfg.replace(step_chunks=0), c) is None
  assert sp.step_groups(cfg.replace(step_chunks=8), c) is None
  held = sp.holdout_slots(TRAIN_CFG, c)
  idx, inside = retrain._chunks(cfg, c)  # strided chunks: chunk j holds slots j, j + 8, ...
  assert c == 128 and inside.all() and np.array_equal(idx, np.arange(c).reshape(16, 8).T)
  outside = ~np.isin(np.arange(c), idx[groups[0]]) & ~held
  other = make_records(config, params, student, 7, c, tv=0.3)
  swapped = fill(state, jax.tree.map(
      lambda a, b: (jnp.where(outside.reshape((1, c) + (1,) * (a.ndim - 2)), b, a)
                    if a.ndim > 1 else a), state.reservoir, other)).reservoir
  mask = jnp.ones(K, bool)

  def heads_after(config_, reservoir, steps):
    out = sp.refresh_jit(config_, config, params, student, state.opt_state, reservoir, mask,
                         jnp.int32(steps))
    return jax.device_get(out[0])

  one, one_swapped = heads_after(cfg, state.reservoir, 1), heads_after(cfg, swapped, 1)
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(one_swapped), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert not leaves_equal(one, student)  # the step did move the heads
  full = cfg.replace(step_chunks=0)
  assert not leaves_equal(heads_after(full, state.reservoir, 1), heads_after(full, swapped, 1))
  assert not leaves_equal(heads_after(cfg, state.reservoir, 2), heads_after(cfg, swapped, 2))


@pytest.mark.slow
def test_chunk_size_does_not_change_what_a_step_reads(tiny, refreshed):
  """Chunks are strided over the ring, so a minibatch step of half the records reads the same
  records (the even slots) in 8 chunks of 16 as in 2 chunks of 64: the same refresh, up to the
  order of the sums; and so does a full-batch step."""
  config, params, student, _ = tiny
  state, _, _, _ = refreshed
  mask = jnp.ones(K, bool)

  def heads_after(chunk, step_chunks):
    cfg = TRAIN_CFG.replace(chunk_size=chunk, step_chunks=step_chunks).refresh_settings()
    out = sp.refresh_jit(cfg, config, params, student, state.opt_state, state.reservoir, mask,
                         jnp.int32(2))
    return jax.device_get(out[0])

  small, large = heads_after(16, 4), heads_after(64, 1)
  for a, b in zip(jax.tree.leaves(small), jax.tree.leaves(large), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)  # Adam: lr 1e-2 per step
  assert not leaves_equal(small, student)
  assert not leaves_equal(small, heads_after(16, 0))  # the full batch is not the half
  for a, b in zip(jax.tree.leaves(heads_after(16, 0)), jax.tree.leaves(heads_after(128, 0)),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)  # Adam: lr 1e-2 per step


def test_rollback_restores_parameters_and_optimiser_state_exactly(tiny, refreshed):
  """Held-out records whose target is the heads' own distribution: any update raises held-out
  CE and TV, so every head is rolled back, to the bit."""
  config, params, _, teacher = tiny
  state, heads, opt, _ = refreshed  # a non-trivial optimiser state (moments, counts)
  c = TRAIN_CFG.per_head(K)
  train = make_records(config, params, teacher, 1, c)
  own = make_records(config, params, heads, 2, c)
  held = sp.holdout_slots(TRAIN_CFG, c)
  recs = jax.tree.map(
      lambda a, b: jnp.where(held.reshape((1, c) + (1,) * (a.ndim - 2)), b, a) if a.ndim > 1 else a,
      train, own)
  res_state = fill(state, recs)
  new_heads, new_opt, res = sp.refresh_jit(REFRESH_CFG, config, params, heads, opt,
                                           res_state.reservoir, jnp.ones(K, bool), jnp.int32(2))
  assert res.trained.all() and not res.keep.any()
  assert (res.after.ce > res.before.ce).all() and (res.after.tv > res.before.tv).all()
  assert leaves_equal(new_heads, heads) and leaves_equal(new_opt, opt)


def test_refresh_compiles_once_for_any_head_mask_and_reservoir_content(tiny, refreshed):
  config, params, _, teacher = tiny
  state, heads, opt, _ = refreshed
  before = sp.refresh_jit._cache_size()
  assert before >= 1
  for seed, mask, steps in ((5, [False, True, False], 1), (6, [True, True, True], 2)):
    res_state = fill(state, make_records(config, params, teacher, seed, 16))
    out = sp.refresh_jit(REFRESH_CFG, config, params, heads, opt, res_state.reservoir,
                         jnp.array(mask), jnp.int32(steps))
    assert np.asarray(out[2].trained).tolist() == mask
  assert sp.refresh_jit._cache_size() == before


# --- host entry and modes ----------------------------------------------------------------------


def batches(tiny, n, tv=(0.1, 0.5, 0.3), records=16):
  config, params, _, teacher = tiny
  return [make_records(config, params, teacher, 100 + i, records, tv=tv)
          for i in range(n)]


def test_mode_off_never_refreshes(tiny):
  cfg = sp.SlowPathConfig.for_tests(mode="off")
  config, params, student, _ = tiny
  state = sp.init(cfg, student, support_size=S, num_candidates=KC)
  heads, reports = student, []
  for r in batches(tiny, 4):
    state, heads, rep = sp.after_batch(cfg, state, config, params, heads, r,
                                       np.array([0.7, 0.5, 0.4]), 10.0)
    reports.append(rep)
  assert all(r.decision == "off" and not r.heads for r in reports)
  assert heads is tiny[2] and int(state.tried.sum()) == 0
  assert int(state.reservoir.valid.sum()) == 4 * 16 * K  # records still merged


@pytest.mark.parametrize("committed", [False, True])
def test_mode_every_batch_refreshes_every_batch_and_compiles_once(tiny, caplog, committed):
  """Also with a state committed to its device (as a loop that places its state holds it): the
  refresh's commit keeps the state's placement, so the next batch's monitor does not compile."""
  cfg = TRAIN_CFG.replace(mode="every_batch")
  config, params, student, _ = tiny
  state = sp.init(cfg, student, support_size=S, num_candidates=KC)
  if committed:
    state = jax.device_put(state, jax.devices()[0])
  heads, reports = student, []
  for i, r in enumerate(batches(tiny, 3)):
    if i == 1:
      n1 = sp.refresh_compiles()
      caplog.clear()
    with jax.log_compiles(i > 0):
      state, heads, rep = sp.after_batch(cfg, state, config, params, heads, r,
                                         np.array([0.7, 0.5, 0.4]), 10.0)
    reports.append(rep)
  assert all(r.decision == "every_batch" and r.heads == (0, 1, 2) for r in reports)
  assert state.tried.tolist() == [3, 3, 3]
  assert (state.kept + state.rolled_back).tolist() == [3, 3, 3]
  # batches 2 and 3 (new records, new parameters) compiled nothing at all
  assert sp.refresh_compiles() == n1
  assert not [m for m in caplog.messages if "ompil" in m], caplog.messages
  assert reports[1].compile_seconds == reports[2].compile_seconds == 0.0
  assert all(r.refresh_seconds > 0 and r.steps == 2 for r in reports)
  assert reports[0].batch == 1 and reports[0].records == (16, 16, 16)


def test_mode_scheduled_thresholds_worst_head_one_step_and_time_budget(tiny):
  cfg = TRAIN_CFG.replace(mode="scheduled", scheduled_min_records=96, scheduled_min_batches=3)
  config, params, student, _ = tiny
  state = sp.init(cfg, student, support_size=S, num_candidates=KC)
  heads, got = student, []
  # rollout time so short that the first refresh's cost exhausts the 1.5% budget, then long
  for r, secs in zip(batches(tiny, 9), [1e-6] * 6 + [1e4] * 3, strict=True):
    state, heads, rep = sp.after_batch(cfg, state, config, params, heads, r,
                                       np.array([0.7, 0.5, 0.4]), secs)
    got.append((rep.decision, list(rep.heads), rep.steps))
  # 48 records per batch: batch 2 has 96 records but only 2 batches; batch 3 fires
  assert got[0][0] == got[1][0] == "schedule_wait"
  assert got[2] == ("scheduled", [1], 1)  # head 1 has the highest TV; one step
  assert [g[0] for g in got[3:5]] == ["schedule_wait"] * 2
  assert got[5][0] == "over_budget" and not got[5][1]
  assert got[6] == ("scheduled", [1], 1)
  assert int(state.tried.sum()) == 2


def test_after_batch_degradation_end_to_end(tiny):
  """Default mode through the host entry: TV of the matured records jumps after calibration and
  stays up while acceptance drops; after patience the worst heads are refreshed."""
  cfg = TRAIN_CFG.replace(calibration_batches=4, check_every=1, patience=2, min_records=16)
  config, params, student, _ = tiny
  state = sp.init(cfg, student, support_size=S, num_candidates=KC)
  heads = student
  for i, r in enumerate(batches(tiny, 4, tv=(0.3, 0.3, 0.3)) + batches(tiny, 2, tv=(0.4, .9, .8))):
    acc = np.array([0.6, 0.6, 0.6]) - 0.2 * (i >= 4)
    state, heads, rep = sp.after_batch(cfg, state, config, params, heads, r, acc, 1.0)
  assert rep.decision == "sustained_degradation" and rep.heads == (1, 2)
  assert len(rep.ce_before) == 2 and rep.refresh_seconds > 0
  assert state.tried.tolist() == [0, 1, 1]
  assert leaves_equal(head_slice(heads, 0), head_slice(student, 0))


# --- state ---------------------------------------------------------------------------------------


def test_state_is_an_array_pytree_and_round_trips_through_orbax(tiny, refreshed, tmp_path):
  _, _, student, _ = tiny
  state, _, opt, _ = refreshed
  state = state.replace(opt_state=opt)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
  assert leaves_equal(jax.tree.map(lambda x: x, state), state)
  with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
    ckpt.save(0, state)
    like = jax.eval_shape(lambda: sp.init(TRAIN_CFG, student, support_size=S, num_candidates=KC))
    restored, _ = ckpt.restore(like=like)
  assert type(restored) is sp.SlowPathState and leaves_equal(restored, state)


def test_bad_input_raises_value_error_naming_it(tiny):
  config, params, student, _ = tiny
  with pytest.raises(ValueError, match="mode"):
    sp.SlowPathConfig(mode="sometimes")
  with pytest.raises(ValueError, match="patience must be an int >= 1"):
    sp.SlowPathConfig(patience=0)
  with pytest.raises(ValueError, match="step_chunks must be an int >= 0, got -1"):
    sp.SlowPathConfig(step_chunks=-1)
  with pytest.raises(ValueError, match="degradation_budget"):
    sp.SlowPathConfig(degradation_budget=-0.1)
  with pytest.raises(ValueError, match="degradation_budget"):
    sp.SlowPathConfig(degradation_budget=float("nan"))
  with pytest.raises(ValueError, match="signal must be one of"):
    sp.SlowPathConfig(signal="kl")
  with pytest.raises(ValueError, match="refresh_vocab must be one of .* got 'top'"):
    sp.SlowPathConfig(refresh_vocab="top")
  with pytest.raises(ValueError, match="reservoir_size"):
    sp.init(sp.SlowPathConfig(reservoir_size=12), student, support_size=S, num_candidates=KC)
  state = sp.init(MON_CFG, student, support_size=S, num_candidates=KC)
  rec = batches(tiny, 1)[0]
  with pytest.raises(ValueError, match="head_acceptance must have shape"):
    sp.after_batch(MON_CFG, state, config, params, student, rec, np.ones(2), 1.0)
  with pytest.raises(ValueError, match="rollout_seconds"):
    sp.after_batch(MON_CFG, state, config, params, student, rec, np.ones(K), -1.0)
  with pytest.raises(ValueError, match="batch_records.support"):
    sp.after_batch(MON_CFG, state, config, params, student,
                   records_lib.empty(K, 4, config.hidden_size, S + 1, KC), np.ones(K), 1.0)


def test_compiled_refresh_cache_is_bounded_lru(monkeypatch):
  """The process-wide cache of compiled refresh programs keeps at most CACHE_SIZE programs (least
  recently used dropped first) and still counts every compile."""
  from specroll_jax.adaptation.slow_path import retrain as R

  class _Lowered:
    def __init__(self, key):
      self.key = key

    def compile(self):
      return ("program", self.key)

  class _FakeJit:
    def lower(self, cfg, model_config, *args):
      return _Lowered(cfg.learning_rate)

  monkeypatch.setattr(R, "refresh_jit", _FakeJit())
  monkeypatch.setattr(R, "_COMPILED", type(R._COMPILED)())
  monkeypatch.setattr(R, "_NUM_COMPILES", 0)
  args = (jnp.zeros((2,)),)
  cfgs = [sp.SlowPathConfig(learning_rate=1e-3 * (i + 1)) for i in range(R.CACHE_SIZE + 3)]
  for c in cfgs:
    prog, seconds = R._compiled_refresh(c, None, args)
    assert prog == ("program", c.learning_rate) and seconds >= 0
  assert len(R._COMPILED) == R.CACHE_SIZE and sp.refresh_compiles() == len(cfgs)
  _, seconds = R._compiled_refresh(cfgs[-1], None, args)  # recent: a hit
  assert seconds == 0.0 and sp.refresh_compiles() == len(cfgs)
  R._compiled_refresh(cfgs[0], None, args)  # evicted long ago: compiled again
  assert sp.refresh_compiles() == len(cfgs) + 1 and len(R._COMPILED) == R.CACHE_SIZE


def test_small_model_preset_is_the_replay_tuned_settings():
  """``for_small_models``: ``for_tests``' windows with the drift replay's tuned settings, which
  are also ``bench_adaptation.py``'s flag defaults; keywords override."""
  from conftest import load_script
  c = sp.SlowPathConfig.for_small_models()
  t = sp.SlowPathConfig.for_tests()
  assert (c.learning_rate, c.reservoir_size, c.refresh_steps, c.check_every, c.z_threshold,
          c.calibration_batches, c.chunk_size, c.step_chunks, c.refresh_selection,
          c.refresh_vocab) == (1e-3, 4608, 10, 1, 0.5, 6, 384, 2, "degraded", "support")
  assert c.degradation_budget == 0.0  # no cap: on the CPU replay a cap halved the recovery
  assert sp.step_groups(c, c.per_head(3)).shape == (2, 2)  # half of the 4 chunks per step
  assert (c.min_records, c.cooldown_batches) == (t.min_records, t.cooldown_batches)
  assert sp.SlowPathConfig.for_small_models(mode="off", refresh_steps=3).refresh_steps == 3
  a = load_script("bench_adaptation.py").parse([])
  assert (a.slow_lr, a.slow_reservoir, a.slow_steps, a.slow_check_every, a.slow_z,
          a.calibration, a.slow_budget, a.slow_chunk_size, a.slow_step_chunks, a.slow_selection,
          a.slow_refresh_budget, a.slow_refresh_vocab) == (
              c.learning_rate, c.reservoir_size, c.refresh_steps, c.check_every, c.z_threshold,
              c.calibration_batches, c.time_budget, c.chunk_size, c.step_chunks,
              c.refresh_selection, c.degradation_budget, c.refresh_vocab)


def test_main_job_slow_path_settings(tmp_path):
  """The main job's slow path: ``SlowPathConfig.for_model``'s small-model preset on the embedded
  model (a bootstrap fit first), the library's defaults with --model (a real model's heads);
  the records drawn per batch from the rollout reach ``SpecRoll``."""
  from conftest import load_script
  mod = load_script("gsm8k.py")
  cfg = mod.run_config(mod.parse(["--records-per-batch", "64"]), rollout_kind="specroll")
  learn = dict(bootstrap_batches=2, bootstrap_steps=20, learn_gain=0.01, learn_budget=0.05,
               collapse_acceptance=0.02, tv_weight=1.0)
  assert cfg.slow == sp.SlowPathConfig.for_small_models(**learn)
  assert cfg.records_per_batch == 64
  cfg = mod.run_config(mod.parse(["--model", str(tmp_path)]), rollout_kind="specroll")
  assert cfg.slow == sp.SlowPathConfig(**learn)
  cfg = mod.run_config(mod.parse(["--model", str(tmp_path), "--slow-refresh-vocab", "support",
                                  "--slow-bootstrap", "0"]), rollout_kind="specroll")
  assert cfg.slow == sp.SlowPathConfig(refresh_vocab="support", **{**learn,
                                                                     "bootstrap_batches": 0})
