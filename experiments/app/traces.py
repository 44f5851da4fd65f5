"""Rollout traces (tensorstore, zarr v3): one record per training step, readable while written.

A trace directory is a zarr v3 hierarchy::

  zarr.json   group; attributes["specroll_trace"] = {version, batch, prompt_len, max_new, scalars,
              fields, num_steps}
  <field>/    one zarr v3 array per field, shape [C, *field shape], regular chunk grid of one step
              per chunk, zstd. Capacity C >= num_steps; rows >= num_steps are not in the trace.

Fields of a step (B batch rows, P prompt length, M max new tokens; all fixed at creation):
  prompt_ids [B, P] int32, tokens [B, M] int32 (the responses; both padded with -1 by convention,
  stored as given), lengths [B] int32 (response lengths in [0, M]), rewards [B] f32,
  logprobs [B, M] f32, advantages [B] f32, and one [] array per scalar (default: step int64,
  tau float32). Paths are local directories (tensorstore's file kvstore).

Capacity grows by doubling (a resize of every array's step axis) before the step that needs it;
``close()`` trims it to num_steps. Atomicity: ``append`` writes every field's chunk of step n, waits
for all of them, then rewrites zarr.json with num_steps = n + 1 (tensorstore's file kvstore writes a
temporary file and renames it). Readers read only rows < num_steps, so they never see a half-written
step; a writer reopening the trace continues at num_steps and overwrites a half-written step.
One writer per trace; any number of readers, in any process.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import numpy as np
import tensorstore as ts

from specroll_jax._fields import check_int, int_arg

FORMAT_VERSION = 1
DEFAULT_SCALARS = (("step", "int64"), ("tau", "float32"))
_ATTR = "specroll_trace"
_HEADER_KEY = "zarr.json"
_INITIAL_CAPACITY = 16
_ARRAY_FIELDS = ("prompt_ids", "tokens", "lengths", "rewards", "logprobs", "advantages")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceSpec:
  """Shapes of a trace, fixed at creation. ``scalars``: (name, dtype) pairs of per-step scalars."""

  batch: int  # B
  prompt_len: int  # P
  max_new: int  # M
  scalars: tuple[tuple[str, str], ...] = DEFAULT_SCALARS

  def __post_init__(self):
    for name in ("batch", "prompt_len", "max_new"):
      check_int(self, name, 1)
    pairs = self.scalars.items() if isinstance(self.scalars, Mapping) else self.scalars
    out = []
    for pair in pairs:
      if not (isinstance(pair, Sequence) and len(pair) == 2):
        raise ValueError(f"scalars must be (name, dtype) pairs or a mapping, got {pair!r}")
      name, dtype = pair
      if not isinstance(name, str) or not name.isidentifier() or name in _ARRAY_FIELDS:
        raise ValueError(
            f"scalar name {name!r} must be an identifier other than {list(_ARRAY_FIELDS)}")
      try:
        dt = np.dtype(dtype)
      except TypeError:
        raise ValueError(f"scalar {name!r} has dtype {dtype!r}, not a NumPy dtype") from None
      if dt.kind not in "biuf" or dt.itemsize > 8:
        raise ValueError(f"scalar {name!r} has dtype {dt}; expected bool, int or float")
      out.append((name, dt.name))
    if len({n for n, _ in out}) != len(out):
      raise ValueError(f"scalars has duplicate names: {[n for n, _ in out]}")
    object.__setattr__(self, "scalars", tuple(out))

  @property
  def fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Name -> (shape of one step, dtype) of every field, in a fixed order."""
    b, p, m = self.batch, self.prompt_len, self.max_new
    i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
    out = {"prompt_ids": ((b, p), i32), "tokens": ((b, m), i32), "lengths": ((b,), i32),
           "rewards": ((b,), f32), "logprobs": ((b, m), f32), "advantages": ((b,), f32)}
    out.update((name, ((), np.dtype(dt))) for name, dt in self.scalars)
    return out

  def header(self, num_steps: int) -> dict:
    return {"version": FORMAT_VERSION, "batch": self.batch, "prompt_len": self.prompt_len,
            "max_new": self.max_new, "scalars": dict(self.scalars),
            "fields": {k: {"shape": list(s), "dtype": d.name} for k, (s, d) in self.fields.items()},
            "num_steps": num_steps}

  @classmethod
  def from_header(cls, header: dict) -> TraceSpec:
    return cls(batch=header["batch"], prompt_len=header["prompt_len"],
               max_new=header["max_new"], scalars=tuple(header["scalars"].items()))


