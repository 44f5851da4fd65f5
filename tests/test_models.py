"""Decoder equivalences (cached decode, tree step == full forward) and checkpoint I/O, pure JAX."""

import functools
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specroll_jax.models import (
    ModelConfig,
    forward,
    init_cache,
    init_params,
    load_pretrained,
    prefill,
    save_pretrained,
    step,
    write_cache,
)

VOCAB = 97
_LLAMA3 = tuple(sorted({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64.0}.items()))
CONFIGS = {
    # Qwen2: untied embeddings, q/k/v biases, GQA 2 (d 64, ffn 128, 2x16 kv).
    "qwen2": ModelConfig.tiny(vocab_size=VOCAB, tie_word_embeddings=False, bos_token_id=1,
                              eos_token_ids=(5,)),
    # Llama-3: tied, no biases, GQA 4, llama3 rope scaling.
    "llama3": ModelConfig.tiny(vocab_size=VOCAB, architecture="llama", qkv_bias=False,
                               tie_word_embeddings=True, num_kv_heads=1, rope_theta=500000.0,
                               rope_scaling=_LLAMA3, rms_norm_eps=1e-5, eos_token_ids=(5, 7)),
}

# Same-shape computations are bit-exact; these compare different forward shapes (cached decode vs
# one causal pass, tree step vs per-path pass), whose f32 reduction orders differ (max seen ~3e-6).
ATOL = 1e-5

# Shared shapes so each jitted function compiles once per config: B rows, prompts padded to T0,
# caches of MAX_LEN slots, reference forwards on [FULL_B, FULL_T].
B, T0, MAX_LEN, FULL_B, FULL_T = 4, 8, 24, 32, 24

_step = jax.jit(step, static_argnums=0)
_prefill = jax.jit(prefill, static_argnums=0)
_forward = jax.jit(forward, static_argnums=0)
_write_cache = jax.jit(write_cache)


@functools.partial(jax.jit, static_argnums=0)
def _perturbed_params_jit(config: ModelConfig, key):
  k_init, k_noise = jax.random.split(key)
  params = init_params(k_init, config)
  leaves, treedef = jax.tree.flatten_with_path(params)
  keys = jax.random.split(k_noise, len(leaves))
  out = []
  for (path, leaf), k in zip(leaves, keys, strict=True):
    name = jax.tree_util.keystr(path)
    scale = 0.3 if ("bias" in name or "scale" in name) else 0.1
    noise = scale * jax.random.normal(k, leaf.shape, jnp.float32)
    out.append((leaf.astype(jnp.float32) + noise).astype(leaf.dtype))
  return jax.tree.unflatten(treedef, out)


def _perturbed_params(config: ModelConfig, seed: int):
  """init_params has unit norms and zero biases: add noise to every leaf so their bugs show."""
  return _perturbed_params_jit(config, jax.random.key(seed))


def _garbage_cache(config: ModelConfig, batch: int, max_length: int, seed: int):
  """A cache whose every slot holds noise: only slots below ``lengths`` may influence outputs."""
  cache = init_cache(config, batch, max_length)
  kk, kv = jax.random.split(jax.random.key(seed))
  noise = lambda key, bufs: tuple(3.0 * jax.random.normal(jax.random.fold_in(key, i), x.shape,
                                                         x.dtype) for i, x in enumerate(bufs))
  return cache.replace(k=noise(kk, cache.k), v=noise(kv, cache.v))


