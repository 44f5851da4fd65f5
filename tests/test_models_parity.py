"""Our Qwen2/Llama decoder == transformers on the same (perturbed, random) weights.

Each case builds a tiny random transformers model, perturbs every tensor (a fresh HF init has zero
biases and unit norms, which would hide bias/norm bugs), saves it with HF's ``save_pretrained``,
loads it with our ``load_pretrained`` and compares float32 logits on ragged, right-padded prompts.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specroll_jax.models import forward, load_pretrained  # noqa: E402

ATOL = 1e-4  # f32, different libraries and reduction orders (TOOLCHAIN.md "Float rounding")
VOCAB = 101
LENGTHS = (9, 4, 12, 1)  # ragged prompt lengths (right padded to max)

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}

# name -> (HF class name, config kwargs). Head dim 8 or 16; with head_dim 16 and theta 5e5 the
# llama3 scaling has high, medium and low frequency bands (wavelengths 6, 33, 168, ... vs 16..64).
CASES = {
    "qwen2_tied_mha_theta1e4": ("Qwen2", dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "qwen2_untied_gqa2_theta1e6": ("Qwen2", dict(
        hidden_size=32, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
        rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "qwen2_tied_gqa3_h6": ("Qwen2", dict(
        hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
        rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "llama_untied_mha_nobias": ("Llama", dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, rms_norm_eps=1e-5)),
    "llama_tied_gqa2_headdim16": ("Llama", dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rope_theta=1e6, tie_word_embeddings=True, attention_bias=False,
        rms_norm_eps=1e-6)),
    "llama_untied_gqa3_llama3_rope": ("Llama", dict(
        hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
        head_dim=16, rope_theta=500000.0, tie_word_embeddings=False, attention_bias=False,
        rms_norm_eps=1e-5, rope_scaling=dict(_LLAMA3), max_position_embeddings=512)),
}

_jit_forward = jax.jit(forward, static_argnums=0)


def _hf_model(kind: str, kwargs: dict, seed: int):
  cfg_cls = getattr(transformers, f"{kind}Config")
  model_cls = getattr(transformers, f"{kind}ForCausalLM")
  kw = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=256,
            attn_implementation="eager")
  kw.update(kwargs)
  torch.manual_seed(seed)
  model = model_cls(cfg_cls(**kw)).to(torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():  # tied lm_head is the embedding: perturbed once
      scale = 0.3 if name.endswith("bias") or "norm" in name else 0.1
      p.add_(scale * torch.randn_like(p))
  return model


def _prompts(seed: int):
  rng = np.random.default_rng(seed)
  t = max(LENGTHS)
  tokens = rng.integers(0, VOCAB, size=(len(LENGTHS), t)).astype(np.int32)
  valid = np.arange(t)[None, :] < np.asarray(LENGTHS)[:, None]
  return np.where(valid, tokens, 0).astype(np.int32), valid


def _hf_logits(model, tokens, valid):
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                attention_mask=torch.from_numpy(valid.astype(np.int64)))
  return out.logits.float().numpy()


def _max_err(model_dir, tokens, valid, ref):
  config, params = load_pretrained(model_dir)
  ours = np.asarray(_jit_forward(config, params, jnp.asarray(tokens)))
  assert ours.shape == ref.shape
  return config, float(np.max(np.abs(ours - ref)[valid]))


@pytest.fixture(scope="module", params=sorted(CASES))
def saved_case(request, tmp_path_factory):
  """(case name, HF model, checkpoint folder, tokens, valid mask, HF logits)."""
  name = request.param
  kind, kwargs = CASES[name]
  seed = sorted(CASES).index(name)
  model = _hf_model(kind, kwargs, seed)
  path = tmp_path_factory.mktemp(name)
  model.save_pretrained(str(path))
  tokens, valid = _prompts(seed)
  ref = _hf_logits(model, tokens, valid)
  assert np.isfinite(ref[valid]).all()
  return name, model, path, tokens, valid, ref


def test_hf_writes_transformers5_config(saved_case):
  """What the old-style test below rewrites really is what transformers 5 writes."""
  _, _, path, *_ = saved_case
  d = json.loads((path / "config.json").read_text())
  assert "rope_parameters" in d and "dtype" in d
  assert "rope_theta" not in d and "torch_dtype" not in d


def test_logits_match_transformers(saved_case):
  name, model, path, tokens, valid, ref = saved_case
  kind, kwargs = CASES[name]
  config, err = _max_err(path, tokens, valid, ref)
  # The loaded config is the HF one.
  assert config.architecture == kind.lower()
  assert config.num_heads == kwargs["num_attention_heads"]
  assert config.num_kv_heads == kwargs["num_key_value_heads"]
  assert config.rope_theta == kwargs["rope_theta"]
  assert config.rms_norm_eps == kwargs["rms_norm_eps"]
  assert config.tie_word_embeddings == kwargs["tie_word_embeddings"]
  assert config.qkv_bias == (kind == "Qwen2")
  assert (config.rope_scaling is not None) == ("rope_scaling" in kwargs)
  # Logits are O(1) and differ between prompts: a 1e-4 match is meaningful.
  assert float(np.std(ref[valid])) > 0.5
  assert err < ATOL, f"{name}: max |ours - HF| = {err:.3g}"


def test_logits_match_transformers_old_style_config(saved_case, tmp_path):
  """Older checkpoints: top-level ``rope_theta``/``torch_dtype`` (and ``rope_scaling``) instead of
  transformers-5 ``rope_parameters``/``dtype``."""
  name, model, path, tokens, valid, ref = saved_case
  d = json.loads((path / "config.json").read_text())
  rope = d.pop("rope_parameters")
  d["rope_theta"] = rope.pop("rope_theta")
  if rope.get("rope_type", "default") != "default":
    d["rope_scaling"] = rope
  d["torch_dtype"] = d.pop("dtype")
  d["transformers_version"] = "4.45.0"
  (tmp_path / "config.json").write_text(json.dumps(d, indent=2))
  (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
  config_new, _ = load_pretrained(path)
  config_old, err = _max_err(tmp_path, tokens, valid, ref)
  assert config_old == config_new
  assert err < ATOL, f"{name} (old-style config): max |ours - HF| = {err:.3g}"


def test_llama3_rope_scaling_old_style_type_key(tmp_path):
  """Some Llama-3.x configs spell the scaling type ``type`` rather than ``rope_type``."""
  d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8,
       "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
       "num_attention_heads": 2, "num_key_value_heads": 1, "rope_theta": 500000.0,
       "torch_dtype": "bfloat16",
       "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
  from specroll_jax.models import ModelConfig

  c = ModelConfig.from_hf_dict(d)
  assert c.dtype == "bfloat16" and c.rope_theta == 500000.0
  assert dict(c.rope_scaling) == {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192.0}


def test_llama_attention_bias_is_rejected(tmp_path):
  """transformers' Llama ``attention_bias=True`` also biases o_proj, which our decoder lacks: the
  loader must refuse rather than silently drop those tensors."""
  model = _hf_model("Llama", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_key_value_heads=2, attention_bias=True), seed=0)
  assert model.model.layers[0].self_attn.o_proj.bias is not None
  model.save_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match=r"config\.json.*attention_bias=True"):
    load_pretrained(tmp_path)


_OURS = {
    "qwen2_untied": dict(tie_word_embeddings=False),
    "llama3_tied_gqa4": dict(architecture="llama", qkv_bias=False, num_kv_heads=1,
                             rope_theta=500000.0, rms_norm_eps=1e-5,
                             rope_scaling=tuple(sorted((k, float(v)) for k, v in _LLAMA3.items()
                                                       if k != "rope_type"))),
}


@pytest.mark.parametrize("name", sorted(_OURS))
def test_transformers_loads_our_save_pretrained(name, tmp_path):
  """The reverse direction: our ``save_pretrained`` output loads in transformers with equal logits
  (checks ``to_hf_dict``, including the llama3 rope type)."""
  from specroll_jax.models import ModelConfig, init_params, save_pretrained

  config = ModelConfig.tiny(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=16,
                            max_position_embeddings=256, **_OURS[name])

  @jax.jit
  def perturbed(key):  # init_params has unit norms and zero biases: perturb every leaf
    params = init_params(key, config)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.2 * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys, strict=True)])

  params = perturbed(jax.random.key(0))
  save_pretrained(tmp_path, config, params)
  model = getattr(transformers, f"{config.architecture.capitalize()}ForCausalLM").from_pretrained(
      str(tmp_path), attn_implementation="eager").eval()
  assert (model.config.rope_parameters or {}).get("rope_type", "default") == (
      "llama3" if config.rope_scaling else "default")
  tokens, valid = _prompts(0)
  ref = _hf_logits(model, tokens, valid)
  ours = np.asarray(_jit_forward(config, params, jnp.asarray(tokens)))
  assert float(np.std(ref[valid])) > 0.5
  err = float(np.max(np.abs(ours - ref)[valid]))
  assert err < ATOL, f"{name}: max |ours - HF| = {err:.3g}"
