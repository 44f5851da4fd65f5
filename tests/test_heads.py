"""Future-token heads: zero init is exactly the target's own logits, a residual block computed by
hand, validation messages, self-distillation labels, the loss and its first fit steps derived by
hand on a fixed batch, a fit that learns a synthetic task, and a bit-exact save/load."""

import math
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax.heads import medusa as H
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
  # SiLU(0) = 0: every head's state is h, so its logits are the target's own: bit for bit
  # against the same (jitted) final norm and unembedding of h stacked K times (the same matmul
  # shapes), and up to float rounding against the unstacked [.., D] matmul
  stacked = jnp.broadcast_to(h[..., None, :], h.shape[:-1] + (K, cfg.hidden_size))
  own = jax.jit(logits_from_hidden, static_argnums=0)(cfg, params, stacked)
  np.testing.assert_array_equal(out, np.asarray(own))
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


def test_residual_block_by_hand():
  """z_k = h + SiLU(RMSNorm_k(h) W_k + b_k) on D = 2, then the shared final norm and unembedding.
  Head 1: g = [2, 0.5], W = [[1, 1], [0, 2]] ([in, out]), b = [-2, 0]; head 2: zero W and b.
    h = [1, -1]: RMSNorm -> [2, -0.5]; @ W -> [2, 1]; + b -> [0, 1]; z = [1, -1 + sigmoid(1)]
    h = [3, 3]:  RMSNorm -> [2, 0.5];  @ W -> [2, 3]; + b -> [0, 3]; z = [3, 3 + 3 sigmoid(3)]
  (SiLU(x) = x sigmoid(x)); head 2 is the identity. The RMSNorm's eps = 1e-6 moves these by
  under 1e-6."""
  sig = lambda x: 1 / (1 + math.exp(-x))
  cfg = ModelConfig.tiny(vocab_size=3, hidden_size=2, num_heads=1, num_kv_heads=1, head_dim=2)
  heads = H.Heads(norm=jnp.array([[2.0, 0.5], [1.0, 1.0]]),
                  w=jnp.array([[[1.0, 1.0], [0.0, 2.0]], [[0.0, 0.0], [0.0, 0.0]]]),
                  b=jnp.array([[-2.0, 0.0], [0.0, 0.0]]), vocab_size=3)
  h = jnp.array([[1.0, -1.0], [3.0, 3.0]])
  z = np.asarray(H.head_states(cfg, heads, h))  # [2 rows, 2 heads, D]
  want = np.array([[[1.0, -1.0 + sig(1)], [1.0, -1.0]], [[3.0, 3.0 + 3 * sig(3)], [3.0, 3.0]]])
  np.testing.assert_allclose(z, want, rtol=0, atol=1e-6)
  # logits through the target's final norm (unit scale) and tied unembedding E [V, D]:
  # logits_k[v] = (z_k / rms(z_k)) . E[v]
  emb = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, -1.0]], np.float32)
  params = {"embed": {"embedding": jnp.asarray(emb)},
            "final_norm": {"scale": jnp.ones((2,), jnp.float32)}}
  logits = np.asarray(H.apply(cfg, params, heads, h))
  assert logits.shape == (2, 2, 3)
  unit = want / np.sqrt((want ** 2).mean(-1, keepdims=True))
  np.testing.assert_allclose(logits, unit @ emb.T, rtol=0, atol=2e-6)
  # the identity head's logits are the target's own
  np.testing.assert_allclose(logits[:, 1], np.asarray(logits_from_hidden(cfg, params, h)),
                             rtol=1e-6, atol=1e-6)


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
  # and matching heads are usable as they are: K heads of logits over the model's vocab, at
  # zero init the target's own (bit for bit on h stacked K times)
  h = jax.random.normal(jax.random.PRNGKey(3), (1, cfg.hidden_size))
  out = np.asarray(H.apply(cfg, params, heads, h))
  assert out.shape == (1, K, VOCAB)
  stacked = jnp.broadcast_to(h[:, None], (1, K, cfg.hidden_size))
  np.testing.assert_array_equal(out, np.asarray(logits_from_hidden(cfg, params, stacked)))


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
  # the loss is the per-head CE weighted 0.8^(k-1), normalised: [1, 0.8, 0.64] / 2.44
  np.testing.assert_allclose(float(loss0), np.dot([1, 0.8, 0.64], ce0) / 2.44, rtol=1e-6)
  heads, hist = H.fit_heads(cfg, params, heads0, tokens, lengths, hidden, steps=120,
                            batch_size=128, progress=False)
  assert hist.shape == (120, K) and np.all(np.isfinite(hist))
  loss1, ce1 = H.loss_fn(cfg, params, heads, h, labels, mask)
  assert float(loss1) < 0.2 * float(loss0), (loss0, loss1)
  assert np.all(np.asarray(ce1) < 0.5 * np.asarray(ce0)), (ce0, ce1)
  # tokens are uniform over 16 ids: a head that ignored h could not beat CE = log 16; these
  # read the next tokens off h
  assert np.all(np.asarray(ce1) < 0.1 * math.log(16)), ce1
  assert np.all(hist[-10:].mean(0) < hist[:5].mean(0))
  # the history is the CE of the heads on their training batches (128 of these 580 anchors):
  # its first row that of the zero-init heads, its last rows that of the fitted ones
  np.testing.assert_allclose(hist[0], ce0, rtol=0.1)
  np.testing.assert_allclose(hist[-10:].mean(0), ce1, rtol=0.5)
  acc = H.head_accuracy(cfg, params, heads, tokens, lengths, hidden)
  assert acc.shape == (K,) and np.all(acc > 0.5), acc  # chance is 1/16
  # held-out rollouts (new tokens, same rule) are predicted too: it learned the rule
  acc = H.head_accuracy(cfg, params, heads, *_synthetic(cfg, seed=99, b=8))
  assert np.all(acc > 0.5), acc
  assert heads.num_heads == K and heads.vocab_size == VOCAB