def _full(config, params, seqs):
  """Causal forward (cache=None) of ragged sequences, right padded to one fixed [FULL_B, FULL_T]
  shape (so it compiles once): (logits, hidden) as numpy and the StepOutput."""
  assert len(seqs) <= FULL_B and max(len(s) for s in seqs) <= FULL_T
  tokens = np.zeros((FULL_B, FULL_T), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  positions = jnp.broadcast_to(jnp.arange(FULL_T, dtype=jnp.int32), tokens.shape)
  out = _step(config, params, jnp.asarray(tokens), positions)
  return np.asarray(out.logits), np.asarray(out.hidden), out


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
  config = CONFIGS[request.param]
  return config, _perturbed_params(config, seed=sorted(CONFIGS).index(request.param))


def _right_pad(prompts, t):
  tokens = np.zeros((len(prompts), t), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return jnp.asarray(tokens)


# --- (a) cached decode == full forward -----------------------------------------------------------


def test_cached_decode_matches_full_forward(model):
  config, params = model
  rng = np.random.default_rng(0)
  lengths = np.array([5, 1, 8, 3], np.int32)
  n_new = 6
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
  new = rng.integers(0, VOCAB, (len(lengths), n_new)).astype(np.int32)

  cache = _garbage_cache(config, B, MAX_LEN, seed=1)
  cache, logits0, hidden0 = _prefill(config, params, _right_pad(prompts, T0), jnp.asarray(lengths),
                                     cache)
  np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
  got_logits, got_hidden = [np.asarray(logits0)], [np.asarray(hidden0)]
  for j in range(n_new):
    pos = jnp.asarray(lengths + j)[:, None]
    out = _step(config, params, jnp.asarray(new[:, j:j + 1]), pos, cache)
    got_logits.append(np.asarray(out.logits[:, 0]))
    got_hidden.append(np.asarray(out.hidden[:, 0]))
    cache = _write_cache(cache, out.k_new, out.v_new, pos)
    cache = cache.replace(lengths=jnp.asarray(lengths + j + 1))
  got_logits, got_hidden = np.stack(got_logits, 1), np.stack(got_hidden, 1)  # [B, n_new + 1, .]

  seqs = [p + new[b].tolist() for b, p in enumerate(prompts)]
  ref_logits, ref_hidden, ref_out = _full(config, params, seqs)
  # forward() is step(cache=None) (a separate jit program, so fusion may differ in the last bit).
  np.testing.assert_allclose(
      np.asarray(_forward(config, params, _right_pad(seqs, T0 + n_new))),
      ref_logits[:B, :T0 + n_new], rtol=0, atol=ATOL)
  idx = lengths[:, None] - 1 + np.arange(n_new + 1)[None, :]
  rows = np.arange(len(lengths))[:, None]
  assert np.std(ref_logits[rows, idx]) > 0.5  # logits are O(1): the tolerance is meaningful
  np.testing.assert_allclose(got_logits, ref_logits[rows, idx], rtol=0, atol=ATOL)
  np.testing.assert_allclose(got_hidden, ref_hidden[rows, idx], rtol=0, atol=ATOL)
  # The cache now holds the full forward's K/V at every committed slot.
  ck, cv = cache.stacked()
  for b, n in enumerate(lengths + n_new):
    np.testing.assert_allclose(np.asarray(ck[:, b, :n]), np.asarray(ref_out.k_new[:, b, :n]),
                               rtol=0, atol=ATOL)
    np.testing.assert_allclose(np.asarray(cv[:, b, :n]), np.asarray(ref_out.v_new[:, b, :n]),
                               rtol=0, atol=ATOL)


def test_write_cache_drops_negative_and_out_of_range_slots(model):
  config, _ = model
  cache = _garbage_cache(config, 2, 4, seed=2)
  k_new = jnp.ones((config.num_layers, 2, 3, config.num_kv_heads, config.head_dim))
  slots = jnp.array([[0, -1, 4], [3, 2, -5]])
  out = _write_cache(cache, k_new, 2 * k_new, slots)
  k, k0 = np.asarray(out.stacked()[0]), np.asarray(cache.stacked()[0])
  np.testing.assert_array_equal(k[:, 0, 0], 1.0)
  np.testing.assert_array_equal(k[:, 0, 1:], k0[:, 0, 1:])
  np.testing.assert_array_equal(k[:, 1, 2:], 1.0)
  np.testing.assert_array_equal(k[:, 1, :2], k0[:, 1, :2])
  np.testing.assert_array_equal(np.asarray(out.stacked()[1][:, 1, 2:]), 2.0)
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(cache.lengths))


# --- (b) tree step == full forward along every root-to-node path ---------------------------------


def _random_tree(rng, n_nodes: int):
  """parents[0] = -1 (root); parents[i] < i. Returns (parents, depth, ancestor-or-self mask)."""
  while True:
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n_nodes)])
    depth = np.zeros(n_nodes, np.int32)
    mask = np.eye(n_nodes, dtype=bool)
    for i in range(1, n_nodes):
      depth[i] = depth[parents[i]] + 1
      mask[i] = mask[parents[i]]
      mask[i, i] = True
    # Want both branching and depth, so a wrong mask or position cannot pass by luck.
    if depth.max() >= 3 and np.bincount(parents[1:], minlength=n_nodes).max() >= 2:
      return parents, depth, mask


