"""Group-aware lookup: continuations from the row's own text, its GRPO siblings and earlier
responses; exact against the vanilla engine (siblings finishing at different times, members of a
group spread over the batch and over buckets, a store holding the row's own future text and a
corrupted copy of it); the response store; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LONG

from specroll_jax import rollout
from specroll_jax.adaptation import store as S
from specroll_jax.proposers.group_lookup import (
  PRIOR,
  SIBLING,
  GroupLookup,
  check_groups_on_shards,
  find_continuations,
  sibling_table,
)
from specroll_jax.rollout import SamplingConfig, SpecConfig

G, P, M = 4, 4, 40  # group size, prompts, new tokens
SPEC = SpecConfig(bucket_fractions=(1.0, 0.5, 0.25), nodes=(4, 4, 4))


def _reference(segment, limit, suffix, max_ngram, min_ngram, max_chain):
  for n in range(max_ngram, min_ngram - 1, -1):
    if len(suffix) < n:
      continue
    want = suffix[-n:]
    for p in range(limit - n - 1, -1, -1):  # latest match leaving a token after it
      if list(segment[p:p + n]) == list(want):
        cont = []
        for t in segment[p + n: min(p + n + max_chain, limit)]:
          if t < 0:
            break
          cont.append(int(t))
        return cont, n
  return [], 0


def test_find_continuations_matches_reference():
  rng = np.random.default_rng(0)
  r, s, w = 16, 5, 30
  corpus = rng.integers(0, 4, size=(r, s, w)).astype(np.int32)
  limit = rng.integers(0, w + 1, size=(r, s)).astype(np.int32)
  corpus[rng.random((r, s, w)) < 0.05] = -1
  slen = rng.integers(0, 4, size=r).astype(np.int32)
  suffix = rng.integers(0, 4, size=(r, 3)).astype(np.int32)
  suffix[np.arange(3)[None] < 3 - slen[:, None]] = -1
  f = jax.jit(find_continuations, static_argnames=("max_ngram", "min_ngram", "max_chain"))
  toks, lens, ns = (np.asarray(x) for x in f(jnp.asarray(corpus), jnp.asarray(limit),
                                             jnp.asarray(suffix), jnp.asarray(slen),
                                             max_ngram=3, min_ngram=1, max_chain=4))
  for i in range(r):
    known = [int(t) for t in suffix[i] if t >= 0]
    for j in range(s):
      want, n = _reference(corpus[i, j].tolist(), int(limit[i, j]), known, 3, 1, 4)
      assert ns[i, j] == n and lens[i, j] == len(want), (i, j)
      np.testing.assert_array_equal(toks[i, j, : len(want)], want)
      assert (toks[i, j, len(want):] == -1).all()


def test_sibling_table():
  gids = jnp.array([3, 1, 3, 1, 3, 7])
  sib = np.asarray(sibling_table(gids, 2))
  np.testing.assert_array_equal(sib, [[2, 4], [3, -1], [0, 4], [1, -1], [0, 2], [-1, -1]])


@pytest.fixture(scope="module")
def batch(trained_model, gsm8k_prompts):
  """P prompts x G members, members of each group spread over the batch (not contiguous)."""
  rng = np.random.default_rng(3)
  perm = rng.permutation(P * G)
  prompt_of = (np.arange(P * G) // G)[perm]
  member = (np.arange(P * G) % G)[perm]
  prompts = [gsm8k_prompts[i] for i in prompt_of]
  return prompts, (prompt_of * G + member).astype(np.int32), prompt_of


@pytest.mark.parametrize("cfg", [pytest.param(SamplingConfig(temperature=0.0),
                                              marks=LONG),
                                 pytest.param(SamplingConfig(temperature=0.7, top_k=40,
                                                             top_p=0.9), marks=LONG),
                                 pytest.param(SamplingConfig(temperature=1.0),
                                              marks=pytest.mark.slow)],  # fast: test_specroll
                         ids=str)
def test_group_lookup_equals_vanilla(trained_model, batch, cfg):
  config, params, tok = trained_model
  prompts, sids, prompt_of = batch
  eos = list(tok.eos_ids) + tok.encode(" number")  # the tiny model rarely ends on its own
  kw = dict(sampling=cfg, max_new_tokens=M, seed=2, sample_ids=sids, eos_ids=eos)
  ref = rollout.generate(config, params, prompts, **kw)
  lens = np.asarray(ref.lengths)
  assert len(set(lens.tolist())) > 1  # siblings finish at different times
  # earlier responses: another seed's responses of the same prompt, the row's own future text
  # (must still be verified) and a corrupted copy of it (must be rejected where it differs)
  other = rollout.generate(config, params, prompts, **{**kw, "seed": 7})
  store = S.store_init(vocab_size=config.vocab_size, prompts=P, per_prompt=3, max_tokens=M)
  toks = np.asarray(ref.tokens)
  bad = toks.copy()
  bad[:, 3::5] = (bad[:, 3::5] + 1) % config.vocab_size
  for resp, ln in ((np.asarray(other.tokens), np.asarray(other.lengths)), (bad, lens),
                   (toks, lens)):
    for r in range(P * G):
      store = S.store_add(store, [prompt_of[r]], [prompts[r]], resp[r:r + 1], ln[r:r + 1])
  prior = S.store_context(store, prompt_of, prompts, vocab_size=config.vocab_size)
  gl = GroupLookup(group_size=G, max_chain=4)
  got = rollout.generate(config, params, prompts,
                         speculation=rollout.Speculation(gl, gl.context(prior=prior), SPEC), **kw)
  np.testing.assert_array_equal(np.asarray(got.lengths), lens)
  np.testing.assert_array_equal(np.asarray(got.tokens), toks)
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), atol=1e-5)
  assert (np.asarray(got.stats.spec.bucket_forwards) > 0).sum() >= 2  # compaction happened
  st = got.stats.spec.proposer
  found = np.asarray(st.found)
  assert found[SIBLING] > 0 and found[PRIOR] > 0
  assert (np.asarray(st.hit) <= np.asarray(st.tested)).all()
  # the store holds each row's own future text: most of its chains are accepted
  assert got.stats.tokens_per_forward > 2.0


def test_lookup_bad_input(trained_model, batch):
  config, params, tok = trained_model
  prompts, sids, prompt_of = batch
  gl = GroupLookup(group_size=G)
  kw = dict(max_new_tokens=8, sample_ids=sids)

  def with_context(ctx) -> rollout.Speculation:
    return rollout.Speculation(gl, ctx, SPEC)

  with pytest.raises(ValueError, match=r"group_ids must have shape \(16,\)"):
    rollout.generate(config, params, prompts,
                     speculation=with_context(gl.context(group_ids=np.arange(3))), **kw)
  gids = prompt_of.copy()
  j = int(np.flatnonzero(prompt_of != prompt_of[0])[0])
  gids[0], gids[j] = gids[j], gids[0]  # same group sizes, mixed prompts
  with pytest.raises(ValueError, match="share group id .* but not a prompt"):
    rollout.generate(config, params, prompts, speculation=with_context(gl.context(group_ids=gids)),
                     **kw)
  with pytest.raises(ValueError, match="share group id"):  # sample ids that break the G rule
    rollout.generate(config, params, prompts, **{**kw, "sample_ids": np.arange(P * G)},
                     speculation=with_context(gl.context()))
  with pytest.raises(ValueError, match="prior holds ids outside"):
    rollout.generate(config, params, prompts, speculation=with_context(
        gl.context(prior=np.full((16, 1, 4), config.vocab_size))), **kw)
  with pytest.raises(ValueError, match="prior has 2 rows, the batch 16"):
    rollout.generate(config, params, prompts, speculation=with_context(gl.context(
        prior=np.zeros((2, 1, 4), np.int32))), **kw)
  with pytest.raises(ValueError, match="acceptance has shape"):
    rollout.generate(config, params, prompts, speculation=with_context(gl.context(
        acceptance=np.zeros((3, 2, 2)))), **kw)
  with pytest.raises(ValueError, match="group 1 spans shards"):
    check_groups_on_shards(np.array([0, 0, 1, 1, 1, 2, 2, 2]), 2)
  check_groups_on_shards(np.array([0, 0, 1, 1, 2, 2, 3, 3]), 2)


def test_response_store_bounded_and_checked():
  st = S.store_init(vocab_size=10, per_prompt=2, max_tokens=3, prompts=2)
  p = {0: [1, 2], 1: [3], 2: [4, 4]}
  st = S.store_add(st, [0, 0, 1], [p[0], p[0], p[1]],
                   np.array([[1, 2, 3, 4], [5, 6, 0, 0], [7, 0, 0, 0]]), np.array([4, 2, 1]))
  st = S.store_add(st, [0], [p[0]], np.array([[9, 9, 9, 9]]), np.array([2]))
  assert [r.tolist() for r in st.responses(0)] == [[5, 6], [9, 9]]  # last 2, cut to 3 tokens
  ctx = S.store_context(st, [0, 1, 0], [p[0], p[1], p[0]], vocab_size=10)
  assert ctx.shape == (3, 2, 3)
  np.testing.assert_array_equal(ctx[0], [[9, 9, -1], [5, 6, -1]])  # newest first
  np.testing.assert_array_equal(ctx[1], [[7, -1, -1], [-1, -1, -1]])
  st = S.store_add(st, [2], [p[2]], np.array([[1, 1]]), np.array([2]))  # evicts the oldest
  assert len(st) == 2 and st.responses(1) == [] and len(st.responses(2)) == 1
  with pytest.raises(ValueError, match="vocabulary; the model has vocab_size=11"):
    S.store_context(st, [0], [p[0]], vocab_size=11)
  with pytest.raises(ValueError, match="prompt id 0 is stored with other prompt tokens"):
    S.store_context(st, [0], [[8, 8]], vocab_size=10)
  with pytest.raises(ValueError, match=r"tokens outside \[0, vocab_size=10\)"):
    S.store_add(st, [5], [[1]], np.array([[10]]), np.array([1]))
  with pytest.raises(ValueError, match="per_prompt must be an int >= 1"):
    S.store_init(vocab_size=10, per_prompt=0, prompts=1, max_tokens=1)


def test_row_context_is_detected_for_the_on_device_step():
  from specroll_jax.grpo.on_device import has_row_context
  gl = GroupLookup(group_size=G)
  assert not has_row_context(gl.context())
  assert has_row_context(gl.context(group_ids=np.arange(4)))
  assert has_row_context(("heads", gl.context(prior=np.zeros((4, 1, 2), np.int32))))