def _check_path(path) -> str:
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"path={path!r} exists and is not a directory")
  return path


def _read_header(kv: ts.KvStore, path: str) -> dict | None:
  """The trace header of ``path``, or None when it has no zarr.json."""
  got = kv.read(_HEADER_KEY).result()
  if got.state != "value":
    return None
  attrs = json.loads(got.value).get("attributes", {})
  if _ATTR not in attrs:
    raise ValueError(f"path={path!r} holds a zarr node that is not a specroll trace")
  header = attrs[_ATTR]
  if header.get("version") != FORMAT_VERSION:
    raise ValueError(
        f"trace at {path!r} has format version {header.get('version')}, expected {FORMAT_VERSION}")
  return header


def _write_header(kv: ts.KvStore, spec: TraceSpec, num_steps: int) -> None:
  group = {"zarr_format": 3, "node_type": "group", "attributes": {_ATTR: spec.header(num_steps)}}
  kv.write(_HEADER_KEY, json.dumps(group, indent=1).encode()).result()


def _array_spec(path: str, name: str) -> dict:
  return {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(path, name) + "/"}}


def _create_array(path: str, name: str, shape, dtype: np.dtype, capacity: int) -> ts.TensorStore:
  fill = "NaN" if dtype.kind == "f" else (-1 if dtype.kind == "i" else 0)
  if dtype.kind == "b":
    fill = False
  spec = _array_spec(path, name)
  spec["metadata"] = {
      "shape": [capacity, *shape],
      "data_type": dtype.name,
      "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, *shape]}},
      "chunk_key_encoding": {"name": "default"},
      "fill_value": fill,
      "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                 {"name": "zstd", "configuration": {"level": 3}}],
      "dimension_names": ["step", *("batch", "time")[:len(shape)]],
  }
  return ts.open(spec, create=True, delete_existing=True).result()


def _resize(arr: ts.TensorStore, capacity: int) -> ts.TensorStore:
  return arr.resize(exclusive_max=[capacity] + [None] * (arr.rank - 1)).result()


def _as_field(spec: TraceSpec, name: str, value) -> np.ndarray:
  shape, dtype = spec.fields[name]
  a = np.asarray(value)
  if a.shape != shape:
    raise ValueError(
        f"{name} has shape {a.shape}, expected {shape} (batch={spec.batch}, "
        f"prompt_len={spec.prompt_len}, max_new={spec.max_new})")
  if dtype.kind in "iu":
    if a.dtype.kind not in "iu":
      raise ValueError(f"{name} has dtype {a.dtype}, expected integers (stored as {dtype})")
    info = np.iinfo(dtype)
    if a.size and not np.can_cast(a.dtype, dtype) and (a.min() < info.min or a.max() > info.max):
      raise ValueError(
          f"{name} holds values in [{a.min()}, {a.max()}], outside the {dtype} range "
          f"[{info.min}, {info.max}]")
  elif dtype.kind == "b" and a.dtype.kind != "b":
    raise ValueError(f"{name} has dtype {a.dtype}, expected bool")
  elif a.dtype.kind not in "biuf":
    raise ValueError(f"{name} has dtype {a.dtype}, expected a real number dtype ({dtype})")
  return a.astype(dtype, copy=False)