def _path(parents, i):
  out = []
  while i >= 0:
    out.append(i)
    i = parents[i]
  return out[::-1]


def test_tree_step_matches_forward_on_every_path(model):
  config, params = model
  rng = np.random.default_rng(1)
  lengths = np.array([6, 3, 1, 8], np.int32)
  n_nodes = 8  # root + 7 nodes; B * n_nodes paths == FULL_B
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
  trees = [_random_tree(rng, n_nodes) for _ in lengths]
  tree_tokens = rng.integers(0, VOCAB, (len(lengths), n_nodes)).astype(np.int32)

  cache = _garbage_cache(config, B, MAX_LEN, seed=3)
  cache, _, _ = _prefill(config, params, _right_pad(prompts, T0), jnp.asarray(lengths), cache)
  positions = np.stack([lengths[b] + trees[b][1] for b in range(len(lengths))]).astype(np.int32)
  mask = np.stack([t[2] for t in trees])
  out = _step(config, params, jnp.asarray(tree_tokens), jnp.asarray(positions), cache,
              jnp.asarray(mask))

  seqs, where = [], []
  for b, (parents, _, _) in enumerate(trees):
    for i in range(n_nodes):
      seqs.append(prompts[b] + tree_tokens[b, _path(parents, i)].tolist())
      where.append((b, i))
  ref_logits, ref_hidden, _ = _full(config, params, seqs)
  last = np.array([len(s) - 1 for s in seqs])
  ref_logits = ref_logits[np.arange(len(seqs)), last]
  ref_hidden = ref_hidden[np.arange(len(seqs)), last]
  bs, ns = np.array(where).T
  np.testing.assert_allclose(np.asarray(out.logits)[bs, ns], ref_logits, rtol=0, atol=ATOL)
  np.testing.assert_allclose(np.asarray(out.hidden)[bs, ns], ref_hidden, rtol=0, atol=ATOL)

  # Commit the path to each row's deepest node (other nodes dropped with slot -1), then decode one
  # more token: == forward on prompt + path + token.
  accepted = [_path(t[0], int(np.argmax(t[1]))) for t in trees]
  slots = np.full((len(lengths), n_nodes), -1, np.int32)
  for b, path in enumerate(accepted):
    slots[b, path] = lengths[b] + trees[b][1][path]
  committed = _write_cache(cache, out.k_new, out.v_new, jnp.asarray(slots))
  new_len = lengths + np.array([len(p) for p in accepted], np.int32)
  committed = committed.replace(lengths=jnp.asarray(new_len))
  nxt = rng.integers(0, VOCAB, (len(lengths), 1)).astype(np.int32)
  out2 = _step(config, params, jnp.asarray(nxt), jnp.asarray(new_len)[:, None], committed)
  seqs2 = [prompts[b] + tree_tokens[b, p].tolist() + nxt[b].tolist()
           for b, p in enumerate(accepted)]
  ref2, _, _ = _full(config, params, seqs2)
  np.testing.assert_allclose(np.asarray(out2.logits[:, 0]),
                             ref2[np.arange(len(seqs2)), [len(s) - 1 for s in seqs2]],
                             rtol=0, atol=ATOL)


# --- (c) save_pretrained -> load_pretrained is bit-exact -----------------------------------------

