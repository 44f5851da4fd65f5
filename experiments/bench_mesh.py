"""Memory per device and collective bytes of model-parallel rollouts (docs/benchmarks.md,
"Rollouts on a (data, model) mesh").

  .venv/bin/python experiments/bench_mesh.py                       # 1.5B and 7B, model 1/2/4/8
  .venv/bin/python experiments/bench_mesh.py --shapes 7b --rows 512 --cache 768

For each Qwen2.5 shape (``app.widen.QWEN25_SHAPES``, the real vocabulary, bfloat16) and each
model axis size the shape allows (it must divide the query heads, the KV heads, the vocabulary and
the FFN width: ``ModelMesh.check_config``), two programs are compiled, never run, on the CPU's host
devices with abstract inputs placed as ``ModelMesh.shard_params`` / ``constrain_cache`` place them
(every device on the model axis; nothing allocated):

* decode step: one token per row appended to a [rows, cache] KV cache (donated), then sampled
  (``decoder.append_step`` + ``sampling.sample_from_hidden``);
* verify step: ``--nodes`` + 1 tree tokens per row over the cache (``decoder.step`` with a tree
  mask) and a sample at every node (what a speculative step's target forward does).

Memory per device: the weights and the KV cache each device holds (from the shardings; what the
accelerator keeps resident; XLA's compile-time analysis of the partitioned program gives the same
argument bytes), and that analysis's temporaries. The temporaries are XLA:CPU's with the jnp
reference attention (the CPU's path: it expands the cache's KV heads to the query heads in float32
for every layer, where the Pallas kernels read the cache in place) and float32 dots, so they
overstate an accelerator's many times; they fall with the model axis as the weights do. Collective
bytes per step are read from the compiled HLO (``mesh.collectives``): the programs of the same shape
with 1 and 2 layers give the per-layer and the fixed part, so a collective inside the layer loop
counts once per layer. The time columns are on paper: weight and KV bytes per device read once at
the HBM bandwidth, plus the all-reduce bytes through a ring (2 (m - 1) / m of them per device) at
the interconnect bandwidth, for a TPU v5e-8 (819 GB/s HBM, 200 GB/s ICI per chip) and 8 H100 SXM
(3.35 TB/s HBM, 450 GB/s NVLink per direction); latency per collective not included.
Writes JSON to --out.
"""

from __future__ import annotations

import os
import sys

_DEVICES = "--xla_force_host_platform_device_count="
if __name__ == "__main__" and _DEVICES not in os.environ.get("XLA_FLAGS", ""):
  _argv = " ".join(sys.argv[1:]).replace("--devices=", "--devices ").split()
  _n = _argv[_argv.index("--devices") + 1] if "--devices" in _argv[:-1] else "8"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}{_n}".strip()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from app import cli  # noqa: E402
from app.widen import QWEN25_SHAPES  # noqa: E402
from specroll_jax import models  # noqa: E402
from specroll_jax._machine import cpu_model  # noqa: E402
from specroll_jax.kernels import Kernels  # noqa: E402
from specroll_jax.mesh import ModelMesh, collectives, make_mesh  # noqa: E402
from specroll_jax.models import decoder  # noqa: E402
from specroll_jax.sampling import SamplingConfig, sample_from_hidden  # noqa: E402

GB = 1e9
LOOP = [None]  # the library's layer loop (decoder.LayerLoop()): per-layer cache buffers
MACHINES = {"TPU v5e-8": (819e9, 200e9), "8x H100": (3.35e12, 450e9)}  # (HBM, link) bytes/s


def shape_config(name: str, layers: int | None = None) -> models.ModelConfig:
  s = QWEN25_SHAPES[name]
  return models.ModelConfig(
      vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
      num_layers=layers or s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
      head_dim=s.head_dim, rope_theta=1e6, qkv_bias=True,
      tie_word_embeddings=s.tie_word_embeddings, max_position_embeddings=32768, dtype="bfloat16")


def abstract_inputs(config, mm: ModelMesh, rows: int, cache: int):
  """(params, KV cache) as ShapeDtypeStructs placed on the mesh (stacked cache: one buffer)."""
  shapes = jax.eval_shape(lambda: decoder.init_params(jax.random.key(0), config))
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=NamedSharding(mm.mesh, mm.param_spec(p, x))),
      shapes)
  kv = jax.eval_shape(lambda: decoder.init_cache(config, rows, cache, layout=LOOP[0]))
  buf = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
      mm.mesh, mm.cache_spec(x.ndim, x.shape[0])))
  lengths = jax.ShapeDtypeStruct(kv.lengths.shape, kv.lengths.dtype,
                                 sharding=NamedSharding(mm.mesh, P()))
  kv = kv.replace(k=jax.tree.map(buf, kv.k), v=jax.tree.map(buf, kv.v), lengths=lengths)
  return params, kv


