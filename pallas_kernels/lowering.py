"""Lower a kernel for a device platform on any machine (no GPU/TPU needed): ``jax.export``.

This proves that Pallas lowers the kernel (Triton TTIR for "cuda", Mosaic for "tpu") at the given
shapes, tiling rules included; PTX / libtpu compilation happens only on the device.

jax >= 0.11 removed the CPU fallback for Triton lowering ("No supported GPU devices found, please
specify an abstract GPU device"); an ``AbstractMesh`` with an ``AbstractDevice`` of the target kind
around the export supplies one, and works on jax 0.10 too.
"""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import AbstractDevice, AbstractMesh

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "tpu_custom_call"
MARKERS = {"cuda": TRITON_CALL, "tpu": MOSAIC_CALL}
# The abstract device each platform lowers for (the project's GPU is an H200: 132 SMs).
ABSTRACT_DEVICES = {"cuda": dict(device_kind="NVIDIA H200", num_cores=132)}


def abstract_device_context(platform: str):
  """A context in which ``jax.export`` can lower Pallas for ``platform`` without the device."""
  if platform not in ABSTRACT_DEVICES:
    return contextlib.nullcontext()
  device = AbstractDevice(platform=platform, **ABSTRACT_DEVICES[platform])
  return jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device))


@contextlib.contextmanager
def verified_triton_modules():
  """Within: every Triton module Pallas lowers is run through MLIR's verifier at once, raising
  ``AssertionError`` on failure. Pallas does not verify the module it serialises; the device's
  XLA does, when it compiles ("Failed to parse Triton module"). A jnp.where of two Python ints
  as a fori_loop bound lowered to an i1 ``arith.select`` and the ``scf.for`` failed there, on
  the first H200 run, while every export here had passed. Patches jax's private Triton
  registration for the duration (jax 0.10 and 0.11)."""
  from jax._src.pallas.triton import pallas_call_registration as reg
  real = reg.lowering.lower_jaxpr_to_triton_module

  def lower_and_verify(*args, **kwargs):
    result = real(*args, **kwargs)
    try:
      result.module.operation.verify()
    except Exception as e:  # MLIR's verifier raises its own error type
      raise AssertionError(f"Triton module fails MLIR verification: {e}") from None
    return result

  reg.lowering.lower_jaxpr_to_triton_module = lower_and_verify
  try:
    yield
  finally:
    reg.lowering.lower_jaxpr_to_triton_module = real


def export(fn, arg_specs, platform: str) -> jax.export.Exported:
  """``jax.export`` of ``jax.jit(fn)`` at ``arg_specs`` (``jax.ShapeDtypeStruct``s) for one
  platform ("cuda" or "tpu"). Raises whatever lowering raises (tiling rules, size limits); for
  "cuda" every Triton module is also verified (``verified_triton_modules``)."""
  if platform not in MARKERS:
    raise ValueError(f"export: platform must be one of {tuple(MARKERS)}, got {platform!r}")
  checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
  verify = verified_triton_modules() if platform == "cuda" else contextlib.nullcontext()
  with abstract_device_context(platform), verify:
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*arg_specs)


def lowers(fn, arg_specs, platform: str) -> str:
  """The exported module text; asserts it holds the platform's kernel custom call."""
  text = export(fn, arg_specs, platform).mlir_module()
  if MARKERS[platform] not in text:
    raise AssertionError(f"export for {platform}: no {MARKERS[platform]} in the lowered module")
  return text
