"""Slow-path records from the trainer's forward (``trainer_records``): every field checked against
an independent computation (the whole-path head apply, the full-vocabulary target softmax), the
GRPO step hands out its own forward's hidden states without changing the update, and the slow
path takes such records between batches (``slow_path.after_batch``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from specroll_jax import grpo, rollout
from specroll_jax.adaptation import slow_path as SP
from specroll_jax.adaptation import trainer_records as TR
from specroll_jax.adaptation.reflex import ReflexConfig
from specroll_jax.heads import conditioned as CH
from specroll_jax.models import decoder as _dec
from specroll_jax.sampling import SamplingConfig, allowed_logits

M, N = 24, 48
SAMPLING = SamplingConfig(temperature=1.0)
CFG = ReflexConfig(conditioned=True)


@pytest.fixture(scope="module")
def batch(trained_model, gsm8k_prompts):
  """Eight finished responses (some ended by EOS), their anchor hidden states, random heads."""
  config, params, tok = trained_model
  arr, plens = rollout.pad_prompts(gsm8k_prompts[:8])
  out = rollout.generate(config, params, arr, prompt_lengths=plens, sampling=SAMPLING, seed=5,
                         max_new_tokens=M, eos_ids=tok.eos_ids, sample_ids=np.arange(8))
  heads = CH.init(jax.random.key(2), config, 3)
  heads = heads.replace(w_o=0.05 * jax.random.normal(jax.random.key(3), heads.w_o.shape))
  hid = grpo.trainer_hidden(config, params, jnp.asarray(arr), jnp.asarray(plens), out.tokens,
                            out.lengths)
  return arr, np.asarray(plens), np.asarray(out.tokens), np.asarray(out.lengths), hid, heads


@pytest.mark.parametrize("sampling", [SAMPLING, SamplingConfig(temperature=0.8, top_k=6)],
                         ids=["plain", "top-k"])
def test_records_match_an_independent_computation(trained_model, batch, sampling):
  """Under a top-k restriction the target's p is the restricted softmax: the head's top ids and
  the top-16 support outside the 6 allowed tokens have p 0, and the tail is what S misses of
  the allowed mass."""
  config, params, _ = trained_model
  arr, plens, toks, lens, hid, heads = batch
  key = jax.random.key(7)
  rec = TR.from_hidden(CFG, config, params, heads, hid, toks, lens, plens, sampling=sampling,
                       key=key, num_anchors=N)
  assert rec.hidden.shape == (3, N, config.hidden_size)
  assert rec.support.shape == (3, N, CFG.support_size)
  assert rec.candidates.shape == (3, N, CFG.max_candidates) and rec.path.shape == (3, N, 3)
  rows, cols, found = map(np.asarray, TR.sample_anchors(key, jnp.asarray(lens), M, N))
  assert found.all() and len(set(zip(rows, cols, strict=True))) == N  # distinct anchors
  assert (cols + 1 < lens[rows]).all()
  hid = np.asarray(hid)
  # independent: each head along its own committed path (head i from the anchor i columns back,
  # all predicting token cols + 1), the target's full softmax at that token
  anc = cols[:, None] - np.arange(3)  # [N, K]
  ctx = [toks[rows[:, None], np.clip(anc[:, i:i + 1] + np.arange(3), 0, M - 1)] for i in range(3)]
  q_all = np.stack([np.asarray(CH.apply(config, params, heads,
                                        jnp.asarray(hid[rows, np.maximum(anc[:, i], 0)]),
                                        jnp.asarray(ctx[i])))[:, i] for i in range(3)], 1)
  lab = cols + 1
  p_all = np.asarray(jax.nn.softmax(allowed_logits(_dec.logits_from_hidden(
      config, params, jnp.asarray(hid[rows, lab])), sampling), axis=-1))  # [N, V]
  q_all = q_all / sampling.temperature  # the heads' logits, tempered like the records' p
  valid = np.asarray(rec.valid)
  np.testing.assert_array_equal(np.asarray(rec.count), valid.sum(1))  # what the monitor counts
  checked = 0
  for i in range(3):
    np.testing.assert_array_equal(valid[i], anc[:, i] >= 0)
    np.testing.assert_array_equal(np.asarray(rec.token[i]), toks[rows, lab])
    np.testing.assert_array_equal(np.asarray(rec.position[i]), plens[rows] + lab)
    np.testing.assert_allclose(np.asarray(rec.hidden[i])[valid[i]],
                               hid[rows, anc[:, i]][valid[i]], atol=1e-6)
    path = np.asarray(rec.path[i])
    np.testing.assert_array_equal(path[valid[i], : i + 1], ctx[i][valid[i], : i + 1])
    assert (path[:, i + 1:] == -1).all()
    for n in np.flatnonzero(valid[i]):
      s = np.asarray(rec.support[i, n])
      used = s >= 0
      ids = s[used]
      assert len(set(ids.tolist())) == len(ids)
      p, q = p_all[n], q_all[n, i]
      top_p = np.argsort(-p)[:4]
      assert set(top_p.tolist()) <= set(ids.tolist())  # the target's top ids are on it
      assert int(rec.token[i, n]) in ids
      cand = np.asarray(rec.candidates[i, n])
      np.testing.assert_array_equal(cand[: CFG.topk[i]], np.argsort(-q)[: CFG.topk[i]])
      assert (cand[CFG.topk[i]:] == -1).all()
      assert bool(rec.hit[i, n]) == (int(rec.token[i, n]) in cand[: CFG.topk[i]])
      ps = p[ids] / p[ids].sum()
      np.testing.assert_allclose(np.asarray(rec.p[i, n])[used], ps, atol=2e-5)
      np.testing.assert_allclose(float(rec.p_tail[i, n]), 1.0 - p[ids].sum(), atol=2e-5)
      qs = np.exp(q[ids] - q[ids].max())
      qs /= qs.sum()
      np.testing.assert_allclose(float(rec.tv[i, n]), 0.5 * np.abs(ps - qs).sum(), atol=2e-5)
      if sampling.top_k:
        assert (p > 0).sum() == sampling.top_k and (np.asarray(rec.p[i, n])[used] == 0).any()
      checked += 1
  assert checked > 2 * N  # most anchors predict three committed tokens
  assert not np.asarray(rec.correction).any()


def test_every_draw_taken_gives_each_head_every_committed_prediction_once(trained_model, batch):
  """Heads share the predicted token of a draw and read anchors k columns back: with every
  draw taken, head k has one record per anchor whose prediction (k + 1 tokens on) was
  committed, as if it had drawn its own anchors."""
  config, params, _ = trained_model
  arr, plens, toks, lens, hid, heads = batch
  rec = TR.from_hidden(CFG, config, params, heads, hid, toks, lens, plens, sampling=SAMPLING,
                       key=jax.random.key(3), num_anchors=8 * M)
  hid = np.asarray(hid)
  for k in range(3):
    v = np.asarray(rec.valid[k])
    want = {(r, a) for r in range(8) for a in range(M) if a + k + 1 < lens[r]}
    # the anchor of each valid record, found back from its hidden state (rows' states differ)
    got = [tuple(np.argwhere((hid == h).all(-1))[0]) for h in np.asarray(rec.hidden[k])[v]]
    assert len(got) == len(want) and set(got) == want
    assert int(rec.count[k]) == len(want)


def test_from_rollout_is_from_hidden_after_the_trainer_forward(trained_model, batch):
  config, params, _ = trained_model
  arr, plens, toks, lens, hid, heads = batch
  kw = dict(sampling=SAMPLING, key=jax.random.key(1), num_anchors=16)
  a = TR.from_rollout(CFG, config, params, heads, arr, plens, toks, lens, **kw)
  b = TR.from_hidden(CFG, config, params, heads, hid, toks, lens, plens, **kw)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def test_fewer_anchors_than_asked_are_marked_not_found():
  lens = jnp.asarray([3, 1])  # row 0: anchors 0, 1; row 1: none
  rows, cols, found = map(np.asarray, TR.sample_anchors(jax.random.key(0), lens, 4, 5))
  assert found.sum() == 2
  assert sorted(zip(rows[found], cols[found], strict=True)) == [(0, 0), (0, 1)]
  # more than B x M asked: the same draw, padded with in-range rows and columns marked not found
  r2, c2, f2 = map(np.asarray, TR.sample_anchors(jax.random.key(0), lens, 4, 11))
  assert f2.sum() == 2 and (r2 < 2).all() and (c2 < 4).all()
  assert sorted(zip(r2[f2], c2[f2], strict=True)) == [(0, 0), (0, 1)]


def test_more_anchors_than_the_batch_holds_pad_with_invalid_records(trained_model, batch):
  """The records' shape is fixed by num_anchors: a batch with fewer anchors gives every one of
  them (the records of asking exactly B x M) and invalid records after them."""
  config, params, _ = trained_model
  arr, plens, toks, lens, hid, heads = batch
  sl = (slice(0, 2), slice(0, 4))  # B x M = 8
  kw = dict(sampling=SAMPLING, key=jax.random.key(4))
  args = (CFG, config, params, heads, hid[sl], toks[sl], np.minimum(lens[:2], 4), plens[:2])
  exact = TR.from_hidden(*args, num_anchors=8, **kw)
  more = TR.from_hidden(*args, num_anchors=11, **kw)
  assert more.valid.shape == (3, 11)
  assert not np.asarray(more.valid[:, 8:]).any()
  np.testing.assert_array_equal(np.asarray(more.count), np.asarray(exact.count))
  for x, y in zip(jax.tree.leaves(exact), jax.tree.leaves(more), strict=True):
    if x.ndim >= 2:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y)[:, :8])


@pytest.mark.parametrize("kw, match", [
    ({"num_anchors": 0}, "num_anchors must be an int >= 1"),
    ({"num_anchors": 2.5}, "num_anchors must be an int >= 1"),
    ({"lengths": np.ones(3, np.int32)}, "lengths has shape"),
    ({"lengths": np.full(8, M + 1, np.int32)}, r"lengths must lie in \[0, M=24\]"),
])
def test_bad_input(trained_model, batch, kw, match):
  config, params, _ = trained_model
  arr, plens, toks, lens, hid, heads = batch
  args = dict(tokens=toks, lengths=lens, prompt_lengths=plens, num_anchors=8)
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    TR.from_hidden(CFG, config, params, heads, hid, sampling=SAMPLING, key=jax.random.key(0),
                   **args)


@pytest.mark.slow
def test_train_step_hands_out_its_forward_without_changing_the_update(trained_model, batch):
  config, params, _ = trained_model
  arr, plens, toks, lens, hid, _ = batch
  ro = rollout.generate(config, params, arr, prompt_lengths=plens, sampling=SAMPLING, seed=5,
                        max_new_tokens=M, eos_ids=trained_model[2].eos_ids,
                        sample_ids=np.arange(8))
  rewards = np.arange(8, dtype=np.float32) % 3
  b = grpo.Batch.from_rollout(arr, plens, ro, rewards)
  cfg = grpo.GRPOConfig(group_size=4, learning_rate=1e-3, micro_batches=2, sampling=SAMPLING)
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  st0, m0 = grpo.make_train_step(config, cfg, mesh=mesh)(grpo.init_train_state(params, cfg), b)
  st1, m1, h1 = grpo.make_train_step(config, cfg, mesh=mesh, return_hidden=True)(
      grpo.init_train_state(params, cfg), b)
  np.testing.assert_allclose(np.asarray(h1), np.asarray(hid), atol=1e-5)
  for x, y in zip(jax.tree.leaves(st0.params), jax.tree.leaves(st1.params), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-7)
  np.testing.assert_allclose(float(m0.loss), float(m1.loss), rtol=1e-6)
  moved = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
              for x, y in zip(jax.tree.leaves(st1.params), jax.tree.leaves(params), strict=True))
  assert moved > 1e-4  # the update happened
  with pytest.raises(ValueError, match="return_hidden must be a bool"):
    grpo.make_train_step(config, cfg, mesh=mesh, return_hidden=1)


@pytest.mark.slow  # a refresh compiles
def test_slow_path_takes_trainer_records(trained_model, batch):
  """Records from the trainer's forward (``from_hidden``) go into the slow path as a rollout's
  do: merged into the reservoir (every valid one), the acceptance passed through as given (NaN:
  unknown), and the every-batch refresh trains every head on them."""
  config, params, _ = trained_model
  arr, plens, toks, lens, hid, heads = batch
  slow = SP.SlowPathConfig.for_tests(mode="every_batch", learning_rate=3e-3, guard=False)
  state = SP.init(slow, heads, support_size=CFG.support_size, num_candidates=CFG.max_candidates)
  rec = TR.from_hidden(CFG, config, params, heads, hid, toks, lens, plens, sampling=SAMPLING,
                       key=jax.random.key(0), num_anchors=N)
  acc = jnp.asarray([0.6, 0.3, np.nan], jnp.float32)
  new, new_heads, rep = SP.after_batch(slow, state, config, params, heads, rec, acc, 0.5)
  np.testing.assert_array_equal(np.asarray(new.reservoir.count), np.asarray(rec.valid).sum(1))
  assert rep.records == tuple(int(x) for x in np.asarray(rec.valid).sum(1))
  assert rep.heads == (0, 1, 2) and rep.decision == "every_batch" and rep.refresh_seconds > 0
  np.testing.assert_array_equal(rep.acceptance, np.asarray(acc))  # NaN == NaN
  changed = float(np.abs(np.asarray(new_heads.w_o) - np.asarray(heads.w_o)).max())
  assert changed > 1e-4  # refreshed on the trainer's records
  with pytest.raises(ValueError, match=r"head_acceptance must have shape \(3,\)"):
    SP.after_batch(slow, state, config, params, heads, rec, acc[:2], 0.5)
  with pytest.raises(ValueError,
                     match="batch_records must be a specroll_jax.adaptation.records.Records"):
    SP.after_batch(slow, state, config, params, heads, {}, acc, 0.5)
