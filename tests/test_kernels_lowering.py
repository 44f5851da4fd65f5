"""The kernels lower for cuda (Pallas Triton) and tpu (Mosaic) at realistic shapes, without devices.

``jax.export`` with ``jax.ShapeDtypeStruct`` arguments (no arrays): Qwen2.5-1.5B (H=12, Hkv=2) and
7B (H=28, Hkv=4) head layouts, Dh = 128, bf16, a 4096-position cache, and T in {1, 13, 64, 512,
2048} new tokens (a decode step, a verify tree, prefill chunks); the prefill shape L = 0; f32
tiles; the Qwen2.5-1.5B unembedding in both layouts. On jax >= 0.11 the Triton export needs an
abstract GPU device (``pallas_kernels.lowering``). This proves lowering (tiling rules, Triton's
1M-element tensor limit, Mosaic block rules), not device compilation (see experiments/
device_check.py).

Each export is checked for what came out: the module calls the platform's kernel custom call
(``__gpu$xla.gpu.triton`` / ``tpu_custom_call``) exactly once per kernel call and no other custom
call; every kernel module Pallas lowered (Triton TTIR / Mosaic) passes MLIR's verifier; the
exported function's inputs are the arguments and its outputs the kernel reference's (structure,
shapes, dtypes) for the same arguments; and the export survives ``Exported.serialize`` /
``jax.export.deserialize`` byte for byte and lowers again through ``Exported.call``, which parses
the stored module and runs jax's module verifier on it.
"""

import contextlib
import importlib
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


def _sampler_specs(r, d, v, layout="dv", dtype=jnp.bfloat16):
  return (sds((r, d), dtype), sds((d, v) if layout == "dv" else (v, d), dtype),
          sds((), jnp.uint32), sds((r,), jnp.int32), sds((r,), jnp.int32))


# Where Pallas builds each platform's kernel module (jax private API, the same on jax 0.10 and
# 0.11; ``pallas_kernels.lowering`` patches the Triton one too) and how to reach the ir.Module.
_KERNEL_LOWERINGS = {
    "cuda": ("jax._src.pallas.triton.pallas_call_registration", "lower_jaxpr_to_triton_module",
             lambda result: result.module),
    "tpu": ("jax._src.pallas.mosaic.pallas_call_registration", "lower_jaxpr_to_pipelined_module",
            lambda result: result),
}


@contextlib.contextmanager
def _verified_kernel_modules(platform):
  """Within: every kernel module Pallas lowers for ``platform`` is run through MLIR's verifier
  as it is built; yields the list of verifier results (True per module; a failure raises)."""
  registration, name, module_of = _KERNEL_LOWERINGS[platform]
  owner = importlib.import_module(registration).lowering
  real = getattr(owner, name)
  verified = []

  def lower_and_verify(*args, **kwargs):
    result = real(*args, **kwargs)
    verified.append(module_of(result).operation.verify())
    return result

  setattr(owner, name, lower_and_verify)
  try:
    yield verified
  finally:
    setattr(owner, name, real)


def _custom_calls(text):
  """The targets of the custom call ops in a module's text, in order (each op once, even when its
  function is called from several places)."""
  return re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)


def _kernel_calls(text):
  """The custom call targets one call of the module's ``main`` runs, expanding the call graph:
  jax lowers a jitted function once per module and calls it from every call site (on TPU, two
  calls of the same kernel at the same shapes are one op in a function called twice)."""
  body, funcs = None, {}
  for line in text.splitlines():
    if m := re.match(r"\s*func\.func (?:public |private )?@([\w$.-]+)\(", line):
      body = funcs.setdefault(m.group(1), [])
    elif body is not None:
      body += re.findall(r"stablehlo\.custom_call @([\w$.]+)|(?<![\w.])call @([\w$.-]+)\(", line)

  def expand(name):
    return [t for target, callee in funcs[name] for t in ([target] if target else expand(callee))]

  return expand("main")