def programs(config, mm: ModelMesh, rows: int, cache: int, nodes: int):
  """{name: compiled} for the decode and the verify step."""
  kern = Kernels.resolve("reference", mesh=mm)
  cfg = SamplingConfig(temperature=1.0)
  params, kv = abstract_inputs(config, mm, rows, cache)
  rep = NamedSharding(mm.mesh, P())
  tok = lambda t: jax.ShapeDtypeStruct((rows, t), jnp.int32, sharding=rep)

  def decode(params, kv, tokens):
    slots = kv.lengths[:, None]
    h, kv = decoder.append_step(config, params, tokens, kv, slots, kernels=kern)
    t, lp, _ = sample_from_hidden(config, params, h, 0, jnp.arange(rows), kv.lengths[:, None],
                                  cfg, kern)
    return t, lp, kv.replace(lengths=kv.lengths + 1)

  def verify(params, kv, tokens):
    t = tokens.shape[1]
    pos = kv.lengths[:, None] + jnp.arange(t)[None]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (rows, t, t))
    out = decoder.step(config, params, tokens, pos, kv, mask, kernels=kern, compute_logits=False)
    s, lp, _ = sample_from_hidden(config, params, out.hidden, 0,
                                  jnp.broadcast_to(jnp.arange(rows)[:, None], (rows, t)), pos,
                                  cfg, kern)
    return s, lp, out.k_new, out.v_new

  with decoder.layer_loop(LOOP[0] or decoder.layer_loop_policy()):
    return {
        "decode": jax.jit(decode, donate_argnums=1).lower(params, kv, tok(1)).compile(),
        "verify": jax.jit(verify).lower(params, kv, tok(nodes + 1)).compile()}


def memory(compiled) -> dict:
  """XLA's compile-time memory analysis of the partitioned program (bytes per device)."""
  m = compiled.memory_analysis()
  return {"arguments": int(m.argument_size_in_bytes),
          "outputs": int(m.output_size_in_bytes - m.alias_size_in_bytes),
          "temp": int(m.temp_size_in_bytes)}


def collective_bytes(name, mm, rows, cache, nodes) -> dict:
  """Per program: all-reduce / all-gather / other bytes per step, per device, the layer loop's
  collectives counted once per layer (from the 1- and 2-layer programs)."""
  full = shape_config(name).num_layers
  per = {}
  for layers in (1, 2):
    progs = programs(shape_config(name, layers), mm, rows, cache, nodes)
    per[layers] = {k: collectives(c.as_text()) for k, c in progs.items()}
  out = {}
  for prog in ("decode", "verify"):
    row = {}
    for kind in ("all-reduce", "all-gather", "other"):
      pick = lambda cs, k=kind: sum(c.bytes for c in cs if (c.kind == k or k == "other" and
                                                            c.kind not in ("all-reduce",
                                                                           "all-gather")))
      one, two = pick(per[1][prog]), pick(per[2][prog])
      row[kind] = one + (two - one) * (full - 1)
    row["count"] = len(per[1][prog]) + (len(per[2][prog]) - len(per[1][prog])) * (full - 1)
    out[prog] = row
  return out


def parse(argv):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shapes", nargs="+", default=["1.5b", "7b"], choices=sorted(QWEN25_SHAPES))
  ap.add_argument("--models", nargs="+", type=int, default=[1, 2, 4, 8],
                  help="model axis sizes (each <= --devices)")
  ap.add_argument("--rows", type=int, default=512, help="rows per batch")
  ap.add_argument("--cache", type=int, default=768,
                  help="KV positions per row (prompt width + max_new_tokens)")
  ap.add_argument("--nodes", type=int, default=4, help="tree nodes per row in the verify step")
  ap.add_argument("--devices", type=int, default=8, help="host devices (set before jax starts)")
  ap.add_argument("--out", default="runs/bench_mesh.json")
  a = ap.parse_args(argv)
  for flag, v in (("--rows", a.rows), ("--cache", a.cache), ("--nodes", a.nodes)):
    if v < 1:
      cli.fail(flag, v, "must be >= 1")
  if max(a.models) > jax.device_count():
    cli.fail("--models", a.models, f"this process has {jax.device_count()} devices "
             "(--devices=N sets them before jax starts)")
  return a


