"""Checkpointer: exact typed round trip, keep-last-k, killed saves ignored, resume, bad input."""

import os
import signal
import subprocess
import sys
import textwrap
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import PYTHONPATH

from app.checkpoint import Checkpointer


@flax.struct.dataclass
class Adaptation:
  bias: jax.Array  # [K, D] f32
  count: jax.Array  # [] int32
  decay: float = flax.struct.field(pytree_node=False)


class Monitor(NamedTuple):
  window: jax.Array  # [W] f32
  hits: np.ndarray  # [W] int64


def _state(seed: int = 0):
  k = jax.random.split(jax.random.key(seed), 4)
  params = {
      "embed": jax.random.normal(k[0], (16, 8), jnp.bfloat16),
      "layers": [{"w": jax.random.normal(k[1], (8, 8)), "b": jnp.arange(8, dtype=jnp.float32)},
                 {"w": jax.random.normal(k[2], (8, 8)), "b": -jnp.ones(8)}],
  }
  tx = optax.adamw(1e-2)
  opt = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  _, opt = tx.update(grads, opt, params)
  return {
      "params": params,
      "opt": opt,
      "ref": jax.tree.map(lambda p: p.astype(jnp.bfloat16), params),
      "adaptation": Adaptation(bias=jax.random.normal(k[3], (3, 8)), count=jnp.int32(7),
                               decay=0.9),
      "monitor": Monitor(window=jnp.linspace(0, 1, 5), hits=np.arange(5, dtype=np.int64)),
      "tokens_seen": jnp.asarray([3, 2**31 - 1], jnp.int32),
  }


def _assert_bit_exact(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g.reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8))


