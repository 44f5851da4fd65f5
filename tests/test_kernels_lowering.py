"""The kernels lower for cuda (Pallas Triton) and tpu (Mosaic) at realistic shapes, without devices.

``jax.export`` with ``jax.ShapeDtypeStruct`` arguments (no arrays): Qwen2.5-1.5B (H=12, Hkv=2) and
7B (H=28, Hkv=4) head layouts, Dh = 128, bf16, a 4096-position cache, and T in {1, 13, 64, 512,
2048} new tokens (a decode step, a verify tree, prefill chunks); the prefill shape L = 0; f32
tiles; the Qwen2.5-1.5B unembedding in both layouts. On jax >= 0.11 the Triton export needs an
abstract GPU device (``pallas_kernels.lowering``). This proves lowering (tiling rules, Triton's
1M-element tensor limit, Mosaic block rules), not device compilation (see experiments/
device_check.py).
"""

import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import fused_sampler as fs
from pallas_kernels import lowering
from pallas_kernels import tree_attention as ta

# jax 0.11 deprecates the Pallas Triton backend (our design card asks for Triton; a Mosaic GPU
# variant can sit beside it later): the warning is expected while lowering for cuda.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

sds = jax.ShapeDtypeStruct
LAYOUTS = {"qwen2.5-1.5b": (12, 2, 128), "qwen2.5-7b": (28, 4, 128)}
PLATFORMS = {"cuda": "triton", "tpu": "tpu"}


def _attention_specs(b, t, h, hkv, dh, lc, dtype=jnp.bfloat16):
  return (sds((b, t, h, dh), dtype), sds((b, lc, hkv, dh), dtype), sds((b, lc, hkv, dh), dtype),
          sds((b,), jnp.int32), sds((b, t, hkv, dh), dtype), sds((b, t, hkv, dh), dtype),
          sds((b, t, t), jnp.bool_))


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("t", [1, 13, 64, 512, 2048])
def test_tree_attention_lowers(platform, layout, t):
  h, hkv, dh = LAYOUTS[layout]
  backend = PLATFORMS[platform]
  f = lambda *a: ta.tree_attention(*a, backend=backend)
  lowering.lowers(f, _attention_specs(2, t, h, hkv, dh, 4096), platform)


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("shape", [
    (8, 256, 12, 2, 128, 0, jnp.bfloat16),  # prefill: empty cache, 256-token prompts
    (4, 8, 12, 2, 128, 1000, jnp.float32),  # f32 tiles (halved on Triton), L off the block
    (3, 16, 8, 2, 64, 700, jnp.bfloat16),  # Dh = 64: two kv heads per TPU lane group
    (1, 1, 28, 4, 128, 300, jnp.bfloat16),  # single row: L split over programs
])
def test_tree_attention_lowers_other_shapes(platform, shape):
  *dims, dtype = shape
  f = lambda *a: ta.tree_attention(*a, backend=PLATFORMS[platform])
  lowering.lowers(f, _attention_specs(*dims, dtype=dtype), platform)


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("temp,layout", [(0.0, "dv"), (1.0, "dv"), (0.7, "vd")])
def test_fused_sampler_lowers(platform, temp, layout):
  r, d, v = 16, 1536, 151936  # Qwen2.5-1.5B unembedding; "vd" is its tied embedding table
  w = sds((d, v) if layout == "dv" else (v, d), jnp.bfloat16)
  specs = (sds((r, d), jnp.bfloat16), w, sds((), jnp.uint32), sds((r,), jnp.int32),
           sds((r,), jnp.int32))
  f = lambda *a: fs.fused_sample(*a, temperature=temp, backend=PLATFORMS[platform],
                                 unembed_layout=layout)
  lowering.lowers(f, specs, platform)


def test_f32_dots_are_full_precision_on_triton():
  # Triton lowers f32 dots to TF32 unless asked for IEEE: spy on the dot op while lowering.
  tl = pytest.importorskip("jax._src.pallas.triton.lowering")
  seen = []
  real = tl.tt_dialect.dot

  def spy(a, b, acc, **kw):
    seen.append(str(kw.get("input_precision")))
    return real(a, b, acc, **kw)

  attn = _attention_specs(2, 9, 4, 2, 64, 300, jnp.float32)
  samp = (sds((8, 64), jnp.float32), sds((64, 1000), jnp.float32), sds((), jnp.uint32),
          sds((8,), jnp.int32), sds((8,), jnp.int32))
  tl.tt_dialect.dot = spy
  try:
    lowering.lowers(lambda *a: ta.tree_attention(*a, backend="triton"), attn, "cuda")
    lowering.lowers(lambda *a: fs.fused_sample(*a, temperature=0.7, backend="triton"), samp,
                    "cuda")
  finally:
    tl.tt_dialect.dot = real
  assert seen and set(seen) == {"ieee"}, seen


@pytest.mark.parametrize("kernel", ["tree_attention", "fused_sample"])
def test_tpu_kernels_set_their_vmem_limit(kernel):
  # The explicit vmem_limit_bytes shows up as the call's scoped memory size: >= the 16 MiB
  # default, <= 48 MiB (under a v7x core's 64 MiB).
  if kernel == "tree_attention":
    f = lambda *a: ta.tree_attention(*a, backend="tpu")
    specs = _attention_specs(2, 512, 12, 2, 128, 4096)
  else:
    f = lambda *a: fs.fused_sample(*a, temperature=1.0, backend="tpu")
    specs = (sds((256, 3584), jnp.bfloat16), sds((3584, 151936), jnp.bfloat16),
             sds((), jnp.uint32), sds((256,), jnp.int32), sds((256,), jnp.int32))
  text = lowering.lowers(f, specs, "tpu")
  sizes = [int(x) for x in re.findall(r"scoped_memory_configs.{0,80}?size\\22: (\d+)", text)]
  assert sizes and all(16 << 20 <= x <= 48 << 20 for x in sizes), sizes
