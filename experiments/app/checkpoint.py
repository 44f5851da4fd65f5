"""Checkpoints of a training run (orbax): a state pytree plus a JSON ``meta`` dict per step.

Step ``s`` is the directory ``<directory>/<s>/`` holding two orbax items: ``state`` (any pytree that
``jax.tree`` handles -- dicts, lists, tuples, NamedTuples, optax states, flax.struct dataclasses --
whose leaves are jax/NumPy arrays of any dtype or Python ints/floats) and ``meta`` (JSON: step, data
position, seeds, config echo).

Atomicity: orbax writes ``<s>.orbax-checkpoint-tmp/`` and renames it to ``<s>/`` once every item is
written, so a step is complete or absent. A process killed mid-save leaves only the tmp directory,
which ``all_steps``/``latest_step``/``restore`` ignore and which a later save of the same step
replaces. One writing process (or one orbax multi-host group) per directory.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from specroll_jax._fields import int_arg

_JSON_SCALARS = (str, int, float, bool, type(None))


def _check_json(value, where: str) -> None:
  """Raise ValueError naming the first entry of ``value`` that JSON cannot hold exactly."""
  if isinstance(value, _JSON_SCALARS):
    return
  if isinstance(value, dict):
    for k, v in value.items():
      if not isinstance(k, str):
        raise ValueError(f"{where} key {k!r} is a {type(k).__name__}; JSON keys must be str")
      _check_json(v, f"{where}[{k!r}]")
    return
  if isinstance(value, list | tuple):
    for i, v in enumerate(value):
      _check_json(v, f"{where}[{i}]")
    return
  raise ValueError(
      f"{where} is a {type(value).__name__} ({value!r:.60}), which JSON cannot hold; use "
      "str, int, float, bool, None, lists and dicts (e.g. int(x) for a NumPy/JAX integer)")


def _abstract(path, x):
  """A leaf of the restore target: ShapeDtypeStruct (with sharding for jax.Array) or int/float."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  if isinstance(x, np.ndarray | np.generic):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  if isinstance(x, int | float):
    return x
  raise ValueError(
      f"like leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}; a restore target holds "
      "arrays, jax.ShapeDtypeStruct or Python int/float leaves")


def _check_state_leaf(path, x) -> None:
  if not isinstance(x, jax.Array | np.ndarray | np.generic | int | float):
    raise ValueError(
        f"state leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}; a checkpointed state "
        "holds arrays and Python int/float leaves (put strings and config in meta)")