ROUND_TRIP = {  # the f32 ones are CONFIGS (already compiled)
    "f32_untied_qwen2": CONFIGS["qwen2"],
    "f32_tied_llama3": CONFIGS["llama3"],
    "bf16_untied_qwen2": CONFIGS["qwen2"].replace(dtype="bfloat16"),
    "bf16_tied_llama3": CONFIGS["llama3"].replace(dtype="bfloat16"),
}


def _bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_save_load_round_trip_is_bit_exact(name, tmp_path):
  config = ROUND_TRIP[name]
  # Cast the f32 params (compiled once per CONFIGS entry) rather than compiling a bf16 init.
  params = jax.tree.map(lambda x: x.astype(config.jnp_dtype),
                        _perturbed_params(config.replace(dtype="float32"), seed=7))
  save_pretrained(tmp_path, config, params)
  save_pretrained(tmp_path, config, params)  # overwriting an existing checkpoint works
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
  names = set(load_file(tmp_path / "model.safetensors").keys()) if config.dtype == "float32" \
      else None
  if names is not None:
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    assert any(n.endswith("q_proj.bias") for n in names) == config.qkv_bias
  loaded_config, loaded = load_pretrained(tmp_path)
  assert loaded_config == config
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  for (path, a), b in zip(jax.tree.leaves_with_path(params), jax.tree.leaves(loaded),
                          strict=True):
    assert a.dtype == b.dtype == config.jnp_dtype, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=jax.tree_util.keystr(path))


def test_to_hf_dict_rejects_configs_transformers_cannot_express():
  with pytest.raises(ValueError, match=r"'qwen2' with qkv_bias=False"):
    ModelConfig.tiny(qkv_bias=False).to_hf_dict()
  with pytest.raises(ValueError, match=r"'llama' with qkv_bias=True"):
    ModelConfig.tiny(architecture="llama", qkv_bias=True).to_hf_dict()


# --- (d) bad checkpoints raise ValueError naming what is wrong -----------------------------------

BAD_CONFIG = CONFIGS["qwen2"]  # untied, with biases: every kind of tensor can go missing


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("good")
  save_pretrained(path, BAD_CONFIG, _perturbed_params(BAD_CONFIG, seed=11))
  return path


@pytest.fixture
def ckpt(good_checkpoint, tmp_path):
  """A fresh, writable copy of the good checkpoint."""
  path = tmp_path / "ckpt"
  shutil.copytree(good_checkpoint, path)
  return path


def _edit_config(path, **changes):
  d = json.loads((path / "config.json").read_text())
  for k, v in changes.items():
    if v is None:
      d.pop(k, None)
    else:
      d[k] = v
  (path / "config.json").write_text(json.dumps(d))


def _edit_tensors(path, fn):
  tensors = load_file(path / "model.safetensors")
  fn(tensors)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _shard(path, missing_shard: bool = False):
  """Split model.safetensors into two shards + an index (as transformers does); drop the single
  file."""
  tensors = load_file(path / "model.safetensors")
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
  weight_map = {}
  for shard, shard_names in shards.items():
    save_file({n: tensors[n] for n in shard_names}, path / shard, metadata={"format": "pt"})
    weight_map.update({n: shard for n in shard_names})
  (path / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
       "weight_map": weight_map}))
  (path / "model.safetensors").unlink()
  if missing_shard:
    (path / "model-00002-of-00002.safetensors").unlink()


def test_sharded_checkpoint_loads_identically(good_checkpoint, ckpt):
  config, params = load_pretrained(good_checkpoint)
  _shard(ckpt)
  assert not (ckpt / "model.safetensors").exists()
  config2, params2 = load_pretrained(ckpt)
  assert config2 == config
  assert jax.tree.structure(params2) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_missing_folder(tmp_path):
  path = tmp_path / "nope"
  with pytest.raises(ValueError, match=re.escape(f"{path / 'config.json'}: config.json not found")):
    load_pretrained(path)


def test_missing_config_json(ckpt):
  (ckpt / "config.json").unlink()
  with pytest.raises(ValueError, match=re.escape(f"{ckpt / 'config.json'}: config.json not found")):
    load_pretrained(ckpt)


