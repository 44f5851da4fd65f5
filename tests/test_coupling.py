"""Drafts coupled to the target's noise (docs/design.md, "Drafts coupled to the noise"): the
first coupled candidate of a drafter whose logits are the target's is the target's own sample
(jnp sampler and the fused Pallas kernel alike); with a nearby drafter the match rate reaches the
Gumbel-coupling bound that independent drafts miss; the top-k is a draw without replacement from
the drafter's distribution; ranked and Medusa trees rank by it and keep exactness; the teacher-
forced draft quality agrees with ``cond_heads.hit_rates``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from app import draft_quality
from pallas_kernels import fused_sampler as fs
from specroll_jax import rollout, sampling
from specroll_jax.heads import conditioned as CH
from specroll_jax.proposers import HeadsProposer, ProposeInput, RankedHeads, Target, tree
from specroll_jax.sampling import SamplingConfig

CFGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7),
        SamplingConfig(temperature=1.0, top_k=5), SamplingConfig(temperature=0.8, top_p=0.7)]


def _positions(n):
  return jnp.arange(n, dtype=jnp.int32) % 37 + 11


@pytest.mark.parametrize("cfg", CFGS + [SamplingConfig(temperature=0.0)])
def test_first_coupled_key_is_the_targets_sample(cfg):
  """A drafter with the target's own logits proposes, as its first candidate, exactly the token
  the target samples at that position (every row, every rule)."""
  rng = np.random.default_rng(0)
  r, v = 512, 97
  logits = jnp.asarray(rng.normal(size=(r, v)) * 2.0, jnp.float32)
  sids, pos = jnp.arange(r, dtype=jnp.int32) * 3 + 1, _positions(r)
  keys, lq = sampling.draft_keys(logits, cfg, 77, sids, pos, coupled=True)
  tok, _, _ = sampling.sample(logits, 77, sids, pos, cfg)
  np.testing.assert_array_equal(np.asarray(jnp.argmax(keys, -1)), np.asarray(tok))
  # log q is the sampler's distribution: softmax of the allowed logits
  np.testing.assert_allclose(np.asarray(jnp.exp(lq)), np.asarray(jax.nn.softmax(
      sampling.allowed_logits(logits, cfg), -1)), atol=1e-6)
  excluded = np.asarray(sampling.allowed_logits(logits, cfg)) <= -1e29
  assert (np.asarray(keys)[excluded] == -np.inf).all()
  if cfg.greedy:  # no noise: the logits themselves
    np.testing.assert_array_equal(np.asarray(keys), np.asarray(logits))


def test_uncoupled_keys_are_the_heads_probabilities():
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 9)), jnp.float32)
  keys, lq = sampling.draft_keys(logits, CFGS[1], 0, jnp.arange(4), jnp.arange(4), coupled=False)
  np.testing.assert_allclose(np.asarray(keys), np.asarray(jax.nn.log_softmax(logits, -1)),
                             atol=1e-6)
  np.testing.assert_array_equal(np.asarray(keys), np.asarray(lq))


@pytest.mark.parametrize("backend", ["triton", "tpu"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_kernel_draws_the_noise_the_drafter_couples_to(backend, temperature):
  """The GPU/TPU sampling kernel (interpret mode) samples the token a coupled drafter with the
  same logits ranks first: both paths compute the same noise."""
  rng = np.random.default_rng(2)
  r, d, v = 16, 64, 512
  hidden = jnp.asarray(rng.normal(size=(r, d)), jnp.float32)
  unembed = jnp.asarray(rng.normal(size=(d, v)) * 0.3, jnp.float32)
  sids, pos = jnp.asarray(rng.integers(0, 10_000, r), jnp.int32), _positions(r)
  bs = fs.BlockSizes(block_v=128 if backend == "triton" else 128,
                     block_d=64 if backend == "triton" else None, num_splits=1)
  tok, _ = fs.fused_sample(hidden, unembed, 5, sids, pos, temperature=temperature,
                           block_sizes=bs, backend=backend, interpret=True)
  logits = jnp.dot(hidden, unembed, precision=jax.lax.Precision.HIGHEST)
  keys, _ = sampling.draft_keys(logits, SamplingConfig(temperature=temperature), 5, sids, pos,
                                coupled=True)
  np.testing.assert_array_equal(np.asarray(tok), np.asarray(jnp.argmax(keys, -1)))


def test_match_rate_reaches_the_coupling_bound():
  """A drafter q near the target p (TV 0.2) coupled to the target's noise matches its sample at
  least (1 - TV) / (1 + TV) of the time; drafted with other noise (independently) it matches at
  sum_v p_v q_v, far below."""
  p = np.array([0.35, 0.25, 0.15, 0.1, 0.08, 0.07])
  q = np.array([0.2, 0.3, 0.25, 0.05, 0.1, 0.1])
  tv = 0.5 * np.abs(p - q).sum()
  n = 20_000
  sids, pos = jnp.arange(n, dtype=jnp.int32), jnp.full((n,), 9, jnp.int32)
  cfg = SamplingConfig(temperature=1.0)
  lp = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, 6))
  lq = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (n, 6))
  target = np.asarray(sampling.sample(lp, 3, sids, pos, cfg)[0])
  coupled = np.asarray(jnp.argmax(sampling.draft_keys(lq, cfg, 3, sids, pos, coupled=True)[0], -1))
  other = np.asarray(jnp.argmax(sampling.draft_keys(lq, cfg, 4, sids, pos, coupled=True)[0], -1))
  bound = (1 - tv) / (1 + tv)
  assert (coupled == target).mean() >= bound, ((coupled == target).mean(), bound)
  assert abs((other == target).mean() - (p * q).sum()) < 0.02
  assert (coupled == target).mean() > (other == target).mean() + 0.3
  # each draft alone is a sample of q (rank 0) ...
  freq = np.bincount(coupled, minlength=6) / n
  np.testing.assert_allclose(freq, q, atol=0.015)
  # ... and the top-3 a draw without replacement: distinct ids, rank 1 given rank 0 ~ q renormed
  top3 = np.asarray(jax.lax.top_k(sampling.draft_keys(lq, cfg, 3, sids, pos, coupled=True)[0],
                                  3)[1])
  assert (top3[:, 0] != top3[:, 1]).all() and (top3[:, 1] != top3[:, 2]).all()
  first0 = top3[:, 0] == 0
  cond = np.bincount(top3[first0, 1], minlength=6)[1:] / first0.sum()
  np.testing.assert_allclose(cond, q[1:] / q[1:].sum(), atol=0.03)


def test_plan_ranks_candidates_by_keys():
  """``tree.plan`` with keys takes each depth's candidates from the keys (trunk: their argmax)
  while the scores stay the log-probabilities."""
  rng = np.random.default_rng(3)
  lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(2, 2, 11)), jnp.float32), -1)
  keys = jnp.asarray(rng.normal(size=(2, 2, 11)), jnp.float32)
  tr = tree.plan(jnp.array([1, 2]), lp, jnp.array([4, 4]), num_nodes=4, topk=(3, 2), keys=keys)
  top = np.asarray(jax.lax.top_k(keys, 3)[1])
  for r in range(2):
    d1 = np.asarray(tr.tokens[r])[np.asarray(tr.depth[r]) == 1]
    assert set(d1.tolist()) <= set(top[r, 0].tolist()) and top[r, 0, 0] in d1
    trunk = np.asarray(tr.tokens[r])[np.asarray(tr.depth[r]) == 2]
    assert top[r, 1, 0] in trunk


def _inp(r, d, seed=True):
  rng = np.random.default_rng(4)
  return ProposeInput(hidden=jnp.asarray(rng.normal(size=(r, d)), jnp.float32),
                      root=jnp.arange(r, dtype=jnp.int32) + 3, position=jnp.full((r,), 20),
                      history=jnp.zeros((r, 32), jnp.int32), budget=jnp.full((r,), 6),
                      row=jnp.arange(r), sample_ids=jnp.arange(r) + 40,
                      seed=jnp.full((r,), 9, jnp.uint32) if seed else None)


@pytest.mark.parametrize("kind", ["cond", "medusa"])
def test_heads_candidates_are_the_coupled_draws(random_model, kind):
  """Depth 1 of a coupled ranked / Medusa tree holds the heads' first coupled candidates at the
  root's next position; without the seed a coupled proposer refuses the input by name."""
  from specroll_jax.heads import medusa as H
  from specroll_jax.models import logits_from_hidden
  config, params = random_model
  cfg = SamplingConfig(temperature=1.0)
  target = Target(config=config, params=params, sampling=cfg)
  r = 3
  inp = _inp(r, config.hidden_size)
  if kind == "cond":
    hd = CH.init(jax.random.key(0), config, 3, width=32)
    hd = hd.replace(w_o=jax.random.normal(jax.random.key(1), hd.w_o.shape) * 0.1)
    prop = RankedHeads(topk=(4, 3, 2), max_nodes=6)
    pp = prop.params(hd)
    state = prop.init(target, pp, _rows(r))
    z = CH.head_state(config, params, hd, 1, inp.hidden, inp.root[:, None])
    name = "RankedHeads"
  else:
    hd = H.init(jax.random.key(0), config, 3, scale=0.1)
    prop, pp, state = HeadsProposer(num_heads=3, topk=(4, 3, 2)), hd, ()
    z = H.head_states(config, hd, inp.hidden)[:, 0]
    name = "HeadsProposer"
  keys, _ = sampling.draft_keys(logits_from_hidden(config, params, z), cfg, 9, inp.sample_ids,
                                inp.position + 1, coupled=True)
  want = np.asarray(jax.lax.top_k(keys, 4)[1])
  tr, _ = prop.propose(target, pp, state, inp, num_nodes=6)
  for i in range(r):
    d1 = np.asarray(tr.tokens[i])[np.asarray(tr.valid[i]) & (np.asarray(tr.depth[i]) == 1)]
    assert want[i, 0] in d1 and set(d1.tolist()) <= set(want[i].tolist()), (i, d1, want[i])
  if kind == "cond":  # every depth-1 candidate is one of the four draws
    cands, _ = prop.candidates(target, pp, (), inp, num_nodes=6)
    d1 = np.asarray(cands.paths[:, :, 0])[np.asarray(cands.depth) == 1].reshape(r, -1)
    np.testing.assert_array_equal(np.sort(d1, -1), np.sort(want, -1))
  with pytest.raises(ValueError, match=f"{name}\\(coupled=True\\) needs ProposeInput.seed"):
    prop.propose(target, pp, state, _inp(r, config.hidden_size, seed=False), num_nodes=6)