def _validate_step(spec: TraceSpec, step) -> dict[str, np.ndarray]:
  if not isinstance(step, Mapping):
    raise ValueError(f"step must be a mapping of field name to array, got {type(step).__name__}")
  fields = spec.fields
  missing = [k for k in fields if k not in step]
  unknown = sorted(str(k) for k in step if k not in fields)
  if missing or unknown:
    raise ValueError(
        f"step has missing fields {missing} and unknown fields {unknown}; a step of this trace has "
        f"exactly {list(fields)}")
  out = {k: _as_field(spec, k, step[k]) for k in fields}
  lengths = out["lengths"]
  if lengths.min() < 0 or lengths.max() > spec.max_new:
    raise ValueError(
        f"lengths must lie in [0, max_new={spec.max_new}], got values in "
        f"[{lengths.min()}, {lengths.max()}]")
  return out


class _TraceHandle:
  """What a writer and a reader of one trace folder both expose."""

  _path: str
  _spec: TraceSpec
  _num_steps: int

  @property
  def path(self) -> str:
    return self._path

  @property
  def spec(self) -> TraceSpec:
    return self._spec

  @property
  def num_steps(self) -> int:
    """Complete steps in the trace (for a writer: the index the next ``append`` writes)."""
    return self._num_steps


class TraceWriter(_TraceHandle):
  """Appends one step per ``append`` to the trace at ``path`` (created, or reopened to continue).

  Reopening an existing trace requires the same ``batch``/``prompt_len``/``max_new``/``scalars``
  and continues after its last complete step (a half-written step is overwritten).
  """

  def __init__(self, path: str | os.PathLike, *, batch: int, prompt_len: int, max_new: int,
               scalars: Mapping[str, str] | Sequence[tuple[str, str]] = DEFAULT_SCALARS):
    self._spec = TraceSpec(batch=batch, prompt_len=prompt_len, max_new=max_new, scalars=scalars)
    self._path = _check_path(path)
    self._kv = ts.KvStore.open({"driver": "file", "path": self._path + "/"}).result()
    header = _read_header(self._kv, self._path)
    fields = self._spec.fields
    if header is None:
      self._capacity = _INITIAL_CAPACITY
      self._arrays = {name: _create_array(self._path, name, shape, dtype, self._capacity)
                      for name, (shape, dtype) in fields.items()}
      self._num_steps = 0
      _write_header(self._kv, self._spec, 0)  # the trace exists once its header does
    else:
      stored = TraceSpec.from_header(header)
      for name in ("batch", "prompt_len", "max_new", "scalars"):
        if getattr(stored, name) != getattr(self._spec, name):
          raise ValueError(
              f"{name}={getattr(self._spec, name)!r} does not match the existing trace at "
              f"{self._path!r} ({name}={getattr(stored, name)!r})")
      self._num_steps = int(header["num_steps"])
      arrays = {name: ts.open(_array_spec(self._path, name)).result() for name in fields}
      # a crash between the resizes of two arrays leaves different capacities: even them out
      self._capacity = max([self._num_steps, *(a.shape[0] for a in arrays.values())])
      self._arrays = {name: a if a.shape[0] == self._capacity else _resize(a, self._capacity)
                      for name, a in arrays.items()}
    self._closed = False

  def _check_open(self) -> None:
    if self._closed:
      raise ValueError(f"the TraceWriter of {self._path!r} is closed")

  def append(self, step: Mapping[str, object]) -> int:
    """Write one step (every field of ``spec.fields``, arrays of the exact shapes; integer fields
    take integer dtypes, float fields any real dtype) and commit it; returns its index. The step
    is validated before anything is written and becomes visible to readers only when complete."""
    self._check_open()
    data = _validate_step(self._spec, step)
    n = self._num_steps
    if n >= self._capacity:
      self._capacity = max(2 * self._capacity, n + 1, _INITIAL_CAPACITY)
      self._arrays = {k: _resize(a, self._capacity) for k, a in self._arrays.items()}
    futures = [self._arrays[k][n].write(x) for k, x in data.items()]
    for f in futures:
      f.result()
    _write_header(self._kv, self._spec, n + 1)  # commit: after every chunk of step n is written
    self._num_steps = n + 1
    return n

  def truncate(self, num_steps: int) -> None:
    """Drop the steps from ``num_steps`` on (e.g. to resume from a checkpoint taken earlier); the
    next ``append`` writes step ``num_steps``. Not atomic for readers: one that still holds the
    old count may read rewritten rows until its next ``refresh()``."""
    self._check_open()
    num_steps = int_arg(num_steps, "num_steps", 0, self._num_steps)
    _write_header(self._kv, self._spec, num_steps)
    self._num_steps = num_steps

  def close(self) -> None:
    """Trim every array to num_steps rows (deleting chunks past them). Idempotent."""
    if self._closed:
      return
    self._arrays = {k: _resize(a, self._num_steps) for k, a in self._arrays.items()}
    self._capacity = self._num_steps
    self._closed = True

  def __enter__(self) -> TraceWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class TraceReader(_TraceHandle):
  """Reads the complete steps of a trace, also while a writer (in any process) appends to it.

  ``num_steps`` is the count seen at open or at the last ``refresh()``; ``read`` reads within it.
  """

  def __init__(self, path: str | os.PathLike):
    self._path = _check_path(path)
    self._kv = ts.KvStore.open({"driver": "file", "path": self._path + "/"}).result()
    header = _read_header(self._kv, self._path)
    if header is None:
      raise ValueError(f"path={self._path!r} holds no trace (no zarr.json)")
    self._spec = TraceSpec.from_header(header)
    self._num_steps = int(header["num_steps"])
    self._arrays: dict[str, ts.TensorStore] = {}

  def refresh(self) -> int:
    """Re-read the committed step count (it may also shrink after a writer's ``truncate``)."""
    header = _read_header(self._kv, self._path)
    if header is None:
      raise ValueError(f"the trace at {self._path!r} was removed")
    self._num_steps = int(header["num_steps"])
    return self._num_steps

  def _array(self, name: str, rows: int) -> ts.TensorStore:
    arr = self._arrays.get(name)
    if arr is None or arr.shape[0] < rows:  # the writer grew it since: reopen for the new shape
      arr = self._arrays[name] = ts.open(_array_spec(self._path, name)).result()
    return arr

  def read(self, steps: int | slice | Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """Field name -> NumPy array of the requested complete steps: ``None`` (all), a slice or a
    sequence of step indices give a leading step axis; an int gives one step without it.
    Indices are taken within ``num_steps``; negative ones count from it."""
    n = self._num_steps
    fields = self._spec.fields
    if steps is None:
      steps = slice(None)
    if isinstance(steps, slice):
      idx = np.arange(n)[steps]
    else:
      idx = np.asarray(steps)
      if idx.size == 0 and idx.ndim == 1:
        idx = idx.astype(np.int64)  # [] is float64 to NumPy
      if idx.dtype.kind not in "iu" or idx.ndim > 1:
        raise ValueError(
            f"steps must be None, an int, a slice or a sequence of ints, got {steps!r}")
      if idx.size and (idx.min() < -n or idx.max() >= n):
        raise ValueError(f"steps={steps!r} is out of range for a trace of {n} complete steps")
      idx = np.where(idx < 0, idx + n, idx)
    if idx.size == 0:
      return {name: np.zeros((0, *shape), dtype) for name, (shape, dtype) in fields.items()}
    if idx.ndim == 0:
      index = int(idx)
    elif np.array_equal(idx, np.arange(idx[0], idx[0] + idx.size)):
      index = slice(int(idx[0]), int(idx[0]) + idx.size)  # contiguous: one box read per field
    else:
      index = idx
    rows = int(idx.max()) + 1
    futures = {name: self._array(name, rows)[index].read() for name in fields}
    return {name: np.asarray(f.result()) for name, f in futures.items()}


def read_traces(path: str | os.PathLike,
                steps: int | slice | Sequence[int] | None = None) -> dict[str, np.ndarray]:
  """``TraceReader(path).read(steps)``: the trace's complete steps as NumPy arrays."""
  return TraceReader(path).read(steps)