def test_missing_safetensors(ckpt):
  (ckpt / "model.safetensors").unlink()
  with pytest.raises(ValueError, match=re.escape(
      f"{ckpt}: no model.safetensors or model.safetensors.index.json found")):
    load_pretrained(ckpt)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_safetensors_names_the_file(ckpt, damage):
  f = ckpt / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00not a safetensors file" * 9,
                 "empty": b""}[damage])
  with pytest.raises(ValueError, match=re.escape(str(f))):
    load_pretrained(ckpt)


def test_unknown_architecture(ckpt):
  _edit_config(ckpt, architectures=["GPT2LMHeadModel"], model_type="gpt2")
  with pytest.raises(ValueError, match=re.escape(
      f"{ckpt / 'config.json'}: unknown architecture ['GPT2LMHeadModel']; expected one of "
      "['LlamaForCausalLM', 'Qwen2ForCausalLM']")):
    load_pretrained(ckpt)


def test_missing_required_config_field(ckpt):
  _edit_config(ckpt, hidden_size=None)
  with pytest.raises(ValueError, match=r"config\.json: missing required field 'hidden_size'"):
    load_pretrained(ckpt)


def test_unsupported_dtype(ckpt):
  _edit_config(ckpt, dtype="float64")
  with pytest.raises(ValueError, match=r"config\.json: unsupported dtype 'float64'; expected one"):
    load_pretrained(ckpt)


def test_unsupported_rope_scaling_type(ckpt):
  _edit_config(ckpt, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 512})
  with pytest.raises(ValueError, match=re.escape(
      f"{ckpt / 'config.json'}: unsupported rope scaling type 'yarn'; supported: 'default', "
      "'llama3'")):
    load_pretrained(ckpt)


def test_unsupported_rope_scaling_type_old_style(ckpt):
  _edit_config(ckpt, rope_parameters=None, rope_theta=10000.0,
               rope_scaling={"type": "dynamic", "factor": 2.0})
  with pytest.raises(ValueError, match=r"unsupported rope scaling type 'dynamic'"):
    load_pretrained(ckpt)


def test_llama3_scaling_missing_field(ckpt):
  _edit_config(ckpt, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0})
  with pytest.raises(ValueError, match=r"config\.json: rope_scaling of type 'llama3' lacks \["):
    load_pretrained(ckpt)


@pytest.mark.parametrize("name,shape", [
    ("model.layers.1.mlp.up_proj.weight", (128, 64)),
    ("model.layers.0.self_attn.k_proj.bias", (32,)),
    ("lm_head.weight", (VOCAB, 64)),
])
def test_missing_tensor(ckpt, name, shape):
  _edit_tensors(ckpt, lambda t: t.pop(name))
  with pytest.raises(ValueError, match=re.escape(
      f"{ckpt}: tensor {name!r} missing (expected shape {shape})")):
    load_pretrained(ckpt)


def test_missing_tensor_in_sharded_checkpoint(ckpt):
  _edit_tensors(ckpt, lambda t: t.pop("model.norm.weight"))
  _shard(ckpt)
  with pytest.raises(ValueError, match=re.escape("tensor 'model.norm.weight' missing")):
    load_pretrained(ckpt)


def test_wrong_tensor_shape(ckpt):
  name = "model.layers.0.self_attn.k_proj.weight"
  _edit_tensors(ckpt, lambda t: t.update({name: t[name][:16]}))
  with pytest.raises(ValueError, match=re.escape(
      f"{ckpt / 'model.safetensors'}: tensor {name!r} has shape (16, 64), expected (32, 64)")):
    load_pretrained(ckpt)


def test_sharded_index_pointing_at_missing_shard(ckpt):
  _shard(ckpt, missing_shard=True)
  with pytest.raises(ValueError, match=re.escape(
      f"{ckpt / 'model.safetensors.index.json'}: shard 'model-00002-of-00002.safetensors'")
      + r".* not found"):
    load_pretrained(ckpt)


def test_llama_attention_bias_rejected(ckpt):
  _edit_config(ckpt, architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True)
  with pytest.raises(ValueError, match=r"config\.json: unsupported Llama biases attention_bias=Tr"):
    load_pretrained(ckpt)