def _avals(xs):
  return [(tuple(x.shape), jnp.dtype(x.dtype)) for x in xs]


def _export_checked(fn, specs, platform, reference, calls=1):
  """Export ``fn`` at ``specs`` for ``platform`` and assert what came out (module docstring):
  ``calls`` kernel custom calls per call of the function and a verified kernel module per op,
  in/out avals those of the arguments and of ``reference(*specs)``, a byte-exact serialise round
  trip that lowers again. Returns the module text."""
  marker = lowering.MARKERS[platform]
  with _verified_kernel_modules(platform) as verified:  # a fresh function: no lowering cache hit
    exported = lowering.export(lambda *a: fn(*a), specs, platform)
  text = exported.mlir_module()
  assert marker in text
  assert _kernel_calls(text) == [marker] * calls, _kernel_calls(text)
  # one kernel module lowered (and verified) per custom call op, no other custom call
  ops = _custom_calls(text)
  assert set(ops) == {marker} and verified == [True] * len(ops), (ops, verified)
  assert exported.platforms == (platform,)
  want = jax.eval_shape(reference, *specs)
  back = jax.export.deserialize(exported.serialize())
  for e in (exported, back):
    assert _avals(e.in_avals) == _avals(specs)
    assert e.out_tree == jax.tree.structure(want), (e.out_tree, want)
    assert _avals(e.out_avals) == _avals(jax.tree.leaves(want))
  assert back.platforms == (platform,)
  assert back.mlir_module_serialized == exported.mlir_module_serialized
  again = lowering.export(back.call, specs, platform)  # parses and verifies the stored module
  assert _kernel_calls(again.mlir_module()) == [marker] * calls
  assert _avals(again.out_avals) == _avals(exported.out_avals)
  return text


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("t", [1, 13, 64, 512, 2048])
def test_tree_attention_lowers(platform, layout, t):
  h, hkv, dh = LAYOUTS[layout]
  backend = PLATFORMS[platform]
  f = lambda *a: ta.tree_attention(*a, backend=backend)
  _export_checked(f, _attention_specs(2, t, h, hkv, dh, 4096), platform,
                  ta.tree_attention_reference)


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
  _export_checked(f, _attention_specs(*dims, dtype=dtype), platform, ta.tree_attention_reference)


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("temp,layout", [(0.0, "dv"), (1.0, "dv"), (0.7, "vd")])
def test_fused_sampler_lowers(platform, temp, layout):
  # Qwen2.5-1.5B unembedding; "vd" is its tied embedding table
  specs = _sampler_specs(16, 1536, 151936, layout)
  f = lambda *a: fs.fused_sample(*a, temperature=temp, backend=PLATFORMS[platform],
                                 unembed_layout=layout)
  ref = lambda *a: fs.fused_sample_reference(*a, temperature=temp, unembed_layout=layout)
  _export_checked(f, specs, platform, ref)


@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_each_kernel_call_is_one_custom_call(platform):
  # Two attention calls (two layers) and a sampler call: three kernel calls, none merged or
  # dropped; outputs in the function's (nested) structure.
  backend = PLATFORMS[platform]
  attn = _attention_specs(2, 13, 12, 2, 128, 512)
  specs = attn + _sampler_specs(16, 256, 1024, dtype=jnp.float32)

  def two_layers_and_sample(attention, sample, *a):
    x = attention(*a[:7])
    return (x, attention(x, *a[1:7])), sample(*a[7:])

  f = lambda *a: two_layers_and_sample(
      lambda *b: ta.tree_attention(*b, backend=backend),
      lambda *b: fs.fused_sample(*b, temperature=1.0, backend=backend), *a)
  ref = lambda *a: two_layers_and_sample(
      ta.tree_attention_reference,
      lambda *b: fs.fused_sample_reference(*b, temperature=1.0), *a)
  _export_checked(f, specs, platform, ref, calls=3)


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
