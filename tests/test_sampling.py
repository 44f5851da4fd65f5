"""Counter-based sampling (docs/design.md, "The central invariant"): exactness of the Gumbel-max
sampler
under temperature / top-k / top-p, determinism and batch-layout independence of the noise, logprobs,
config validation and the non-finite flag."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax import sampling
from specroll_jax.sampling import SamplingConfig

_sample = jax.jit(sampling.sample, static_argnames=("cfg",))
_token_logprobs = jax.jit(sampling.token_logprobs, static_argnames=("cfg",))
_noise = jax.jit(sampling.gumbel_noise, static_argnames=("vocab_size",))

SEED = 1234
DRAWS = 20000
V = 8
LOGITS = np.array([1.3, -0.4, 0.2, 2.1, -1.7, 0.9, 0.0, -0.8], np.float32)


def _masked(x):
  return np.asarray(x) <= -1e29


def _softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def chi_square_pvalue(tokens, probs):
  """Pearson chi-square goodness-of-fit p-value of ``tokens`` against ``probs`` (support only)."""
  probs = np.asarray(probs, np.float64)
  support = probs > 0
  counts = np.bincount(np.asarray(tokens), minlength=len(probs))
  assert counts[~support].sum() == 0, f"tokens outside the support: {counts}"
  n = counts.sum()
  expected = n * probs[support]
  stat = float(((counts[support] - expected) ** 2 / expected).sum())
  df = int(support.sum()) - 1
  return float(jax.scipy.special.gammaincc(df / 2.0, stat / 2.0))


def _draw(logits_row, cfg, n=DRAWS, seed=SEED, layout="ids"):
  """n draws from one logits row repeated, each at a distinct (sample id, position)."""
  if layout == "ids":  # one position, many responses
    sids = np.arange(n, dtype=np.int32)
    pos = np.full(n, 17, np.int32)
  else:  # a grid of responses x positions
    sids = np.repeat(np.arange(n // 100, dtype=np.int32), 100)
    pos = np.tile(np.arange(100, dtype=np.int32), n // 100) + 5
  logits = jnp.broadcast_to(jnp.asarray(logits_row), (n, len(logits_row)))
  tok, lp, bad = _sample(logits, seed, jnp.asarray(sids), jnp.asarray(pos), cfg)
  assert not bool(jnp.any(bad))
  return np.asarray(tok), np.asarray(lp)


# --- (a) exactness of plain sampling --------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("layout", ["ids", "grid"])
def test_frequencies_match_softmax(temperature, layout):
  tok, _ = _draw(LOGITS, SamplingConfig(temperature=temperature), layout=layout)
  probs = _softmax(LOGITS / temperature)
  p = chi_square_pvalue(tok, probs)
  assert p > 1e-3, (p, np.bincount(tok, minlength=V) / len(tok), probs)


def test_chi_square_detects_wrong_distribution():
  """The test statistic has power: T = 1 samples are rejected against softmax(logits / 0.7)."""
  tok, _ = _draw(LOGITS, SamplingConfig(temperature=1.0))
  assert chi_square_pvalue(tok, _softmax(LOGITS / 0.7)) < 1e-6


# --- (b) top-k ------------------------------------------------------------------------------------


def test_top_k_support():
  cfg = SamplingConfig(temperature=1.0, top_k=3)
  tok, _ = _draw(LOGITS, cfg, n=5000)
  top3 = set(np.argsort(-LOGITS)[:3].tolist())
  assert set(np.unique(tok).tolist()) == top3
  probs = np.where(np.isin(np.arange(V), list(top3)), _softmax(LOGITS), 0.0)
  assert chi_square_pvalue(tok, probs / probs.sum()) > 1e-3


@pytest.mark.parametrize("top_k", [1, 2, 3, 5, 7, 8, 20])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_allowed_logits_top_k_mask(top_k, temperature):
  rng = np.random.default_rng(top_k)
  logits = rng.normal(size=(16, V)).astype(np.float32) * 3
  x = np.asarray(sampling.allowed_logits(jnp.asarray(logits),
                                         SamplingConfig(temperature=temperature, top_k=top_k)))
  keep = np.zeros_like(logits, bool)
  np.put_along_axis(keep, np.argsort(-logits, axis=-1)[:, :min(top_k, V)], True, axis=-1)
  np.testing.assert_array_equal(~_masked(x), keep)
  np.testing.assert_allclose(x[keep], (logits / np.float32(temperature))[keep], rtol=1e-6)


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.7, top_k=3),
                                 SamplingConfig(temperature=1.0, top_p=0.8),
                                 SamplingConfig(temperature=0.5, top_k=5, top_p=0.6),
                                 SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.0)],
                         ids=str)
def test_allowed_floor_is_the_smallest_allowed_logit(cfg):
  """The tokens sampling may draw are exactly those whose (tempered) logit is at least the
  floor, ties at the k-th logit included; -inf without a restriction."""
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(16, V)).astype(np.float32) * 3
  logits[0, :4] = logits[0].max() + 1.0  # a tie at the top: top-k 3 keeps all four
  x = sampling.allowed_logits(jnp.asarray(logits), cfg)
  floor = np.asarray(sampling.allowed_floor(x, cfg))
  assert floor.shape == (16,)
  if cfg.greedy or cfg.plain:
    assert np.isneginf(floor).all()
    return
  x = np.asarray(x)
  tempered = np.asarray(jnp.asarray(logits) * sampling.inverse_temperature(cfg.temperature))
  np.testing.assert_array_equal(~_masked(x), tempered >= floor[:, None])
  if cfg.top_k:
    assert (~_masked(x)).sum(1)[0] >= 4


# --- (c) top-p ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "probs,top_k,top_p,support",
    [
        ([0.5, 0.3, 0.15, 0.05], 0, 0.8, {0, 1}),
        ([0.5, 0.3, 0.15, 0.05], 0, 0.81, {0, 1, 2}),
        ([0.5, 0.3, 0.15, 0.05], 0, 0.5, {0}),
        ([0.5, 0.3, 0.15, 0.05], 0, 0.3, {0}),
        ([0.5, 0.3, 0.15, 0.05], 0, 0.96, {0, 1, 2, 3}),
        ([0.5, 0.3, 0.15, 0.05], 0, 1.0, {0, 1, 2, 3}),
        # permuted order: the set follows the probabilities, not the indices
        ([0.05, 0.15, 0.5, 0.3], 0, 0.8, {2, 3}),
        # top-k then top-p (transformers' order): renormalised over the top 2 the first token has
        # mass 4/7 >= 0.55, so the nucleus is {0}; top-p alone at 0.55 would keep {0, 1}.
        ([0.4, 0.3, 0.2, 0.1], 2, 0.55, {0}),
        ([0.4, 0.3, 0.2, 0.1], 0, 0.55, {0, 1}),
        ([0.4, 0.3, 0.2, 0.1], 2, 0.6, {0, 1}),
        ([0.4, 0.3, 0.2, 0.1], 3, 0.95, {0, 1, 2}),
        ([0.4, 0.3, 0.2, 0.1], 1, 1.0, {0}),
    ])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_top_p_support(probs, top_k, top_p, support, temperature):
  # Logits log(p) * T: after dividing by T the distribution is exactly ``probs``.
  logits = jnp.asarray(np.log(np.asarray(probs, np.float32)) * np.float32(temperature))
  cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
  x = np.asarray(sampling.allowed_logits(logits, cfg))  # eager: no compile per config
  assert set(np.flatnonzero(~_masked(x)).tolist()) == support


def test_top_p_empirical_renormalised():
  probs = np.array([0.06, 0.4, 0.1, 0.15, 0.04, 0.25], np.float64)  # nucleus at 0.75: {1, 5, 3}
  logits = np.log(probs).astype(np.float32)
  for cfg in [SamplingConfig(top_p=0.75), SamplingConfig(top_k=4, top_p=0.75)]:
    tok, lp = _draw(logits, cfg)
    nucleus = np.zeros(len(probs), bool)
    nucleus[[1, 5, 3]] = True
    want = np.where(nucleus, probs, 0.0) / probs[nucleus].sum()
    assert set(np.unique(tok).tolist()) == {1, 3, 5}
    assert chi_square_pvalue(tok, want) > 1e-3
    np.testing.assert_allclose(lp, np.log(want[tok]), atol=1e-5)


# --- (d) greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.0),
                                 SamplingConfig(temperature=0.0, top_k=2, top_p=0.5)])
def test_greedy_is_argmax(cfg):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(64, 50)).astype(np.float32) * 4
  tok, lp, bad = _sample(jnp.asarray(logits), SEED, jnp.arange(64), jnp.arange(64) * 3, cfg)
  np.testing.assert_array_equal(np.asarray(tok), logits.argmax(-1))
  # Greedy reports logprobs under softmax(logits).
  ref = np.log(_softmax(logits))[np.arange(64), logits.argmax(-1)]
  np.testing.assert_allclose(np.asarray(lp), ref, atol=1e-5)
  assert not np.asarray(bad).any()


# --- (e) determinism and layout independence of the noise -----------------------------------------


def test_same_samples_across_programs_and_shapes():
  """The sample of a row is a function of its logits and noise coordinates only: eager, jitted on
  the batch, one row at a time and inside a larger padded batch all agree bit for bit."""
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(32, 100)).astype(np.float32))
  sids, pos = jnp.arange(32) * 7, jnp.arange(32) + 100
  cfg = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9)
  batch = _sample(logits, SEED, sids, pos, cfg)
  with jax.disable_jit():
    eager = sampling.sample(logits[:4], SEED, sids[:4], pos[:4], cfg)
  for x, y in zip(eager, batch, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y)[:4])
  for i in (0, 13, 31):
    one = _sample(logits[i:i + 1], SEED, sids[i:i + 1], pos[i:i + 1], cfg)
    for x, y in zip(one, batch, strict=True):
      np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(y)[i])
  big = jnp.concatenate([logits, jnp.zeros((8, 100))])
  padded = _sample(big, SEED, jnp.concatenate([sids, jnp.arange(8)]),
                   jnp.concatenate([pos, jnp.arange(8)]), cfg)
  for x, y in zip(padded, batch, strict=True):
    np.testing.assert_array_equal(np.asarray(x)[:32], np.asarray(y))


def test_noise_depends_on_every_coordinate():
  base = np.asarray(_noise(7, 3, 11, 64))
  for args in [(8, 3, 11), (7, 4, 11), (7, 3, 12), (7, 11, 3), (7, 0, 11), (0, 3, 11)]:
    other = np.asarray(_noise(*args, 64))
    assert not np.any(other == base), args  # independent streams: no coincident value at all
  # a grid of (seed, sample id, position) gives pairwise distinct noise rows
  seeds, sids, pos = np.meshgrid(np.arange(3), np.arange(40), np.arange(40), indexing="ij")
  rows = np.asarray(_noise(jnp.asarray(seeds.ravel()), jnp.asarray(sids.ravel()),
                           jnp.asarray(pos.ravel()), 16))
  assert len(np.unique(rows, axis=0)) == len(rows)
  # and different token ids within a row are different too
  assert len(np.unique(np.asarray(_noise(0, 0, 0, 4096)))) > 4000


def test_noise_independent_of_batch_layout():
  rng = np.random.default_rng(2)
  b, t, vocab = 6, 5, 37
  sids = rng.integers(0, 10_000, size=(b, t)).astype(np.int32)
  pos = rng.integers(0, 4096, size=(b, t)).astype(np.int32)
  full = np.asarray(_noise(SEED, jnp.asarray(sids), jnp.asarray(pos), vocab))
  flat = np.asarray(_noise(SEED, jnp.asarray(sids.ravel()), jnp.asarray(pos.ravel()), vocab))
  np.testing.assert_array_equal(full.reshape(b * t, vocab), flat)
  for i, j in [(0, 0), (3, 2), (5, 4)]:
    alone = np.asarray(_noise(SEED, int(sids[i, j]), int(pos[i, j]), vocab))
    np.testing.assert_array_equal(alone, full[i, j])
    one_row = np.asarray(_noise(SEED, jnp.asarray(sids[i, j:j + 1]), jnp.asarray(pos[i, j:j + 1]),
                                vocab))
    np.testing.assert_array_equal(one_row[0], full[i, j])

  # ``sample``: a row alone == the same row inside a bigger batch (other rows arbitrary)
  logits = rng.normal(size=(b, vocab)).astype(np.float32)
  cfg = SamplingConfig(temperature=0.8, top_k=10)
  tok, lp, _ = _sample(jnp.asarray(logits), SEED, jnp.asarray(sids[:, 0]), jnp.asarray(pos[:, 0]),
                       cfg)
  perm = rng.permutation(b)
  tok_p, lp_p, _ = _sample(jnp.asarray(logits[perm]), SEED, jnp.asarray(sids[perm, 0]),
                           jnp.asarray(pos[perm, 0]), cfg)
  np.testing.assert_array_equal(np.asarray(tok_p), np.asarray(tok)[perm])
  np.testing.assert_array_equal(np.asarray(lp_p), np.asarray(lp)[perm])
  for i in range(b):
    t1, l1, _ = _sample(jnp.asarray(logits[i:i + 1]), SEED, jnp.asarray(sids[i:i + 1, 0]),
                        jnp.asarray(pos[i:i + 1, 0]), cfg)
    assert int(t1[0]) == int(tok[i])
    assert float(l1[0]) == float(lp[i])


def test_uniform_strictly_inside_unit_interval():
  edge = jnp.array([0, 1, 0xFF, 0x1FF, 0x200, 0x7FFFFFFF, 0x80000000, 0xFFFFFE00, 0xFFFFFEFF,
                    0xFFFFFF00, 0xFFFFFFFF], jnp.uint32)
  rng = np.random.default_rng(3)
  bits = jnp.concatenate([edge, jnp.asarray(rng.integers(0, 2**32, size=200_000, dtype=np.uint32))])
  u = np.asarray(sampling.uniform_from_bits(bits))
  assert u.dtype == np.float32
  assert np.all(u > 0) and np.all(u < 1), (u.min(), u.max())
  g = np.asarray(sampling.gumbel_from_bits(bits))
  assert np.all(np.isfinite(g))
  # roughly uniform / standard Gumbel
  assert abs(u[len(edge):].mean() - 0.5) < 5e-3
  assert abs(g[len(edge):].mean() - np.euler_gamma) < 1e-2
  # the whole noise of a realistic vocab row is finite
  assert np.all(np.isfinite(np.asarray(_noise(SEED, jnp.arange(64), 0, 151_936))))


# --- (f) logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [
    SamplingConfig(),
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.3, top_k=5),
    SamplingConfig(temperature=0.9, top_p=0.8),
    SamplingConfig(temperature=0.6, top_k=7, top_p=0.9),
    SamplingConfig(temperature=0.0),
])
def test_logprobs(cfg):
  rng = np.random.default_rng(4)
  r, vocab = 128, 40
  logits = (rng.normal(size=(r, vocab)) * 2).astype(np.float32)
  tok, lp, _ = _sample(jnp.asarray(logits), SEED, jnp.arange(r), jnp.full((r,), 9), cfg)
  tok, lp = np.asarray(tok), np.asarray(lp)
  np.testing.assert_array_equal(
      lp, np.asarray(_token_logprobs(jnp.asarray(logits), jnp.asarray(tok), cfg)))
  # by hand: tempered, restricted to the allowed set (top-k then top-p), renormalised
  x = logits.astype(np.float64) / (cfg.temperature or 1.0)
  ref = np.empty(r)
  for i in range(r):
    order = np.argsort(-x[i])
    keep = order[:cfg.top_k] if cfg.top_k and not cfg.greedy else order
    if cfg.top_p < 1.0 and not cfg.greedy:
      p = _softmax(x[i, keep])
      before = np.cumsum(p) - p
      keep = keep[before < cfg.top_p]
    assert tok[i] in keep
    ref[i] = np.log(_softmax(x[i, keep])[list(keep).index(tok[i])])
  np.testing.assert_allclose(lp, ref, atol=2e-5)


# --- (g) config validation ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,field,value", [
    (dict(temperature=-0.5), "temperature", "-0.5"),
    (dict(temperature=float("nan")), "temperature", "nan"),
    (dict(temperature=float("inf")), "temperature", "inf"),
    (dict(top_p=0.0), "top_p", "0.0"),
    (dict(top_p=1.5), "top_p", "1.5"),
    (dict(top_p=-0.1), "top_p", "-0.1"),
    (dict(top_k=-1), "top_k", "-1"),
    (dict(top_k=2.0), "top_k", "2.0"),
])
def test_config_validation(kwargs, field, value):
  with pytest.raises(ValueError) as e:
    SamplingConfig(**kwargs)
  assert field in str(e.value) and value in str(e.value), str(e.value)


def test_config_hashable_frozen():
  a, b = SamplingConfig(temperature=0.7, top_k=5), SamplingConfig(temperature=0.7, top_k=5)
  assert a == b and hash(a) == hash(b)
  assert len({a, b, SamplingConfig()}) == 2
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.temperature = 1.0
  assert SamplingConfig(temperature=0).greedy and not SamplingConfig().greedy
  assert SamplingConfig().plain and not SamplingConfig(top_k=3).plain
  assert not SamplingConfig(top_p=0.9).plain


# --- (h) non-finite flag --------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [SamplingConfig(), SamplingConfig(temperature=0.0),
                                 SamplingConfig(top_k=3, top_p=0.9)])
def test_nonfinite_flag(cfg):
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(6, 12)).astype(np.float32)
  logits[1, 4] = np.nan
  logits[3, 0] = np.inf
  logits[4, 11] = -np.inf
  sids, pos = jnp.arange(6), jnp.full((6,), 3)
  tok, lp, bad = _sample(jnp.asarray(logits), SEED, sids, pos, cfg)
  np.testing.assert_array_equal(np.asarray(bad), [False, True, False, True, True, False])
  # the finite rows are unaffected by the bad ones
  ok = np.array([0, 2, 5])
  tok_ok, lp_ok, bad_ok = _sample(jnp.asarray(logits[ok]), SEED, sids[ok], pos[ok], cfg)
  np.testing.assert_array_equal(np.asarray(tok)[ok], np.asarray(tok_ok))
  np.testing.assert_array_equal(np.asarray(lp)[ok], np.asarray(lp_ok))
  assert not np.asarray(bad_ok).any()
