"""Future-token heads: zero init is the identity, validation messages, SpecConfig validation,
self-distillation labels and a fit that learns a synthetic task."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax import heads as H
from specroll_jax.models import ModelConfig, init_params, logits_from_hidden

VOCAB = 64
K = 3


@pytest.fixture(scope="module")
def model():
  cfg = ModelConfig.tiny(vocab_size=VOCAB)
  return cfg, init_params(jax.random.PRNGKey(0), cfg)


# --- init / apply ---------------------------------------------------------------------------------


def test_zero_init_is_identity(model):
  cfg, params = model
  heads = H.init(jax.random.PRNGKey(1), cfg, K)
  assert heads.num_heads == K and heads.hidden_size == cfg.hidden_size
  assert heads.vocab_size == VOCAB
  h = jax.random.normal(jax.random.PRNGKey(2), (2, 5, cfg.hidden_size))
  out = np.asarray(jax.jit(H.apply, static_argnums=0)(cfg, params, heads, h))
  assert out.shape == (2, 5, K, VOCAB) and out.dtype == np.float32
  ref = np.asarray(logits_from_hidden(cfg, params, h))
  for k in range(K):
    np.testing.assert_allclose(out[..., k, :], ref, rtol=1e-6, atol=1e-6)
  # and the head states themselves are exactly h
  z = np.asarray(H.head_states(cfg, heads, h))
  np.testing.assert_array_equal(z, np.broadcast_to(np.asarray(h)[..., None, :], z.shape))


def test_random_init_is_not_identity(model):
  cfg, params = model
  heads = H.init(jax.random.PRNGKey(1), cfg, 2, scale=0.1)
  h = jax.random.normal(jax.random.PRNGKey(2), (4, cfg.hidden_size))
  out = np.asarray(H.apply(cfg, params, heads, h))
  ref = np.asarray(logits_from_hidden(cfg, params, h))
  assert not np.allclose(out[:, 0], ref, atol=1e-4)
  assert not np.allclose(out[:, 0], out[:, 1], atol=1e-4)


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_init_rejects_bad_head_count(model, bad):
  with pytest.raises(ValueError, match="num_heads"):
    H.init(jax.random.PRNGKey(0), model[0], bad)


# --- validate -------------------------------------------------------------------------------------


def test_validate_accepts_matching_heads(model):
  cfg, params = model
  heads = H.init(jax.random.PRNGKey(0), cfg, K)
  for num_heads in (None, K):
    H.validate(cfg, heads, num_heads=num_heads)  # raises on any mismatch (tests below)
  # and matching heads are usable as they are: their logits have the model's vocab
  assert H.apply(cfg, params, heads, jnp.zeros((1, cfg.hidden_size))).shape == (1, K, VOCAB)


def test_validate_hidden_size_mismatch(model):
  cfg, _ = model
  heads = H.init(jax.random.PRNGKey(0), cfg.replace(hidden_size=32), K)
  with pytest.raises(ValueError) as e:
    H.validate(cfg, heads)
  msg = str(e.value)
  assert "hidden" in msg and "32" in msg and "64" in msg, msg


def test_validate_vocab_mismatch(model):
  cfg, _ = model
  heads = H.init(jax.random.PRNGKey(0), cfg.replace(vocab_size=100), K)
  with pytest.raises(ValueError) as e:
    H.validate(cfg, heads)
  msg = str(e.value)
  assert "vocab" in msg and "100" in msg and str(VOCAB) in msg, msg


def test_validate_head_count_and_type(model):
  cfg, _ = model
  with pytest.raises(ValueError) as e:
    H.validate(cfg, H.init(jax.random.PRNGKey(0), cfg, 2), num_heads=3)
  assert "2" in str(e.value) and "3" in str(e.value), str(e.value)
  with pytest.raises(ValueError, match="Heads"):
    H.validate(cfg, {"w": 0})


# --- training_examples ----------------------------------------------------------------------------


def test_training_examples_labels():
  tokens = np.array([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34]], np.int32)
  lengths = np.array([4, 2, 1], np.int32)
  b, m, d = 3, 5, 2
  hidden = (100 * np.arange(b)[:, None, None] + np.arange(m)[None, :, None]
            + np.zeros((1, 1, d))).astype(np.float32)
  h, labels, mask = H.training_examples(tokens, lengths, hidden, num_heads=2)
  # anchors j with a head-1 label (j + 1 < length): row 0 -> j = 0, 1, 2; row 1 -> j = 0;
  # row 2: none
  np.testing.assert_array_equal(h[:, 0], [0, 1, 2, 100])
  assert h.shape == (4, d)
  np.testing.assert_array_equal(labels[mask], np.array([11, 12, 12, 13, 13, 21]))
  np.testing.assert_array_equal(mask, [[1, 1], [1, 1], [1, 0], [1, 0]])
  np.testing.assert_array_equal(labels[:, 0], [11, 12, 13, 21])  # head 1 at anchor j: token j + 1
  np.testing.assert_array_equal(labels[:3, 1][mask[:3, 1]], [12, 13])  # head 2: token j + 2
  assert labels.dtype == np.int32 and mask.dtype == bool


def test_training_examples_full_length_and_more_heads():
  rng = np.random.default_rng(0)
  b, m, k = 4, 7, 3
  tokens = rng.integers(0, 50, size=(b, m)).astype(np.int32)
  lengths = np.array([7, 5, 3, 0], np.int32)
  hidden = rng.normal(size=(b, m, 6)).astype(np.float32)
  h, labels, mask = H.training_examples(tokens, lengths, hidden, num_heads=k)
  rows = [(r, j) for r in range(b) for j in range(m) if j + 1 < lengths[r]]
  assert len(h) == len(rows)
  for a, (r, j) in enumerate(rows):
    np.testing.assert_array_equal(h[a], hidden[r, j])
    for kk in range(1, k + 1):
      assert mask[a, kk - 1] == (j + kk < lengths[r])
      if mask[a, kk - 1]:
        assert labels[a, kk - 1] == tokens[r, j + kk]


# --- fit_heads ------------------------------------------------------------------------------------


def _synthetic(cfg, seed=0, b=32, m=24):
  """Rollouts whose anchor hidden state encodes the next K tokens: h[j] = sum_k E_k[token j + k]
  (fixed random codebooks E_k; ``seed`` draws the tokens)."""
  codebooks = np.random.default_rng(1234).normal(size=(K, VOCAB, cfg.hidden_size))
  codebooks = codebooks.astype(np.float32)
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 16, size=(b, m)).astype(np.int32)
  lengths = rng.integers(m // 2, m + 1, size=b).astype(np.int32)
  hidden = np.zeros((b, m, cfg.hidden_size), np.float32)
  for k in range(1, K + 1):
    idx = np.arange(m) + k
    ok = idx < m
    hidden[:, ok] += codebooks[k - 1][tokens[:, idx[ok]]]
  return tokens, lengths, hidden


def test_fit_heads_learns(model):
  cfg, params = model
  # Scale the tied embedding so the frozen unembedding can express confident predictions.
  params = {**params, "embed": {"embedding": params["embed"]["embedding"] * 25}}
  tokens, lengths, hidden = _synthetic(cfg)
  heads0 = H.init(jax.random.PRNGKey(1), cfg, K)
  h, labels, mask = (jnp.asarray(a) for a in H.training_examples(tokens, lengths, hidden, K))
  loss0, ce0 = H.loss_fn(cfg, params, heads0, h, labels, mask)
  heads, hist = H.fit_heads(cfg, params, heads0, tokens, lengths, hidden, steps=120,
                            batch_size=128, progress=False)
  assert hist.shape == (120, K) and np.all(np.isfinite(hist))
  loss1, ce1 = H.loss_fn(cfg, params, heads, h, labels, mask)
  assert float(loss1) < 0.2 * float(loss0), (loss0, loss1)
  assert np.all(np.asarray(ce1) < 0.5 * np.asarray(ce0)), (ce0, ce1)
  assert np.all(hist[-10:].mean(0) < hist[:5].mean(0))
  acc = H.head_accuracy(cfg, params, heads, tokens, lengths, hidden)
  assert acc.shape == (K,) and np.all(acc > 0.5), acc  # chance is 1/16
  # held-out rollouts (new tokens, same rule) are predicted too: it learned the rule
  acc = H.head_accuracy(cfg, params, heads, *_synthetic(cfg, seed=99, b=8))
  assert np.all(acc > 0.5), acc
  assert heads.num_heads == K and heads.vocab_size == VOCAB


def test_fit_heads_rejects_bad_inputs(model):
  cfg, params = model
  tokens, lengths, hidden = _synthetic(cfg, b=2, m=6)
  heads = H.init(jax.random.PRNGKey(0), cfg, K)
  with pytest.raises(ValueError, match="steps"):
    H.fit_heads(cfg, params, heads, tokens, lengths, hidden, steps=0, progress=False)
  with pytest.raises(ValueError, match="no anchor"):
    H.fit_heads(cfg, params, heads, tokens, np.ones(2, np.int32), hidden, steps=1,
                progress=False)
  with pytest.raises(ValueError, match="vocab"):
    H.fit_heads(cfg, params, H.init(jax.random.PRNGKey(0), cfg.replace(vocab_size=65), K),
                tokens, lengths, hidden, steps=1, progress=False)


def test_save_load_roundtrip(tmp_path):
  import jax

  from specroll_jax import heads as H
  from specroll_jax import models
  config = models.ModelConfig.tiny(vocab_size=64)
  hd = H.init(jax.random.key(3), config, 3, scale=0.1)
  H.save(tmp_path / "h.safetensors", hd)
  back = H.load(tmp_path / "h.safetensors")
  assert back.vocab_size == hd.vocab_size and back.num_heads == 3
  chex.assert_trees_all_equal(hd, back)


def test_load_rejects_a_file_that_is_not_heads(tmp_path):
  from safetensors.numpy import save_file
  save_file({"w": np.zeros((1, 2, 2), np.float32)}, str(tmp_path / "x.safetensors"))
  with pytest.raises(ValueError, match="not a heads file"):
    H.load(tmp_path / "x.safetensors")
