"""Static settings: SpecConfig and DecodeSettings validate themselves and never rewrite fields;
Kernels resolve once from a choice name."""

import dataclasses

import jax
import pytest

from specroll_jax.engines.config import DecodeSettings, SpecConfig
from specroll_jax.kernels import Kernels
from specroll_jax.sampling import SamplingConfig


@pytest.mark.parametrize("kwargs,field,value", [
    (dict(node_budget=-1), "node_budget", "-1"),
    (dict(max_nodes=-2), "max_nodes", "-2"),
    (dict(bucket_fractions=(0.5, 0.25)), "bucket_fractions", "(0.5, 0.25)"),
    (dict(node_budget=2.5), "node_budget", "2.5"),
])
def test_spec_config_validation(kwargs, field, value):
  with pytest.raises(ValueError) as e:
    SpecConfig(**kwargs)
  assert field in str(e.value) and value in str(e.value), str(e.value)


def test_spec_config_defaults_and_buckets():
  s = SpecConfig(max_nodes=100)
  assert s.max_nodes == 100  # never rewritten; the per-bucket N is capped instead
  assert SpecConfig().bucket_shapes(8) == [(8, 8), (4, 16), (2, 16), (1, 16)]
  assert s.bucket_shapes(8, capacity=16) == [(8, 8), (4, 16), (2, 16), (1, 16)]
  assert SpecConfig(node_budget=0).bucket_shapes(64) == [(64, 0), (32, 0), (16, 0), (8, 0)]
  # a usable static argument: equal settings hit the same compiled function
  f = jax.jit(lambda x, s: x + s.node_budget, static_argnums=1)
  assert int(f(1, SpecConfig())) == 65 and f._cache_size() == 1
  assert int(f(1, SpecConfig())) == 65 and f._cache_size() == 1


def test_decode_settings_validation():
  cfg = SamplingConfig()
  DecodeSettings(sampling=cfg, max_new_tokens=4, cache_length=8)
  with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
    DecodeSettings(sampling=cfg, max_new_tokens=0, cache_length=8)
  with pytest.raises(ValueError, match="sampling must be a SamplingConfig"):
    DecodeSettings(sampling=1.0, max_new_tokens=4, cache_length=8)
  with pytest.raises(ValueError, match="kernels must be a Kernels"):
    DecodeSettings(sampling=cfg, max_new_tokens=4, cache_length=8, kernels="pallas")
  with pytest.raises(dataclasses.FrozenInstanceError):
    DecodeSettings(sampling=cfg, max_new_tokens=4, cache_length=8).pad_id = 3


def test_kernels_resolve():
  assert Kernels.resolve("reference") == Kernels()
  k = Kernels.resolve("pallas_interpret")
  assert (k.attention, k.sampler, k.interpret) == ("pallas", "pallas", True)
  assert Kernels.resolve("auto") == Kernels()  # CPU: the jnp references
  assert Kernels.resolve(k) is k
  with pytest.raises(ValueError, match=r"kernels must be one of .*got 'cuda'"):
    Kernels.resolve("cuda")
  with pytest.raises(ValueError, match="Kernels.attention must be one of"):
    Kernels(attention="triton")
