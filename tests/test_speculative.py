"""Speculative engine == vanilla engine, token for token; verify forward == path forward; tau."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LONG

from specroll_jax import models, rollout, sampling
from specroll_jax.engines import verify
from specroll_jax.heads import medusa as H
from specroll_jax.proposers import HeadsProposer, RankedHeads, tree
from specroll_jax.rollout import DecodeOptions, SamplingConfig, SpecConfig, Speculation


def _assert_same(ref, got):
  np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), atol=1e-5)


def assert_stats_invariants(got, shapes):
  """Counters that must hold for every speculative rollout; ``shapes`` are its (rows, N) buckets."""
  st, sp = got.stats, got.stats.spec
  b = got.tokens.shape[0]
  fwd = int(st.target_forwards)
  trace = np.asarray(sp.active_trace)
  assert (trace[fwd:] == 0).all() and (trace[:fwd] > 0).all()
  assert int(st.row_forwards) == b + int(trace.sum())
  assert int(st.tokens) == int(np.asarray(got.lengths).sum())
  proposed, accepted = np.asarray(sp.depth_proposed), np.asarray(sp.depth_accepted)
  assert (accepted <= proposed).all() and (np.diff(proposed) <= 0).all()
  per_bucket = np.asarray(sp.bucket_forwards)
  assert per_bucket.sum() == fwd
  n_of_forward = np.repeat([n for _, n in shapes], per_bucket)  # buckets run in order
  assert int(sp.nodes_verified) <= int((trace[:fwd] * n_of_forward).sum())
  # a row-step commits at most depth + 1 tokens
  assert int(st.tokens) - b <= int(trace.sum()) + int(accepted.sum())


@pytest.fixture(scope="module")
def fitted_heads(trained_model, gsm8k_prompts):
  """Heads fitted by self-distillation on greedy and T=0.7 rollouts of train-like prompts."""
  config, params, _ = trained_model
  cfg = SamplingConfig(temperature=0.0)
  r = rollout.generate(config, params, gsm8k_prompts, sampling=cfg, max_new_tokens=96, seed=11,
                       sample_ids=np.arange(1000, 1016),
                       options=DecodeOptions(return_hidden=True))
  heads = H.init(jax.random.key(0), config, 3)
  heads, _ = H.fit_heads(config, params, heads, r.tokens, r.lengths, r.hidden, steps=200,
                         progress=False)
  return heads


@pytest.fixture(scope="module")
def random_heads(trained_model):
  return H.init(jax.random.key(5), trained_model[0], 3, scale=0.05)


CASES = [  # (sampling, spec, which heads)
    (SamplingConfig(temperature=0.0), SpecConfig(node_budget=64), "fitted"),
    pytest.param(SamplingConfig(temperature=0.7, top_p=0.95), SpecConfig(node_budget=32),
                 "fitted", marks=pytest.mark.slow),
    pytest.param(SamplingConfig(temperature=1.0), SpecConfig(node_budget=64, max_nodes=40),
                 "random", marks=pytest.mark.slow),
    pytest.param(SamplingConfig(temperature=1.0), SpecConfig(node_budget=0), "fitted",
                 marks=pytest.mark.slow),
    pytest.param(SamplingConfig(temperature=0.7), SpecConfig(node_budget=16), "random-narrow",
                 marks=LONG),
]


@pytest.mark.parametrize("cfg,spec,which", CASES, ids=lambda x: str(x))
def test_speculative_equals_vanilla(trained_model, gsm8k_prompts, fitted_heads, random_heads, cfg,
                                    spec, which):
  config, params, tok = trained_model
  prompts = gsm8k_prompts[:8]
  kw = dict(sampling=cfg, max_new_tokens=48, seed=2, sample_ids=np.arange(8) * 3 + 1,
            eos_ids=tok.eos_ids)
  ref = rollout.generate(config, params, prompts, **kw)
  hd = fitted_heads if which == "fitted" else random_heads
  tree = RankedHeads(topk=(2, 2, 2)) if which == "random-narrow" else None
  speculation = Speculation.of_heads(hd, spec, tree=tree)
  got = rollout.generate(config, params, prompts, speculation=speculation, **kw)
  _assert_same(ref, got)
  st = got.stats
  assert_stats_invariants(got, spec.bucket_shapes(8, speculation.proposer.capacity))
  if spec.node_budget == 0:
    assert st.tokens_per_forward == pytest.approx(1.0)
    assert int(st.nodes_verified) == 0


@pytest.mark.slow  # about 25 s
def test_eos_inside_tree_and_length_limit_mid_path(trained_model, gsm8k_prompts, fitted_heads):
  """Greedy rollouts with fitted heads accept long paths; EOS ids and a length limit that fall
  inside accepted paths must cut exactly where vanilla stops."""
  config, params, _ = trained_model
  prompts = gsm8k_prompts[:6]
  cfg = SamplingConfig(temperature=0.0)
  free = rollout.generate(config, params, prompts, sampling=cfg, max_new_tokens=40, eos_ids=[])
  toks = np.asarray(free.tokens)
  eos = sorted({int(toks[0, 9]), int(toks[3, 17])})  # tokens that occur mid-response
  for max_new in (40, 13):
    kw = dict(sampling=cfg, max_new_tokens=max_new, eos_ids=eos)
    ref = rollout.generate(config, params, prompts, **kw)
    spec = SpecConfig(node_budget=64, bucket_fractions=(1.0,))  # one bucket: fewer compiles
    got = rollout.generate(config, params, prompts,
                           speculation=Speculation.of_heads(fitted_heads, spec), **kw)
    _assert_same(ref, got)
    assert got.stats.tokens_per_forward > 1.3  # paths were long enough to cross the cut points


@pytest.mark.slow  # about 20 s
def test_compaction_over_buckets(trained_model, gsm8k_prompts, random_heads):
  """Rows finishing at very different times move through several (rows, N) buckets."""
  config, params, tok = trained_model
  prompts = gsm8k_prompts[:16]
  cfg = SamplingConfig(temperature=1.0)
  sids = np.arange(16) + 40
  ref = rollout.generate(config, params, prompts, sampling=cfg, max_new_tokens=64, seed=9,
                         sample_ids=sids, eos_ids=tok.eos_ids)
  lens = np.asarray(ref.lengths)
  # the case needs a spread of lengths: half the rows end early, so the rest move to bucket 2
  assert (lens < 64).sum() >= 8 and lens.max() == 64, lens
  spec = SpecConfig(node_budget=32, max_nodes=8, bucket_fractions=(1.0, 0.5, 0.25))
  kw = dict(sampling=cfg, max_new_tokens=64, seed=9, sample_ids=sids, eos_ids=tok.eos_ids,
            speculation=Speculation.of_heads(random_heads, spec))
  got = rollout.generate(config, params, prompts, **kw)
  _assert_same(ref, got)
  shapes = spec.bucket_shapes(16)
  assert_stats_invariants(got, shapes)
  ran = np.asarray(got.stats.spec.bucket_forwards)
  assert (ran[:2] > 0).all()  # compacted into the second bucket


@pytest.mark.slow  # a speed figure (tau), not an exactness property
@pytest.mark.long
def test_tau_with_fitted_heads(trained_model, gsm8k_prompts, fitted_heads):
  """Fitted heads give > 1.5 tokens per target forward on held-out prompts (greedy, fixed seed)."""
  config, params, tok = trained_model
  r = rollout.generate(config, params, gsm8k_prompts[8:16], max_new_tokens=64,
                       sampling=SamplingConfig(temperature=0.0), eos_ids=tok.eos_ids,
                       speculation=Speculation.of_heads(fitted_heads,
                                                        SpecConfig(node_budget=64)))
  assert r.stats.tokens_per_forward > 1.5, r.stats.tokens_per_forward
  acc = r.stats.head_acceptance
  assert acc[0] > 0.5 and (np.diff(acc) <= 1e-9).all()  # deeper heads accept no more often


@pytest.mark.slow  # about 15 s
def test_verify_logits_match_path_forward(trained_model, gsm8k_prompts, random_heads):
  """The verify forward's target sample at every node == a full forward over prompt + path."""
  config, params, _ = trained_model
  prompts = gsm8k_prompts[:2]
  batch = rollout.prepare_batch(config, prompts, max_new_tokens=8)
  cache = models.init_cache(config, 2, batch.cache_length)
  cache, logits, hidden = models.prefill(config, params, jnp.asarray(batch.tokens),
                                         jnp.asarray(batch.lengths), cache)
  cfg = SamplingConfig(temperature=1.0)
  root, _, _ = sampling.sample(logits, 0, jnp.arange(2), jnp.asarray(batch.lengths), cfg)
  head_lp = jax.nn.log_softmax(H.apply(config, params, random_heads, hidden), -1)
  tr = tree.plan(root, head_lp, jnp.array([12, 7]), num_nodes=12, topk=(4, 3, 2))
  positions = cache.lengths[:, None] + tr.depth
  out = models.step(config, params, tr.tokens, positions, cache, tr.mask)
  res = verify.verify(config, params, tr, cache, 0, jnp.arange(2), cfg, max_depth=3)
  seqs, where = [], []
  valid, tokens, parent = (np.asarray(a) for a in (tr.valid, tr.tokens, tr.parent))
  for b in range(2):
    for n in range(13):
      if not valid[b, n]:
        continue
      path, node = [], n
      while node >= 0:
        path.append(int(tokens[b, node]))
        node = int(parent[b, node])
      seqs.append(prompts[b] + path[::-1])
      where.append((b, n))
  # one causal forward over right-padded root-to-node sequences (padding cannot affect them)
  width = max(map(len, seqs))
  padded = jnp.asarray([s + [0] * (width - len(s)) for s in seqs])
  full = models.forward(config, params, padded)
  rows = np.array([b for b, _ in where])
  nodes = np.array([n for _, n in where])
  last = full[np.arange(len(seqs)), np.array([len(s) - 1 for s in seqs])]
  np.testing.assert_allclose(np.asarray(out.logits)[rows, nodes], np.asarray(last), atol=1e-4)
  pos = np.array([len(prompts[b]) for b in rows]) + np.asarray(tr.depth)[rows, nodes] + 1
  t, _, _ = sampling.sample(last, 0, jnp.asarray(rows), jnp.asarray(pos), cfg)
  np.testing.assert_array_equal(np.asarray(t), np.asarray(res.target_tokens)[rows, nodes])


