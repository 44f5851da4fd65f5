"""Proposers through the engine: prompt lookup gives the vanilla rollout token for token; a
proposer's per-row state follows its row through compaction; lookup against a numpy reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LONG

from specroll_jax import rollout
from specroll_jax.proposers import HeadsProposer, PromptLookup, Proposer
from specroll_jax.proposers import tree as T
from specroll_jax.proposers.lookup import find_continuation
from specroll_jax.rollout import SamplingConfig, SpecConfig


def _reference_continuation(hist, pos, max_ngram, min_ngram, max_chain):
  for n in range(max_ngram, min_ngram - 1, -1):
    if pos - n + 1 < 0:
      continue
    suffix = hist[pos - n + 1: pos + 1]
    for p in range(pos - n, -1, -1):  # latest occurrence ending before the suffix's end
      if hist[p:p + n] == suffix:
        cont = hist[p + n: min(p + n + max_chain, pos + 1)]
        return cont
  return []


def test_find_continuation_matches_reference():
  rng = np.random.default_rng(0)
  r, s = 64, 40
  hist = rng.integers(0, 4, size=(r, s)).astype(np.int32)  # tiny vocab: many matches
  pos = rng.integers(0, s, size=r).astype(np.int32)
  for i in range(r):
    hist[i, pos[i] + 1:] = -1
  toks, length = jax.jit(find_continuation, static_argnames=("max_ngram", "min_ngram",
                                                             "max_chain"))(
      jnp.asarray(hist), jnp.asarray(pos), max_ngram=3, min_ngram=1, max_chain=4)
  toks, length = np.asarray(toks), np.asarray(length)
  for i in range(r):
    want = _reference_continuation(hist[i].tolist(), int(pos[i]), 3, 1, 4)
    assert length[i] == len(want), (i, want, toks[i], length[i])
    np.testing.assert_array_equal(toks[i, : len(want)], want)
    assert (toks[i, len(want):] == -1).all()


def test_lookup_validation():
  with pytest.raises(ValueError, match="min_ngram=4 exceeds max_ngram=3"):
    PromptLookup(min_ngram=4)
  with pytest.raises(ValueError, match="max_chain must be an int >= 1, got 0"):
    PromptLookup(max_chain=0)
  with pytest.raises(ValueError, match="HeadsProposer.topk must hold num_heads=3"):
    HeadsProposer(num_heads=3, topk=(2, 2))


CASES = [pytest.param(SamplingConfig(temperature=0.0), marks=LONG),
         pytest.param(SamplingConfig(temperature=0.7, top_p=0.9), marks=LONG),
         pytest.param(SamplingConfig(temperature=1.0), marks=pytest.mark.slow)]


@pytest.mark.parametrize("cfg", CASES, ids=str)
def test_lookup_proposer_equals_vanilla(trained_model, gsm8k_prompts, cfg):
  config, params, tok = trained_model
  prompts = gsm8k_prompts[:8]
  kw = dict(sampling=cfg, max_new_tokens=48, seed=4, sample_ids=np.arange(8) * 5 + 2,
            eos_ids=tok.eos_ids)
  ref = rollout.generate(config, params, prompts, **kw)
  spec = SpecConfig(node_budget=48, bucket_fractions=(1.0, 0.5))
  got = rollout.generate(config, params, prompts,
                         speculation=rollout.Speculation(PromptLookup(max_chain=4), (), spec),
                         **kw)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), atol=1e-5)
  st = got.stats.spec.proposer
  twice = st.combine(st)  # statistics add up leaf by leaf (results.Summed)
  assert [int(a) for a in jax.tree.leaves(twice)] == [2 * int(b) for b in jax.tree.leaves(st)]
  ps = jax.tree.map(int, got.stats.spec.proposer)
  assert 0 <= ps.matched <= ps.tokens
  assert ps.rows <= int(np.asarray(got.stats.spec.active_trace).sum())
  if cfg.greedy:  # the tiny model repeats itself greedily: copies pay
    assert ps.matched > 0 and got.stats.tokens_per_forward > 1.05


@dataclasses.dataclass(frozen=True)
class RowTag(Proposer):
  """Test proposer whose per-row state records its own row: any mix-up in compaction shows up as
  a mismatch count in its statistics. Proposes the root repeated (a real, usually wrong chain)."""

  @property
  def max_depth(self):
    return 2

  @property
  def capacity(self):
    return 2

  def init(self, target, params, rows):
    r = rows.row.shape[0]
    return {"row": rows.row, "sid": rows.sample_ids,
            "tag": rows.row[:, None] * 10 + jnp.arange(3)[None],
            "bad": jnp.zeros((r,), jnp.int32)}

  def propose(self, target, params, state, inp, *, num_nodes):
    root_ok = jnp.take_along_axis(inp.history, inp.position[:, None], axis=1)[:, 0] == inp.root
    bad = (state["row"] != inp.row) | (state["sid"] != inp.sample_ids) | ~root_ok
    bad = bad & (inp.budget > 0)
    toks = jnp.stack([inp.root, inp.root], axis=1)
    tr = T.chain(inp.root, toks, jnp.minimum(inp.budget, 2), num_nodes=num_nodes)
    return tr, {**state, "bad": state["bad"] + bad}

  def update(self, target, params, state, fb):
    tag_bad = (state["tag"][:, 0] // 10 != fb.row) | (state["tag"][:, 2] % 10 != 2)
    stats = {"mismatch": (jnp.where(fb.active, tag_bad, False).sum() + state["bad"].sum()),
             "row_steps": fb.active.sum()}
    return {**state, "bad": jnp.zeros_like(state["bad"])}, stats

  def init_stats(self):
    return {"mismatch": jnp.int32(0), "row_steps": jnp.int32(0)}


def test_per_row_state_follows_its_row_through_compaction(trained_model, gsm8k_prompts):
  config, params, tok = trained_model
  prompts = gsm8k_prompts[:16]
  kw = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=64, seed=9,
            sample_ids=np.arange(16) + 40, eos_ids=tok.eos_ids)
  ref = rollout.generate(config, params, prompts, **kw)
  spec = SpecConfig(node_budget=32, bucket_fractions=(1.0, 0.5, 0.25))
  got = rollout.generate(config, params, prompts,
                         speculation=rollout.Speculation(RowTag(), (), spec), **kw)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
  assert (np.asarray(got.stats.spec.bucket_forwards)[:2] > 0).all()  # compaction happened
  ps = jax.tree.map(int, got.stats.spec.proposer)
  assert ps["mismatch"] == 0
  assert ps["row_steps"] == int(np.asarray(got.stats.spec.active_trace).sum())
