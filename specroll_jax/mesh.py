"""Rollouts on a (data, model) mesh (docs/design.md, "Model-parallel rollouts").

``ModelMesh`` names the mesh and its two axes: rows over ``data`` (optional), the model over
``model``. Placement is Megatron-style, chosen so that one decode step moves activations only:

* attention: q/k/v projections split by output columns, i.e. by heads (each shard holds
  ``num_heads / m`` query heads and ``num_kv_heads / m`` KV heads, a contiguous block, so GQA's
  query-to-KV grouping is the same inside every shard), o_proj by input rows; one all-reduce of
  [rows, D] per layer.
* FFN: gate/up by output columns, down by input rows; one all-reduce per layer.
* embedding and unembedding over the vocabulary, not the hidden size: the fused unembed + sample
  kernel then computes whole logits of its vocabulary slice and only (best score, id, logsumexp
  parts) per row cross shards (``pallas_kernels.fused_sampler.merge_shards``), where a hidden-
  sharded unembedding would all-reduce [rows, V] partial logits; a tied embedding is the same
  matrix. The lookup of a token is a masked local gather and an all-reduce of [rows, D].
* KV cache: rows over ``data``, KV heads over ``model`` (each shard keeps its heads' slice).
* norms, biases of row-split layers, the proposers' heads (a few D x D matrices and norms: under
  2% of a 7B model's weights), the calibration, Reflex and the store: replicated.

The dense parts run under GSPMD (``jax.jit`` with the parameters' ``NamedSharding``s and the
constraints ``constrain_rows`` / ``constrain_cache`` put on the activations and the cache); the
Pallas kernels, which have no partitioning rule, run per shard inside ``jax.shard_map``
(``Kernels`` carries the mesh). Tokens equal one device's (tests/test_mesh.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:  # (models imports the kernels, which import this module)
  from specroll_jax.models.config import ModelConfig

DATA = "data"
MODEL = "model"
_COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWS = ("o_proj", "down_proj")

__all__ = ["DATA", "MODEL", "ModelMesh", "make_mesh"]


def make_mesh(data: int = 1, model: int | None = None, *, devices=None,
              names: tuple[str, str] = (DATA, MODEL)) -> Mesh:
  """A (data, model) ``Mesh`` over the first data x model of ``devices`` (default: all);
  ``model`` None: every device not on ``data``. ValueError when there are fewer devices."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  for name, v in (("data", data), ("model", model)):
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
      raise ValueError(f"make_mesh: {name} must be an int >= 1, got {v!r}")
  if model is None:
    if n % data:
      raise ValueError(f"make_mesh: data={data} does not divide the {n} devices")
    model = n // data
  if data * model > n:
    raise ValueError(f"make_mesh: data x model = {data} x {model} = {data * model}, but there "
                     f"are {n} devices")
  devices = devices[:data * model]
  return Mesh(np.array(devices, dtype=object).reshape(data, model), tuple(names))


def _path_names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