def test_fit_heads_on_a_fixed_batch(model):
  """One rollout of length 2 has a single anchor (j = 0) with a label for head 1 only (token 1):
  every step reads that same batch. Step 0's CE is the target's own on it (zero init), computed
  here in float64; it falls at every step; heads 2 and 3 have no label, so a zero gradient and a
  zero Adam step: their history is 0 and they come back bit for bit; the loss is head 1's CE x
  1 / 2.44. Adam's first step moves every W and b entry of head 1 by the learning rate 1e-2
  (|g| / (|g| + 1e-8)) and leaves its norm scale alone (zero W: no gradient reaches it)."""
  cfg, params = model
  tokens = np.array([[5, 9, 3, 1]], np.int32)
  lengths = np.array([2], np.int32)
  hidden = np.random.default_rng(0).normal(size=(1, 4, cfg.hidden_size)).astype(np.float32)
  heads0 = H.init(jax.random.PRNGKey(1), cfg, K)
  h, labels, mask = H.training_examples(tokens, lengths, hidden, K)
  assert labels[0, 0] == 9 and mask.tolist() == [[True, False, False]]
  logits = np.asarray(logits_from_hidden(cfg, params, jnp.asarray(hidden[0, 0])), np.float64)
  ce_by_hand = np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[9]
  heads, hist = H.fit_heads(cfg, params, heads0, tokens, lengths, hidden, steps=20,
                            batch_size=8, progress=False)
  np.testing.assert_allclose(hist[0, 0], ce_by_hand, rtol=1e-6)
  assert np.all(np.diff(hist[:, 0]) < 0), hist[:, 0]
  np.testing.assert_array_equal(hist[:, 1:], 0.0)
  for f in ("norm", "w", "b"):
    new, old = np.asarray(getattr(heads, f)), np.asarray(getattr(heads0, f))
    assert new[1:].tobytes() == old[1:].tobytes(), f
    assert not np.array_equal(new[0], old[0]), f
  loss, ce = H.loss_fn(cfg, params, heads, *(jnp.asarray(a) for a in (h, labels, mask)))
  assert float(ce[0]) < hist[-1, 0]  # after the last step
  np.testing.assert_array_equal(np.asarray(ce[1:]), 0.0)
  np.testing.assert_allclose(float(loss), float(ce[0]) / 2.44, rtol=1e-6)
  one, _ = H.fit_heads(cfg, params, heads0, tokens, lengths, hidden, steps=1, batch_size=8,
                       progress=False)
  np.testing.assert_array_equal(np.asarray(one.norm), np.asarray(heads0.norm))
  for f in ("w", "b"):
    step = np.abs(np.asarray(getattr(one, f))[0] - np.asarray(getattr(heads0, f))[0])
    assert step.max() <= 1e-2 * (1 + 1e-6) and np.median(step) > 1e-2 * (1 - 1e-4), f


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_roundtrip(tmp_path, dtype):
  config = ModelConfig.tiny(vocab_size=64, dtype=dtype)
  hd = H.init(jax.random.key(3), config, 3, scale=0.1)
  hd = hd.replace(b=hd.b.at[0, 0].set(-0.0))  # a signed zero survives too
  H.save(tmp_path / "h.safetensors", hd)
  assert os.listdir(tmp_path) == ["h.safetensors"]  # written under a temporary name, renamed
  back = H.load(tmp_path / "h.safetensors")
  assert back.vocab_size == hd.vocab_size and back.num_heads == 3
  chex.assert_trees_all_equal(hd, back)
  for f in ("norm", "w", "b"):  # bit for bit, in the heads' own dtype
    a, b = getattr(hd, f), getattr(back, f)
    assert a.dtype == b.dtype == config.jnp_dtype and a.shape == b.shape, f
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f
  # the loaded heads compute what the saved ones did
  h = jax.random.normal(jax.random.key(4), (5, config.hidden_size), config.jnp_dtype)
  np.testing.assert_array_equal(np.asarray(H.head_states(config, back, h)),
                                np.asarray(H.head_states(config, hd, h)))


def test_load_rejects_a_file_that_is_not_heads(tmp_path):
  from safetensors.numpy import save_file
  save_file({"w": np.zeros((1, 2, 2), np.float32)}, str(tmp_path / "x.safetensors"))
  with pytest.raises(ValueError, match="not a heads file"):
    H.load(tmp_path / "x.safetensors")
