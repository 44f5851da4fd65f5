"""Which kernels the engine runs, resolved once at the public entry into a frozen static object.

``Kernels.resolve("auto" | "reference" | "pallas" | "pallas_interpret")`` decides, once, which
attention the decoder uses (the Pallas tree-attention kernel or its jnp reference), which sampler
(the fused unembed + Gumbel-max Pallas kernel or the jnp path) and whether Pallas runs in interpret
mode. The result is hashable and passed down as a static argument; nothing below re-reads a string.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import tree_attention as _ta
from specroll_jax import mesh as _mesh
from specroll_jax._fields import check_bool
from specroll_jax.mesh import ModelMesh

CHOICES = ("auto", "reference", "pallas", "pallas_interpret")
_IMPLS = ("reference", "pallas")
_ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class Kernels:
  """attention / sampler: "reference" (plain jnp) or "pallas"; interpret: run Pallas kernels in
  the interpreter (CPU tests). The fused sampler is used only for plain sampling (no top-k/top-p);
  other configurations take the jnp sampler whatever ``sampler`` says."""

  attention: str = "reference"
  sampler: str = "reference"
  interpret: bool = False
  mesh: ModelMesh | None = None

  def __post_init__(self):
    for name in ("attention", "sampler"):
      v = getattr(self, name)
      if v not in _IMPLS:
        raise ValueError(f"Kernels.{name} must be one of {_IMPLS}, got {v!r}")
    check_bool(self, "interpret")
    object.__setattr__(self, "mesh", _mesh.resolve(self.mesh))

  @classmethod
  def resolve(cls, kernels: str | Kernels = "auto", mesh=None) -> Kernels:
    """A ``Kernels`` from a choice name (or a ``Kernels``, returned as is), on ``mesh`` (a
    ``Mesh`` with axes "data" / "model" or a ``specroll_jax.mesh.ModelMesh``; None: the
    ``Kernels``' own, one device for a name).

    "auto": the Pallas kernels on a GPU/TPU default backend, the jnp references elsewhere.
    """
    if isinstance(kernels, Kernels):
      out = kernels
    elif not isinstance(kernels, str) or kernels not in CHOICES:
      raise ValueError(f"kernels must be one of {CHOICES} or a Kernels, got {kernels!r}")
    else:
      if kernels == "auto":
        kernels = "pallas" if jax.default_backend() in _ACCELERATORS else "reference"
      if kernels == "reference":
        out = cls()
      else:
        out = cls(attention="pallas", sampler="pallas", interpret=kernels == "pallas_interpret")
    mesh = _mesh.resolve(mesh)
    if mesh is not None and mesh != out.mesh:
      out = dataclasses.replace(out, mesh=mesh)
    return out

  @property
  def attention_fn(self):
    """tree attention with the contract of ``pallas_kernels.tree_attention``; on a mesh, each
    shard attends with its own heads and its slice of the cache (``jax.shard_map``)."""
    if self.attention == "reference":
      fn = _ta.tree_attention_reference
    else:
      fn = functools.partial(_ta.tree_attention, interpret=self.interpret)
    return fn if self.mesh is None else _per_shard_attention(fn, self.mesh)


def per_shard(fn, mesh: ModelMesh, in_specs, out_specs, rows: str | None):
  """``fn`` under ``jax.shard_map`` over the model axis (and over ``rows``, the data axis, when
  it splits the rows); inside a caller's ``shard_map`` over the data axis, over the model axis
  only (the caller's shard holds its rows). ``in_specs`` / ``out_specs`` are functions of the
  row axis name (or None)."""
  manual = _mesh._manual_axes()
  if mesh.model in manual:
    return fn  # already one model shard's view
  if manual:  # the caller maps the rows by hand
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs(None),
                         out_specs=out_specs(None), axis_names={mesh.model}, check_vma=False)
  return jax.shard_map(fn, mesh=mesh.mesh, in_specs=in_specs(rows), out_specs=out_specs(rows),
                       check_vma=False)


def _per_shard_attention(fn, mesh: ModelMesh):
  def attend(q, k_cache, v_cache, lengths, k_new, v_new, mask):
    if k_cache.shape[1] == 0:  # a forward without a cache: one slot past every row's length,
      pad = ((0, 0), (0, 1), (0, 0), (0, 0))  # so masked (zero-size operands of a shard_map
      k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)  # crash XLA in jax 0.11)
    heads = lambda r: P(r, None, mesh.model, None)
    ins = lambda r: (heads(r), heads(r), heads(r), P(r), heads(r), heads(r), P(r))
    return per_shard(fn, mesh, ins, heads, mesh.rows(q.shape[0]))(
        q, k_cache, v_cache, lengths, k_new, v_new, mask)

  return attend


REFERENCE = Kernels()