@dataclasses.dataclass(frozen=True)
class ModelMesh:
  """A mesh and the names of its row axis (``data``; None: rows are not split) and its model
  axis (``model``). Hashable: a static argument of the compiled rollouts (``Kernels.mesh``)."""

  mesh: Mesh
  data: str | None = DATA
  model: str = MODEL

  def __post_init__(self):
    if not isinstance(self.mesh, Mesh):
      raise ValueError(f"ModelMesh.mesh must be a jax.sharding.Mesh, got "
                       f"{type(self.mesh).__name__}")
    names = tuple(self.mesh.axis_names)
    if self.model not in names:
      raise ValueError(f"ModelMesh.model: the mesh has axes {names}, not {self.model!r} "
                       "(name the model axis with model=...)")
    if self.data is not None and self.data not in names:
      raise ValueError(f"ModelMesh.data: the mesh has axes {names}, not {self.data!r} "
                       "(name the row axis with data=..., or data=None)")
    if self.data == self.model:
      raise ValueError(f"ModelMesh: data and model name the same axis {self.model!r}")
    others = [a for a in names if a not in (self.data, self.model) and self.mesh.shape[a] > 1]
    if others:
      raise ValueError(f"ModelMesh: the mesh's axes {others} (sizes "
                       f"{[self.mesh.shape[a] for a in others]}) are neither data={self.data!r} "
                       f"nor model={self.model!r}")

  @classmethod
  def of(cls, mesh, *, data: str | None = DATA, model: str = MODEL) -> ModelMesh:
    """A ``ModelMesh`` from a ``Mesh`` (axes named ``data`` / ``model``) or a ``ModelMesh`` (as
    is)."""
    if isinstance(mesh, ModelMesh):
      return mesh
    if isinstance(mesh, Mesh) and data is not None and data not in mesh.axis_names:
      data = None if len(mesh.axis_names) == 1 else data
    return cls(mesh, data=data, model=model)

  # -- sizes

  @property
  def model_size(self) -> int:
    return int(self.mesh.shape[self.model])

  @property
  def data_size(self) -> int:
    return 1 if self.data is None else int(self.mesh.shape[self.data])

  def rows(self, batch: int) -> str | None:
    """The axis a batch of ``batch`` rows is split over (None: replicated, when the data axis
    does not divide it; compaction's small buckets)."""
    if self.data is None or self.data_size == 1 or batch % self.data_size:
      return None
    return self.data

  # -- validation

  def check_config(self, config: ModelConfig) -> None:
    """ValueError naming the axis and the dimension unless the model axis divides the query
    heads, the KV heads, the vocabulary and the FFN width."""
    m = self.model_size
    for dim in ("num_heads", "num_kv_heads", "vocab_size", "intermediate_size"):
      v = getattr(config, dim)
      if v % m:
        raise ValueError(f"mesh axis {self.model!r} of size {m} does not divide the model's "
                         f"{dim}={v} (the {dim} are split over {self.model!r}); use a model axis "
                         f"that divides it")

  # -- parameters

  def param_spec(self, path, leaf) -> P:
    """The ``PartitionSpec`` of one decoder parameter (``path`` from ``tree_map_with_path``)."""
    names = _path_names(path)
    ndim = len(np.shape(leaf))
    if not names or ndim == 0:
      return P()
    module = names[-2] if len(names) > 1 else names[-1]
    last = names[-1]
    if module == "embed":
      return P(self.model, None)
    if module == "lm_head":
      return P(None, self.model)
    if module in _COLUMNS:  # kernel [.., D, N] / bias [.., N]: the output columns
      return P(*((None,) * (ndim - 1)), self.model)
    if module in _ROWS and last == "kernel":  # [.., N, D]: the input rows
      return P(*((None,) * (ndim - 2)), self.model, None)
    return P()

  def shard_params(self, config: ModelConfig, params):
    """The decoder's parameters placed on the mesh (``device_put``; an array already placed
    so moves nothing)."""
    self.check_config(config)
    return self.place(params)

  def place(self, tree):
    """Every leaf of ``tree`` placed by its path's ``param_spec``: the decoder's parameters, or a
    tree holding them (a train state: the optimizer's moments follow their parameters)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jax.device_put(x, NamedSharding(self.mesh, self.param_spec(p, x))), tree)

  def check_params(self, config: ModelConfig, params) -> None:
    """ValueError naming the leaf, the dimension and the axis unless every parameter is placed on
    this mesh as ``shard_params`` places it (before any compile)."""
    self.check_config(config)
    if not isinstance(params, Mapping):
      raise ValueError(f"params must be the decoder's parameter dict, got {type(params).__name__}")
    want_devices = set(self.mesh.devices.flat)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      name = "/".join(_path_names(path))
      want = self.param_spec(path, leaf)
      sharding = getattr(leaf, "sharding", None)
      if not isinstance(leaf, jax.Array) or sharding is None:
        raise ValueError(f"params[{name}] is a {type(leaf).__name__} on the host; on a mesh the "
                         "weights must be placed first: ModelMesh.shard_params(config, params)")
      if set(sharding.device_set) != want_devices:
        raise ValueError(f"params[{name}] lives on {len(sharding.device_set)} device(s), not on "
                         f"the mesh's {len(want_devices)}: place it with "
                         "ModelMesh.shard_params(config, params)")
      ndim = leaf.ndim
      if not sharding.is_equivalent_to(NamedSharding(self.mesh, want), ndim):
        got = getattr(sharding, "spec", sharding)
        dims = [i for i, a in enumerate(tuple(want) + (None,) * (ndim - len(want)))
                if a is not None]
        what = (f"dimension {dims[0]} (of size {leaf.shape[dims[0]]}) split over "
                f"{self.model!r}" if dims else "replicated")
        raise ValueError(f"params[{name}] is sharded as {got}; the engine expects it {what} "
                         f"(PartitionSpec {want}): place it with "
                         "ModelMesh.shard_params(config, params)")

  # -- rows

  def place_batch(self, batch):
    """A ``PromptBatch`` with its rows (tokens, lengths, sample ids) over ``data`` and the rest
    (EOS ids, seed) replicated."""
    rows = NamedSharding(self.mesh, P(self.rows(batch.tokens.shape[0])))
    rep = NamedSharding(self.mesh, P())
    return batch.replace(tokens=jax.device_put(batch.tokens, rows),
                         lengths=jax.device_put(batch.lengths, rows),
                         sample_ids=jax.device_put(batch.sample_ids, rows),
                         eos_ids=jax.device_put(batch.eos_ids, rep),
                         seed=jax.device_put(batch.seed, rep))

  def replicate(self, tree):
    """``tree`` replicated on every device of the mesh (the heads, the proposers' state)."""
    rep = NamedSharding(self.mesh, P())
    return jax.tree.map(lambda x: jax.device_put(x, rep), tree)

  # -- activations and the cache (under GSPMD)

  def _constrain(self, x, spec: P):
    if _manual_axes():
      return x  # inside a caller's shard_map: its specs place the rows, GSPMD the rest
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def constrain_rows(self, x):
    """``x`` [B, ...] with its rows over ``data`` (where it divides B), the rest replicated."""
    return self._constrain(x, P(self.rows(x.shape[0])))

  def cache_spec(self, buf_ndim: int, batch: int) -> P:
    """A cache buffer's spec: rows over data, KV heads (the second to last axis) over model."""
    return P(self.rows(batch), *((None,) * (buf_ndim - 3)), self.model, None)

  def constrain_cache(self, bufs):
    """Per-layer buffers [B, L, Hkv, Dh] or a stacked [B, Ly, L, Hkv, Dh] (a tuple or an array)
    placed as ``cache_spec``."""
    one = lambda b: self._constrain(b, self.cache_spec(b.ndim, b.shape[0]))
    if isinstance(bufs, tuple | list):
      return type(bufs)(one(b) for b in bufs)
    return one(bufs)

  def per_device_bytes(self, params) -> int:
    """Bytes of ``params`` one device holds (from the arrays' shardings)."""
    total = 0
    for leaf in jax.tree.leaves(params):
      shard = leaf.sharding.shard_shape(leaf.shape)
      total += math.prod(shard) * leaf.dtype.itemsize
    return total


def _manual_axes() -> tuple:
  """The mesh axes a surrounding ``shard_map`` maps manually (empty outside one)."""
  try:
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)
  except AttributeError:  # pragma: no cover - older jax
    return ()