def _rows(r):
  from specroll_jax.proposers import RowsInit
  z = jnp.zeros((r,), jnp.int32)
  return RowsInit(prompt_tokens=jnp.zeros((r, 4), jnp.int32), prompt_lengths=z + 4,
                  sample_ids=z, row=jnp.arange(r), first_token=z, hidden=jnp.zeros((r, 8)))


def test_depth_hits_agree_with_hit_rates(trained_model, gsm8k_prompts):
  """Uncoupled, head 1's teacher-forced hits are ``cond_heads.hit_rates``'; coupled at T = 0 they
  are the uncoupled ones; hits grow with the candidates and the chain's tau stays within
  [1, 1 + K]; a row count that does not match is refused by name."""
  config, params, tok = trained_model
  cfg = SamplingConfig(temperature=1.0)
  rows = [p for p in gsm8k_prompts[:4] for _ in range(4)]
  padded, plens = rollout.pad_prompts(rows)
  sids = np.arange(len(rows)) + 100
  r = rollout.generate(config, params, padded, prompt_lengths=plens, sampling=cfg,
                       max_new_tokens=32, seed=5, sample_ids=sids, eos_ids=tok.eos_ids,
                       options=rollout.DecodeOptions(return_hidden=True))
  hd = CH.init(jax.random.key(0), config, 3, width=32)
  hd = hd.replace(w_o=jax.random.normal(jax.random.key(1), hd.w_o.shape) * 0.05)
  args = (config, params, hd, r.tokens, r.lengths, r.hidden, plens, sids, 5)
  det = draft_quality.depth_hits(*args, sampling=cfg, coupled=False)
  ref = CH.hit_rates(config, params, hd, r.tokens, r.lengths, r.hidden, sampling=cfg, ks=(1, 4))
  assert det.hit[0][0] == pytest.approx(ref.at(1)[0]) and det.hit[0][3] == pytest.approx(
      ref.at(4)[0])
  assert all(np.all(np.diff(h) >= 0) for h in det.hit)  # more candidates, more hits
  assert det.tested[0, 0].sum() == det.anchors  # every anchor has a depth-1 label
  greedy = SamplingConfig(temperature=0.0)
  g_det = draft_quality.depth_hits(*args, sampling=greedy, coupled=False)
  g_cpl = draft_quality.depth_hits(*args, sampling=greedy, coupled=True)
  assert g_det.hit == g_cpl.hit and g_det.chain_tau == g_cpl.chain_tau
  assert 1.0 <= det.chain_tau[0] <= det.chain_tau[-1] <= 1.0 + hd.num_heads
  cpl = draft_quality.depth_hits(*args, sampling=cfg, coupled=True)
  assert cpl.anchors == det.anchors and cpl.to_dict()["coupled"] is True
  with pytest.raises(ValueError, match="sample_ids has shape"):
    draft_quality.depth_hits(*args[:7], sids[:3], 5, sampling=cfg, coupled=True)


def test_specroll_couples_at_t_above_zero_only(random_model):
  """The object ranks coupled by default (its heads' tree and Reflex alike) and turns coupling off
  at T = 0, where there is no noise to couple to; ``coupled=False`` is the setting that turns it
  off for comparison."""
  from specroll_jax import SpecRoll
  config, _ = random_model
  sr = SpecRoll(config, max_new_tokens=8, sampling=SamplingConfig(temperature=1.0))
  assert sr.heads_tree.coupled and sr.reflex.coupled and sr.merged.heads.coupled
  greedy = SpecRoll(config, max_new_tokens=8, sampling=SamplingConfig(temperature=0.0))
  assert not greedy.heads_tree.coupled and not greedy.reflex.coupled
  off = SpecRoll(config, max_new_tokens=8, heads_tree=RankedHeads(coupled=False))
  assert not off.reflex.coupled and off.heads_tree.num_bins == 3 * 12
  assert sr.heads_tree.num_bins == 3 * 4 * 12  # (depth, rank, q bin)