def _flat(tree) -> tuple[dict, object]:
  """({name: leaf}, treedef) of a pytree, in flatten order. A name is the leaf's key path with
  every other character than letters and digits turned into "_" (made unique with a suffix when
  two paths collide). orbax then stores a flat dict of arrays, whatever the pytree's node types
  (its own tree serialisation trips over, e.g., optax chains that start with an empty state); the
  caller's ``like`` brings the types back on restore."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  out = {}
  for path, leaf in leaves:
    key = "".join(c if c.isalnum() else "_" for c in jax.tree_util.keystr(path))
    key = "_".join(p for p in key.split("_") if p) or "root"
    name, n = key, 1
    while name in out:
      n += 1
      name = f"{key}__{n}"
    out[name] = leaf
  return out, treedef


class Checkpointer:
  """Saves and restores ``(state, meta)`` per training step in ``directory``, keeping the last k.

  ``max_to_keep``: complete steps kept (older ones are deleted after a save commits); None keeps
  all. ``save_every``: ``save`` writes only steps divisible by it (``force=True`` writes any step).
  ``async_save``: ``save`` returns once the arrays are copied to host and writes in a background
  thread; ``wait()`` (or the next save/restore, or ``close()``) blocks until it is on disk.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
               save_every: int = 1, async_save: bool = True):
    path = os.fspath(directory)
    if not path:
      raise ValueError("directory must be a non-empty path, got ''")
    if "://" not in path:
      path = os.path.abspath(path)
      if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"directory={path!r} exists and is not a directory")
    max_to_keep = int_arg(max_to_keep, "max_to_keep", 1, optional=True)
    save_every = int_arg(save_every, "save_every", 1)
    self._directory = path
    self._save_every = save_every
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=1, create=True,
        enable_async_checkpointing=bool(async_save))
    self._mgr = ocp.CheckpointManager(
        path, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  @property
  def directory(self) -> str:
    return self._directory

  def all_steps(self) -> list[int]:
    """Steps saved, ascending (including one whose async save in this process is in flight)."""
    return sorted(int(s) for s in self._mgr.all_steps())

  def latest_step(self) -> int | None:
    """The newest saved step, or None when there is none. A fresh Checkpointer on a directory
    sees only complete steps; this one also sees its own in-flight async save (``wait()``)."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, state, meta: dict | None = None, *, force: bool = False) -> bool:
    """Save ``state`` (pytree) and ``meta`` (JSON dict) as ``step`` when ``step % save_every == 0``
    or ``force``; returns whether a save was started. ``step`` must exceed ``latest_step()``.
    Arguments are validated before anything is written; the step appears atomically."""
    step = int_arg(step, "step", 0)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict):
      raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
    _check_json(meta, "meta")
    jax.tree_util.tree_map_with_path(_check_state_leaf, state)
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(
          f"step={step} must be greater than the latest saved step {latest} in {self._directory}")
    if not force and step % self._save_every:
      return False
    flat, _ = _flat(state)
    return bool(self._mgr.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                      meta=ocp.args.JsonSave(meta)), force=True))

  def _resolve_step(self, step) -> int:
    self.wait()
    steps = self.all_steps()
    if not steps:
      raise ValueError(f"no complete checkpoint in {self._directory} to restore")
    if step is None:
      return steps[-1]
    step = int_arg(step, "step", 0)
    if step not in steps:
      raise ValueError(
          f"step={step} is not a complete checkpoint in {self._directory}; saved steps: {steps}")
    return step

  def _check_like(self, step: int, wanted: dict) -> None:
    stored = self._mgr.item_metadata(step)["state"]
    stored = dict(getattr(stored, "tree", stored))
    missing = sorted(k for k in stored.keys() - wanted.keys())
    extra = sorted(k for k in wanted.keys() - stored.keys())
    if missing or extra:
      raise ValueError(
          f"like does not match the structure of the state saved at step {step} in "
          f"{self._directory}: leaves in the checkpoint but not in like: {missing[:8]}"
          f"{' ...' if len(missing) > 8 else ''}; leaves in like but not in the checkpoint: "
          f"{extra[:8]}{' ...' if len(extra) > 8 else ''}")
    for key, want in wanted.items():
      have = stored[key]
      have_shape = tuple(getattr(have, "shape", ()) or ())
      if isinstance(want, int | float):
        if have_shape != ():
          raise ValueError(
              f"like leaf {key} is a scalar but the checkpoint at step {step} holds "
              f"shape {have_shape}")
        continue
      have_dtype = getattr(have, "dtype", None)
      if tuple(want.shape) != have_shape or (
          have_dtype is not None and np.dtype(want.dtype) != np.dtype(have_dtype)):
        raise ValueError(
            f"like leaf {key} has shape {tuple(want.shape)} dtype "
            f"{np.dtype(want.dtype)} but the checkpoint at step {step} holds shape {have_shape} "
            f"dtype {have_dtype}")

  def restore(self, step: int | None = None, *, like):
    """``(state, meta)`` of ``step`` (default: the latest complete step).

    ``like``: a pytree with the structure of the saved state -- concrete arrays or
    ``jax.ShapeDtypeStruct`` leaves (e.g. ``jax.eval_shape`` of the init). The state comes back with
    ``like``'s treedef (optax states, NamedTuples and flax.struct dataclasses keep their types;
    static fields come from ``like``), its shardings, and bit-exact values. Raises ValueError when
    there is no such step or when ``like``'s leaves, shapes or dtypes differ from the checkpoint's.
    """
    step = self._resolve_step(step)
    target, treedef = _flat(jax.tree_util.tree_map_with_path(_abstract, like))
    self._check_like(step, target)
    out = self._mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    state = jax.tree_util.tree_unflatten(treedef, [out["state"][k] for k in target])
    return state, out["meta"]

  def restore_meta(self, step: int | None = None) -> dict:
    """The ``meta`` dict of ``step`` (default: the latest complete step), without the state."""
    step = self._resolve_step(step)
    return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def wait(self) -> None:
    """Block until an in-flight async save is committed (re-raises its error, if any)."""
    self._mgr.wait_until_finished()

  def close(self) -> None:
    """Wait for pending saves and release orbax's threads."""
    self._mgr.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