def resolve(mesh) -> ModelMesh | None:
  """None, a ``Mesh`` (axes ``data`` / ``model``) or a ``ModelMesh`` -> ``ModelMesh`` or None."""
  if mesh is None:
    return None
  if not isinstance(mesh, Mesh | ModelMesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh or a ModelMesh, got "
                     f"{type(mesh).__name__}")
  return ModelMesh.of(mesh)


_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1,
                "s64": 8, "u64": 8, "f64": 8, "s16": 2, "u16": 2}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program: its kind, result dtype and shape (per device), bytes."""

  kind: str
  dtype: str
  shape: tuple[int, ...]

  @property
  def bytes(self) -> int:
    return math.prod(self.shape) * _DTYPE_BYTES.get(self.dtype, 4)


def collectives(hlo_text: str) -> list[Collective]:
  """The collectives of a compiled program's HLO text (``compiled.as_text()``), each once per
  appearance in the program text (a collective inside a loop body runs once per iteration)."""
  kinds = "|".join(_COLLECTIVES)
  pat = re.compile(rf"=\s+\(?([a-z0-9]+)\[([0-9,]*)\][^=]*?\s({kinds})(?:-start)?\(")
  out = []
  for line in hlo_text.splitlines():
    m = pat.search(line)
    if m:
      dims = tuple(int(d) for d in m.group(2).split(",") if d)
      out.append(Collective(m.group(3), m.group(1), dims))
  return out


def gathers_weights(hlo_text: str, config: ModelConfig, params) -> list[Collective]:
  """The all-gathers of a compiled program whose result has the shape of a whole weight matrix
  (or one layer of a stacked one): what a model-parallel step must not do."""
  shapes = set()
  for leaf in jax.tree.leaves(params):
    shape = tuple(np.shape(leaf))
    if len(shape) >= 2:
      shapes.add(shape)
      shapes.add(shape[1:])
  return [c for c in collectives(hlo_text) if c.kind == "all-gather" and c.shape in shapes]