def test_bad_spec_input(trained_model, random_heads):
  config, params, _ = trained_model
  with pytest.raises(ValueError, match="node_budget must be an int >= 0, got -1"):
    SpecConfig(node_budget=-1)
  other = models.ModelConfig.tiny(vocab_size=config.vocab_size + 1,
                                  hidden_size=config.hidden_size)
  with pytest.raises(ValueError, match=f"vocab_size {config.vocab_size + 1} does not match"):
    rollout.generate(config, params, [[1, 2]], max_new_tokens=4,
                     speculation=Speculation.of_heads(H.init(jax.random.key(0), other, 3)))
  wide = models.ModelConfig.tiny(vocab_size=config.vocab_size, hidden_size=32, head_dim=8)
  with pytest.raises(ValueError, match=f"hidden size 32 does not match the model's hidden_size "
                                       f"{config.hidden_size}"):
    rollout.generate(config, params, [[1, 2]], max_new_tokens=4,
                     speculation=Speculation.of_heads(H.init(jax.random.key(0), wide, 3)))
  with pytest.raises(ValueError, match="heads has 3 heads but tree.num_heads=2"):
    Speculation.of_heads(random_heads, tree=RankedHeads.for_heads(2))
  with pytest.raises(ValueError, match="tree must be a proposers.RankedHeads, got HeadsProposer"):
    Speculation.of_heads(random_heads, tree=HeadsProposer())
  with pytest.raises(ValueError, match="Speculation.of_heads: heads is None"):
    Speculation.of_heads(None, SpecConfig())
  with pytest.raises(ValueError, match="spec must be a SpecConfig, got dict"):
    Speculation.of_heads(random_heads, {"node_budget": 8})
