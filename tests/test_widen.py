"""The cost-faithful widening: the embedded model inside a bigger shape keeps its logits, hidden
states, sampled tokens and heads' proposals; byte accounting against the published Qwen2.5 shapes;
bad shapes refused."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specroll_jax
from app.widen import (
  QWEN25_SHAPES,
  WideShape,
  byte_count,
  widen,
  widen_heads,
  widened_config,
)
from specroll_jax import models, rollout
from specroll_jax.data import gsm8k
from specroll_jax.heads import conditioned as cond_heads
from specroll_jax.heads import medusa as heads
from specroll_jax.models import decoder
from specroll_jax.models.tokenizer import Tokenizer
from specroll_jax.sampling import SamplingConfig

ASSET = Path(specroll_jax.__file__).parent / "assets" / "gsm8k-tiny"
# A head_dim change (64 -> 128, sqrt(2) on q, rope_theta squared) and one without (64, a hidden
# ratio of 4/3); both with more layers, q heads, KV heads and FFN columns than the source.
SHAPES = {"dh128": WideShape(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2,
                             head_dim=128, intermediate_size=1024),
          "dh64": WideShape(hidden_size=256, num_layers=5, num_heads=8, num_kv_heads=2,
                            head_dim=64, intermediate_size=768)}
# Bounds relative to the largest |value|: the factors sqrt(D / D') and sqrt(Dh' / Dh) round in f32
# (one ulp on each norm scale and q weight), which is the f32 floor: on these prompts the source's
# own eager and jitted forwards differ by 1.0e-6 of max |logit| (2.0e-5 at 20), as does a one-ulp
# perturbation of its weights (up to 0.9e-6); the widenings measure 1.0e-6 and 0.65e-6.
LOGIT_RTOL = 2e-6
HIDDEN_RTOL = 1e-6


@pytest.fixture(scope="module")
def source():
  config, params = models.load_pretrained(ASSET)
  tok = Tokenizer.from_pretrained(ASSET)
  prompts = [tok.encode(gsm8k.format_prompt(e.question)) for e in gsm8k.load("test")[:4]]
  return (config, params, heads.load(ASSET / "heads.safetensors"),
          cond_heads.load(ASSET / "cond_heads.safetensors"), prompts)


@pytest.fixture(scope="module")
def tokens(source):
  prompts = source[-1]
  t = min(len(p) for p in prompts)
  return jnp.asarray([p[:t] for p in prompts], jnp.int32)


def _forward(config, params, tokens):
  b, t = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return jax.jit(decoder.step, static_argnums=0)(config, params, tokens, pos)


@pytest.fixture(scope="module")
def small_out(source, tokens):
  return _forward(source[0], source[1], tokens)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def wide(request, source, tokens):
  """(name, big config, big params, big Medusa heads, big CondHeads, big forward output)."""
  config, params, mh, ch, _ = source
  big, bp, bmh = widen(config, params, SHAPES[request.param], key=jax.random.key(7), heads=mh)
  bch = widen_heads(config, big, ch, key=jax.random.key(8))
  return request.param, big, bp, bmh, bch, _forward(big, bp, tokens)


def test_config_and_rope(source, wide):
  config, shape, big = source[0], SHAPES[wide[0]], wide[1]
  assert (big.hidden_size, big.num_layers, big.num_heads, big.num_kv_heads, big.head_dim,
          big.intermediate_size) == (shape.hidden_size, shape.num_layers, shape.num_heads,
                                     shape.num_kv_heads, shape.head_dim, shape.intermediate_size)
  assert big.vocab_size == config.vocab_size and big.tie_word_embeddings
  r = config.hidden_size / shape.hidden_size
  assert big.rms_norm_eps == pytest.approx(config.rms_norm_eps * r, rel=1e-15)
  half = config.head_dim // 2
  np.testing.assert_allclose(decoder._inv_freq(big)[:half], decoder._inv_freq(config), rtol=1e-6)


def test_param_tree_is_the_decoders(wide):
  _, big, bp = wide[:3]
  want = jax.eval_shape(functools.partial(decoder.init_params, config=big), jax.random.key(0))
  got = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), bp)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert jax.tree.leaves(got) == jax.tree.leaves(want)


def test_dead_units(source, wide):
  """Extra layers add nothing (zero o_proj / down_proj) but read random weights at a real init's
  scale; the residual stream's padded dims are zero."""
  config, (_, big, bp) = source[0], wide[:3]
  lay = bp["layers"]
  real = [i * big.num_layers // config.num_layers for i in range(config.num_layers)]
  extra = sorted(set(range(big.num_layers)) - set(real))
  assert extra
  for i in extra:
    assert not jnp.any(lay["o_proj"]["kernel"][i]) and not jnp.any(lay["down_proj"]["kernel"][i])
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
      assert float(jnp.std(lay[name]["kernel"][i])) == pytest.approx(0.02, rel=0.05)
  ds = config.hidden_size
  assert not jnp.any(bp["embed"]["embedding"][:, ds:])
  assert not jnp.any(lay["o_proj"]["kernel"][..., ds:])
  assert not jnp.any(lay["down_proj"]["kernel"][..., ds:])


def test_forward_logits_and_hidden(source, small_out, wide):
  name, big, _, _, _, out = wide
  ds = source[0].hidden_size
  diff = float(jnp.abs(out.logits - small_out.logits).max())
  scale = float(jnp.abs(small_out.logits).max())
  print(f"{name}: max |logit diff| {diff:.3g} at max |logit| {scale:.3g}")
  assert diff <= LOGIT_RTOL * scale
  h = np.asarray(small_out.hidden)
  np.testing.assert_allclose(out.hidden[..., :ds], h, rtol=0,
                             atol=HIDDEN_RTOL * np.abs(h).max())
  assert not jnp.any(out.hidden[..., ds:])


def test_generate_same_tokens(source, wide):
  config, params, _, _, prompts = source
  _, big, bp = wide[:3]
  # One row bucket: a single decode loop to compile per model (a token's noise depends on seed,
  # sample id, position and token only, not on the buckets).
  run = lambda c, p: rollout.generate(c, p, prompts, max_new_tokens=16,
                                      sampling=SamplingConfig(temperature=1.0), seed=0,
                                      options=rollout.DecodeOptions(bucket_fractions=(1.0,)))
  a, b = run(config, params), run(big, bp)
  np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(a.tokens))
  np.testing.assert_array_equal(np.asarray(b.lengths), np.asarray(a.lengths))