def test_round_trip_exact_types_and_resume(tmp_path):
  state, meta = _state(), {"step": 3, "data_position": 96, "seeds": [0, 1], "config": {"lr": 1e-2}}
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    assert ckpt.save(3, state, meta)
  # resume: a new Checkpointer on the directory sees the committed step
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.latest_step() == 3 and ckpt.all_steps() == [3]
    got, got_meta = ckpt.restore(like=jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert got_meta == meta and ckpt.restore_meta(3) == meta
  _assert_bit_exact(got, state)
  assert type(got["opt"][0]) is optax.ScaleByAdamState
  assert isinstance(got["adaptation"], Adaptation) and got["adaptation"].decay == 0.9
  assert isinstance(got["monitor"], Monitor)
  # the restored optimizer state continues exactly like the original one
  tx, grads = optax.adamw(1e-2), jax.tree.map(jnp.ones_like, state["params"])
  _assert_bit_exact(tx.update(grads, got["opt"], got["params"]),
                    tx.update(grads, state["opt"], state["params"]))


def test_keep_last_k_and_save_every(tmp_path):
  state = {"w": jnp.arange(4.0)}
  with Checkpointer(tmp_path, max_to_keep=2, save_every=2, async_save=False) as ckpt:
    saved = [ckpt.save(s, {"w": state["w"] + s}, {"step": s}) for s in range(7)]
    assert saved == [True, False, True, False, True, False, True]
    assert ckpt.save(7, state, force=True)
    assert ckpt.all_steps() == [6, 7]
    got, meta = ckpt.restore(6, like=state)
    np.testing.assert_array_equal(got["w"], np.arange(4.0) + 6)
    assert meta == {"step": 6}
  assert sorted(p.name for p in tmp_path.iterdir()) == ["6", "7"]


_KILLED_SAVE = textwrap.dedent("""
  import os, sys, time
  import jax.numpy as jnp
  from app.checkpoint import Checkpointer

  ckpt = Checkpointer(sys.argv[1], max_to_keep=3)
  ckpt.save(0, {"w": jnp.zeros((512, 1024))}, {"step": 0})
  ckpt.wait()
  rename = os.rename

  def stalled_rename(src, dst, *args, **kwargs):  # hold the commit so SIGKILL lands mid-save
    if "orbax-checkpoint-tmp" in os.fspath(src):
      print("COMMITTING", flush=True)
      time.sleep(600)
    return rename(src, dst, *args, **kwargs)

  os.rename = stalled_rename
  ckpt.save(1, {"w": jnp.ones((512, 1024))}, {"step": 1})
  ckpt.wait()
  print("DONE", flush=True)
""")


def test_save_killed_mid_write_is_ignored(tmp_path):
  """A process SIGKILLed while saving step 1 (data written, not committed) leaves a tmp directory;
  a new Checkpointer restores step 0 and can save step 1 again."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=PYTHONPATH)
  proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    line = proc.stdout.readline().strip()
    assert line == "COMMITTING", f"child did not stall in the commit: {line!r}\n" + (
        proc.stderr.read() if proc.poll() is not None else "")
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  assert any("orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir())
  like = {"w": jax.ShapeDtypeStruct((512, 1024), jnp.float32)}
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == [0] and ckpt.latest_step() == 0
    got, meta = ckpt.restore(like=like)
    assert meta == {"step": 0} and not np.asarray(got["w"]).any()
    assert ckpt.save(1, {"w": jnp.full((512, 1024), 2.0)}, {"step": 1})
    ckpt.wait()
    assert ckpt.latest_step() == 1
    assert np.all(np.asarray(ckpt.restore(like=like)[0]["w"]) == 2.0)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]


def test_partial_tmp_directory_is_ignored(tmp_path):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(4, {"w": jnp.ones(3)}, {"step": 4})
  partial = tmp_path / "5.orbax-checkpoint-tmp" / "state"
  partial.mkdir(parents=True)
  (partial / "garbage").write_bytes(b"\x00" * 100)
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == [4]
    assert ckpt.restore(like={"w": np.zeros(3, np.float32)})[1] == {"step": 4}


def test_bad_input(tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  with pytest.raises(ValueError, match="directory=.*not a directory"):
    Checkpointer(a_file)
  with pytest.raises(ValueError, match="max_to_keep must be None or an int >= 1, got 0"):
    Checkpointer(tmp_path / "c", max_to_keep=0)
  with pytest.raises(ValueError, match="save_every must be an int >= 1, got 0"):
    Checkpointer(tmp_path / "c", save_every=0)
  state = {"w": jnp.ones((2, 3)), "n": jnp.int32(1)}
  with Checkpointer(tmp_path / "c", async_save=False) as ckpt:
    with pytest.raises(ValueError, match="no complete checkpoint in .* to restore"):
      ckpt.restore(like=state)
    with pytest.raises(ValueError, match=r"meta\['seed'\] is a int64"):
      ckpt.save(0, state, {"seed": np.int64(3)})
    with pytest.raises(ValueError, match=r"state leaf \['name'\] is a str"):
      ckpt.save(0, {**state, "name": "x"})
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
      ckpt.save(-1, state)
    assert ckpt.all_steps() == []  # nothing was written by the rejected saves
    ckpt.save(2, state, {"step": 2})
    with pytest.raises(ValueError, match="step=2 must be greater than the latest saved step 2"):
      ckpt.save(2, state)
    with pytest.raises(ValueError, match=r"step=5 is not a complete checkpoint .*\[2\]"):
      ckpt.restore(5, like=state)
    with pytest.raises(ValueError, match=r"in the checkpoint but not in like: \['n'\]; .*"
                                         r"in like but not in the checkpoint: \['m'\]"):
      ckpt.restore(like={"w": state["w"], "m": state["n"]})
    with pytest.raises(ValueError, match=r"like leaf w has shape \(3, 2\) dtype float32 but the "
                                         r"checkpoint at step 2 holds shape \(2, 3\)"):
      ckpt.restore(like={**state, "w": jnp.ones((3, 2))})
    with pytest.raises(ValueError, match="like leaf w has shape .* dtype bfloat16"):
      ckpt.restore(like={**state, "w": jnp.ones((2, 3), jnp.bfloat16)})
    got, _ = ckpt.restore(like=state)
    _assert_bit_exact(got, state)
