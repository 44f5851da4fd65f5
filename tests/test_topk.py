"""``_topk``: top-k outputs that may be sliced, and several top-k id lists from one top-k. The
results equal ``lax.top_k``'s (ties included); on a CPU, the programs that slice them keep XLA's
TopK instead of sorting the whole vocabulary axis (the reason the module exists)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax import _topk, sampling
from specroll_jax.sampling import SamplingConfig

V = 4096


def _sorts_over(hlo: str, n: int) -> list[str]:
  """The sort instructions of compiled HLO text whose last dimension has ``n`` entries."""
  return [m for m in re.findall(r"= \S+\[([\d,]+)\]\S* sort\(", hlo) if m.split(",")[-1] == str(n)]


@pytest.mark.parametrize("ties", [False, True])
def test_top_k_and_top_ids_equal_lax_top_k(ties):
  rng = np.random.default_rng(11 + ties)
  x = rng.normal(size=(5, 3, 257)).astype(np.float32)
  if ties:  # few distinct values: every top-k cuts through a tie, broken by the lower index
    x = np.round(x * 2).astype(np.float32)
  x = jnp.asarray(x)
  for k in (1, 4, 16):
    v, i = jax.jit(_topk.top_k, static_argnums=1)(x, k)
    rv, ri = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  got = jax.jit(lambda x: _topk.top_ids(x, 16, 4, 1))(x)
  for ids, k in zip(got, (16, 4, 1), strict=True):
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(x, k)[1]))


def test_top_k_differentiable_through_the_mask():
  """The top-k sampling mask sits inside the trainer's log-probs: gradients flow (not through
  the threshold) and are those of the same mask built from lax.top_k."""
  x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 64)), jnp.float32)
  cfg = SamplingConfig(temperature=0.7, top_k=5)

  def ref(x):
    kth = jax.lax.top_k(x / 0.7, 5)[0][..., -1:]
    return jnp.where(x / 0.7 >= kth, x / 0.7, sampling.MASKED_LOGIT)

  loss = lambda f: lambda x: jax.nn.log_softmax(f(x))[:, :7].sum()
  g = jax.grad(loss(lambda x: sampling.allowed_logits(x, cfg)))(x)
  np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(loss(ref))(x)), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU pattern match")
def test_sliced_top_k_compiles_without_a_vocabulary_sort():
  """A prefix or the k-th entry of ``lax.top_k`` sorts the whole axis on a CPU with jax 0.10's
  XLA (jax 0.11.2's keeps it a TopK); through ``_topk`` it stays a TopK on both. On the 0.10
  line the first assertion shows the trap, so the test fails if that line's XLA changes."""
  x = jnp.zeros((8, V), jnp.float32)
  hlo = lambda f: jax.jit(f).lower(x).compile().as_text()
  trap = bool(_sorts_over(hlo(lambda x: jax.lax.top_k(x, 16)[0][..., -1:]), V))
  if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11):
    assert trap, "XLA no longer sorts a sliced lax.top_k on jax 0.10: check _topk's docstring"
  assert not _sorts_over(hlo(lambda x: _topk.top_k(x, 16)[0][..., -1:]), V)
  assert not _sorts_over(hlo(lambda x: _topk.top_ids(x, 16, 4)), V)
  cfg = SamplingConfig(temperature=1.0, top_k=50)
  assert not _sorts_over(hlo(lambda x: sampling.allowed_logits(x, cfg)), V)


def test_top_k_compiles_and_matches_inside_a_sharded_program(tmp_path):
  """On 4 CPU devices, ``_topk`` inside ``shard_map`` (as the data-parallel GRPO step runs the
  top-k sampling filter) compiles and gives lax.top_k's results. One barrier over both outputs
  crashed XLA's TopkDecomposer there (a check failure that kills the process), hence a
  subprocess."""
  from conftest import run_on_cpu_devices
  out = run_on_cpu_devices(tmp_path, """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from specroll_jax import _topk
mesh = jax.make_mesh((4,), ("d",))
x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 512)), jnp.float32)
xs = jax.device_put(x, NamedSharding(mesh, P("d")))
f = lambda tk: lambda x: (tk(x, 5)[0][..., -1:], tk(x, 5)[1][..., :2])
g = jax.jit(jax.shard_map(f(_topk.top_k), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
got, want = g(xs), f(jax.lax.top_k)(x)
print("RESULT " + json.dumps([bool((np.asarray(a) == np.asarray(b)).all())
                              for a, b in zip(got, want)]))
""")
  assert out == [True, True]