def test_heads_propose_the_same(source, tokens, small_out, wide):
  config, params, mh, ch, _ = source
  _, big, bp, bmh, bch, out = wide
  assert bmh.hidden_size == big.hidden_size and bch.hidden_size == big.hidden_size
  assert bch.width >= ch.width
  apply = jax.jit(heads.apply, static_argnums=0)
  a, b = apply(config, params, mh, small_out.hidden), apply(big, bp, bmh, out.hidden)
  assert float(jnp.abs(a - b).max()) <= LOGIT_RTOL * float(jnp.abs(a).max())
  np.testing.assert_array_equal(jnp.argmax(b, -1), jnp.argmax(a, -1))
  k = ch.num_heads
  t = tokens.shape[1]
  ctx = tokens[:, np.minimum(np.arange(t)[:, None] + np.arange(k)[None], t - 1)]  # [B, T, K]
  apply = jax.jit(cond_heads.apply, static_argnums=0)
  a, b = apply(config, params, ch, small_out.hidden, ctx), apply(big, bp, bch, out.hidden, ctx)
  assert float(jnp.abs(a - b).max()) <= LOGIT_RTOL * float(jnp.abs(a).max())
  np.testing.assert_array_equal(jnp.argmax(b, -1), jnp.argmax(a, -1))


# --- byte accounting --------------------------------------------------------------------------