def main(argv=None):
  a = parse(argv)
  results = []
  for name in a.shapes:
    config = shape_config(name)
    for m in a.models:
      mm = ModelMesh(make_mesh(1, m))
      try:
        mm.check_config(config)
      except ValueError as e:
        print(f"{name} model={m}: skipped ({e})", flush=True)
        results.append({"shape": name, "model": m, "skipped": str(e)})
        continue
      t0 = time.perf_counter()
      progs = programs(config, mm, a.rows, a.cache, a.nodes)
      mem = {k: memory(c) for k, c in progs.items()}
      coll = collective_bytes(name, mm, a.rows, a.cache, a.nodes)
      params, kv = abstract_inputs(config, mm, a.rows, a.cache)
      nbytes = lambda tree: sum(jnp.dtype(x.dtype).itemsize * math.prod(
          x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(tree))
      weights, kv_bytes = nbytes(params), nbytes((kv.k, kv.v))
      paper = {}
      for machine, (hbm, link) in MACHINES.items():
        for prog in ("decode", "verify"):
          ring = 2 * (m - 1) / m * (coll[prog]["all-reduce"] + coll[prog]["all-gather"])
          paper[f"{machine} {prog} ms"] = round(1e3 * ((weights + kv_bytes) / hbm + ring / link),
                                                3)
      row = {"shape": name, "model": m, "weights_gb": weights / GB, "kv_gb": kv_bytes / GB,
             "memory": mem, "arguments_gb": mem["decode"]["arguments"] / GB,
             "decode_temp_gb": mem["decode"]["temp"] / GB,
             "verify_temp_gb": mem["verify"]["temp"] / GB,
             "collectives": coll, "paper": paper,
             "compile_s": round(time.perf_counter() - t0, 1)}
      results.append(row)
      print(f"{name} model={m}: weights {row['weights_gb']:.2f} GB, KV {row['kv_gb']:.2f} GB, "
            f"arguments {row['arguments_gb']:.2f} GB, XLA:CPU temporaries decode "
            f"{row['decode_temp_gb']:.2f} GB, verify {row['verify_temp_gb']:.2f} GB per device; "
            f"all-reduce {coll['decode']['all-reduce'] / 1e6:.2f} / "
            f"{coll['verify']['all-reduce'] / 1e6:.2f} MB, all-gather "
            f"{coll['decode']['all-gather'] / 1e6:.2f} / {coll['verify']['all-gather'] / 1e6:.2f}"
            f" MB per decode / verify step ({row['compile_s']} s to compile)", flush=True)
  print()
  print(f"rows {a.rows}, cache {a.cache}, verify {a.nodes + 1} tokens per row, bfloat16; "
        f"compiled on {cpu_model()} ({jax.device_count()} host devices), jax {jax.__version__}")
  head = ("| shape | model | weights GB | KV GB | XLA:CPU temp decode / verify GB | "
          "decode all-reduce MB | "
          "verify all-reduce MB | verify all-gather MB | " + " | ".join(
              f"{k} decode / verify ms" for k in MACHINES) + " |")
  print(head)
  print("|" + "---|" * (head.count("|") - 1))
  for r in results:
    if "skipped" in r:
      print(f"| {r['shape']} | {r['model']} | refused: {r['skipped'].split(';')[0]} |")
      continue
    c = r["collectives"]
    cells = [f"{r['weights_gb']:.2f}", f"{r['kv_gb']:.2f}",
             f"{r['decode_temp_gb']:.2f} / {r['verify_temp_gb']:.2f}",
             f"{c['decode']['all-reduce'] / 1e6:.1f}",
             f"{c['verify']['all-reduce'] / 1e6:.1f}", f"{c['verify']['all-gather'] / 1e6:.1f}"]
    cells += [f"{r['paper'][f'{k} decode ms']:.2f} / {r['paper'][f'{k} verify ms']:.2f}"
              for k in MACHINES]
    print(f"| {r['shape']} | {r['model']} | " + " | ".join(cells) + " |")
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"machine": cpu_model(), "python": platform.python_version(),
                             "jax": jax.__version__, "args": vars(a), "results": results},
                            indent=1))
  return results


if __name__ == "__main__":
  main()