# The Qwen2.5 base models' config.json (hidden, layers, q heads, kv heads, head_dim, FFN, vocab,
# tied) and their parameter counts (model cards: 0.49B / 1.54B / 7.61B).
PUBLISHED = {"0.5b": (896, 24, 14, 2, 64, 4864, 151936, True, 494_032_768),
             "1.5b": (1536, 28, 12, 2, 128, 8960, 151936, True, 1_543_714_304),
             "7b": (3584, 28, 28, 4, 128, 18944, 152064, False, 7_615_616_512)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_bytes_match_the_real_shape(source, name):
  d, ly, h, kv, dh, f, v, tied, n_params = PUBLISHED[name]
  bf16 = 2
  attn = d * h * dh + 2 * d * kv * dh + h * dh * d + (h * dh + 2 * kv * dh)  # q k v o + biases
  body = bf16 * (ly * (attn + 3 * d * f + 2 * d) + d)
  kv_per_token = bf16 * 2 * ly * kv * dh
  vocab = bf16 * v * d * (1 if tied else 2)
  assert (body + vocab) // bf16 == n_params
  big = widened_config(source[0], QWEN25_SHAPES[name], dtype="bfloat16")
  got = byte_count(big)
  assert (got.body, got.kv_per_token) == (body, kv_per_token)
  assert got.vocab == bf16 * 2048 * d * (1 if tied else 2)
  real = byte_count(QWEN25_SHAPES[name].real_config())
  assert (real.body, real.kv_per_token, real.vocab) == (body, kv_per_token, vocab)
  assert byte_count(big, "float32").body == 2 * body


def test_widened_real_shapes_have_the_decoders_tree(source):
  """The real shapes' parameter trees, abstractly (nothing is allocated)."""
  config, params = source[:2]
  for shape in QWEN25_SHAPES.values():
    got = jax.eval_shape(
        lambda s=shape: widen(config, params, s, key=jax.random.key(0), dtype="bfloat16")[1])
    big = widened_config(config, shape, dtype="bfloat16")
    want = jax.eval_shape(functools.partial(decoder.init_params, config=big), jax.random.key(0))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert jax.tree.leaves(got) == jax.tree.leaves(want)


# --- bad input --------------------------------------------------------------------------------

BASE = dict(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=128,
            intermediate_size=1024)


@pytest.mark.parametrize("field, value, match", [
    ("hidden_size", 128, "hidden_size = 128 is smaller"),
    ("num_layers", 3, "num_layers = 3 is smaller"),
    ("num_heads", 2, "num_heads = 2 is smaller"),
    ("head_dim", 32, "head_dim = 32 is smaller"),
    ("intermediate_size", 256, "intermediate_size = 256 is smaller"),
    ("num_kv_heads", 3, "group size num_heads / num_kv_heads = 2 is smaller than the source's 3"),
])
def test_shape_smaller_than_source(source, field, value, match):
  with pytest.raises(ValueError, match=match):
    widened_config(source[0], WideShape(**{**BASE, field: value}))


@pytest.mark.parametrize("kw, match", [
    (dict(num_heads=7), r"num_heads \(7\) must be a multiple of num_kv_heads \(2\)"),
    (dict(head_dim=127), "head_dim must be even"),
    (dict(hidden_size=0), "WideShape.hidden_size must be an int >= 1, got 0"),
    (dict(vocab_size=-1), "WideShape.vocab_size must be None or an int >= 1, got -1"),
])
def test_bad_shape(kw, match):
  with pytest.raises(ValueError, match=match):
    WideShape(**{**BASE, **kw})


def test_bad_arguments(source):
  config, params, mh, ch, _ = source
  shape = WideShape(**BASE)
  with pytest.raises(ValueError, match="shape must be a WideShape"):
    widened_config(config, config)
  with pytest.raises(ValueError, match="dtype must be one of"):
    widened_config(config, shape, dtype="float64")
  with pytest.raises(ValueError, match="source's unembedding is untied"):
    widened_config(config.replace(tie_word_embeddings=False), shape)
  with pytest.raises(ValueError, match="scale must be a finite number > 0, got 0.0"):
    widen(config, params, shape, key=jax.random.key(0), scale=0.0)
  with pytest.raises(ValueError, match="heads must be a heads.Heads or cond_heads.CondHeads"):
    widen(config, params, shape, key=jax.random.key(0), heads=object())
  with pytest.raises(ValueError, match="unstacked"):
    widen(config, decoder.unstack_layers(params), shape, key=jax.random.key(0))
  big = widened_config(config, shape)
  with pytest.raises(ValueError, match=rf"width must be an int >= {ch.width}, got 8"):
    widen_heads(config, big, ch, key=jax.random.key(0), width=8)
  with pytest.raises(ValueError, match="width applies to CondHeads only"):
    widen_heads(config, big, mh, key=jax.random.key(0), width=512)
  with pytest.raises(ValueError, match="real_config needs the real vocabulary"):
    shape.real_config()
  with pytest.raises(ValueError, match="dtype must be one of"):
    byte_count(config, "int8")
