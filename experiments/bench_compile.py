"""Lower and compile seconds per rollout program, layers unrolled vs scanned (docs/benchmarks.md,
"Compile time").

  .venv/bin/python experiments/bench_compile.py                      # embedded model (4 layers)
  .venv/bin/python experiments/bench_compile.py --layers 28 --run 3  # same function in 28 layers
  .venv/bin/python experiments/bench_compile.py --shape 1.5b --lower-only   # Qwen2.5-1.5B shape

Programs: the vanilla engine and the speculative engine with ``Merged`` (root-conditioned heads +
group lookup) and ``MergedReflex``, each with 1 and 4 buckets (4 nodes per row in every speculative
bucket); ``--programs trainer`` adds the gradient of the responses' logprobs (a GRPO step's model
part), ``--programs cost`` goodput's cost model as the default ``SpecRoll`` measures it
(``SpecRoll.measure_cost``, an empty cost cache: every program it compiles, with jax's own compile
events summed; the default layer loop). Each under each layer loop (``layer_loop.LayerLoop``):
"unroll" (every forward unrolled), "mixed" (forwards without a cache scanned, steps over the cache
unrolled) and "scan" (every forward scanned, stacked KV cache); the table's title names the
library's default. Each program is traced afresh (``jax.clear_caches()``, a new ``jax.jit``) and
timed once, after one untimed warm-up compile: lower seconds (trace + StableHLO) and compile
seconds (XLA), wall clock and this process's CPU seconds (steadier when other jobs share the
cores). ``--run R`` also times warm calls, R rounds over the loops in turn (median per loop).

``--layers N`` widens the model to N layers of the same width (``app.widen``: the added layers
are identities, so tokens and acceptance stay the embedded model's); ``--shape`` widens it into a
Qwen2.5 shape with abstract parameters (nothing allocated; no ``--run``). Writes JSON to --out.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import _common
import jax
import jax.numpy as jnp
import numpy as np

from app import cli, pipeline
from app.widen import QWEN25_SHAPES, WideShape, widen, widened_config
from specroll_jax import engines, rollout
from specroll_jax._machine import cpu_model
from specroll_jax.adaptation.reflex import init_global
from specroll_jax.grpo.logprobs import trainer_logprobs
from specroll_jax.models import layer_loop
from specroll_jax.proposers import GroupLookup, Merged, MergedReflex, RankedHeads
from specroll_jax.specroll import DEFAULT_REFLEX

LOOPS = ("unroll", "mixed", "scan")
PROGRAMS = ("vanilla", "merged", "merged_reflex", "trainer", "cost")
COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "lower_s",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
                  "/jax/core/compile/backend_compile_duration": "compile_s"}


def _policy(name: str) -> layer_loop.LayerLoop:
  if name == "mixed":
    return layer_loop.LayerLoop(full="scan", cached="unroll")
  return layer_loop.LayerLoop.resolve(name)


def build_model(a):
  """(config, params, cond heads, tokenizer): the embedded model, optionally widened."""
  config, params, tok, path = _common.load_model(a)
  heads = pipeline.default_heads(config, params, tok, path, conditioned=True,
                                 progress=sys.stdout.isatty())
  if a.shape is not None:
    shape = QWEN25_SHAPES[a.shape]
  elif a.layers is not None:
    shape = WideShape(hidden_size=config.hidden_size, num_layers=a.layers,
                      num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                      head_dim=config.head_dim, intermediate_size=config.intermediate_size,
                      tie_word_embeddings=config.tie_word_embeddings)
  else:
    return config, params, heads, tok
  key = jax.random.key(a.seed)
  if a.shape is not None:  # abstract: shapes and dtypes only
    # the small model's weights are concrete (widen prepares them on the host); only the big
    # arrays are abstract
    wide = lambda: widen(config, params, shape, key=key, heads=heads, dtype=a.dtype)[1:]
    params, heads = jax.eval_shape(wide)
    return widened_config(config, shape, dtype=a.dtype), params, heads, tok
  big_config, params, heads = widen(config, params, shape, key=key, heads=heads,
                                    dtype=a.dtype)
  return big_config, params, heads, tok


def engine_and_args(kind: str, buckets: int, config, params, heads, tok, a, pb):
  """(engine, traced arguments) of one program."""
  fractions = (1.0, 0.5, 0.25, 0.125)[:buckets]
  common = dict(sampling=rollout.SamplingConfig(temperature=1.0), max_new_tokens=a.max_new_tokens,
                cache_length=pb.cache_length)
  batch = pb.device(a.seed)
  if kind == "trainer":  # the GRPO step's forward and backward: grad of the responses' logprobs
    b, m = len(pb.tokens), a.max_new_tokens
    toks = jax.random.randint(jax.random.key(a.seed), (b, m), 0, config.vocab_size)
    lens = jnp.full((b,), m, jnp.int32)

    def grad(p, prompts, prompt_lengths, tokens, lengths):
      score = lambda p: trainer_logprobs(config, p, prompts, prompt_lengths, tokens, lengths,
                                         common["sampling"]).logprobs.sum()
      return jax.grad(score)(p)

    return grad, (params, batch.tokens, batch.lengths, toks, lens)
  if kind == "vanilla":
    eng = engines.VanillaEngine.build(config, bucket_fractions=fractions, **common)
    return eng, (params, batch)
  mg = Merged(heads=RankedHeads(max_nodes=8), lookup=GroupLookup(group_size=a.group), max_nodes=8)
  spec = rollout.SpecConfig(bucket_fractions=fractions, nodes=(4,) * buckets)
  if kind == "merged":
    prop, pp = mg, mg.params(heads)
  else:
    prop = MergedReflex(merged=mg, reflex=DEFAULT_REFLEX)
    pp = prop.params(heads, init_global(prop.reflex))
  eng = engines.SpecEngine.build(config, proposer=prop, spec=spec, **common)
  return eng, (params, pp, batch)


def cost_model_seconds(config, params, heads, ids, a) -> dict:
  """Seconds of goodput's cost measurement as the default ``SpecRoll`` runs it on this batch:
  wall clock in all, and jax's trace + lower and XLA compile seconds and program count (its
  compile events), from an empty cost cache."""
  import os
  import tempfile
  from unittest import mock

  from specroll_jax.specroll import SpecRoll
  sr = SpecRoll(config, group_size=a.group, max_new_tokens=a.max_new_tokens)
  state = sr.init(heads)
  batch = sr.batch(ids, np.arange(len(ids)))
  sums = {"lower_s": 0.0, "compile_s": 0.0, "programs": 0}

  def listen(event, secs, **_):
    if event in COMPILE_EVENTS:
      sums[COMPILE_EVENTS[event]] += secs
      sums["programs"] += event.endswith("backend_compile_duration")

  jax.clear_caches()
  with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, SPECROLL_CACHE=tmp):
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
      t0 = time.perf_counter()
      cost = sr.measure_cost(params, state, batch)
      wall = time.perf_counter() - t0
    finally:
      jax.monitoring.unregister_event_duration_listener(listen)
  return {**sums, "total_s": wall, "cost_rows": list(cost.rows),
          "cost_nodes": list(cost.node_counts)}


def compile_once(engine, args, loop: str, lower_only: bool):
  """(lower and compile seconds, wall and CPU, of ``engine`` traced afresh under ``loop``; the
  compiled program or None)."""
  jax.clear_caches()
  with layer_loop.layer_loop(_policy(loop)):
    fn = jax.jit(lambda *xs: engine(*xs))
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = fn.lower(*args)
    t1, c1 = time.perf_counter(), time.process_time()
    res = {"lower_s": t1 - t0, "lower_cpu_s": c1 - c0}
    if lower_only:
      return res, None
    compiled = lowered.compile()
    res.update(compile_s=time.perf_counter() - t1, compile_cpu_s=time.process_time() - c1)
  return res, compiled


def run_interleaved(compiled: dict, args, rounds: int) -> dict:
  """Per loop: median wall and CPU seconds of a warm call over ``rounds`` rounds that call every
  loop's program in turn (so all see the same machine state), and a hash of the tokens."""
  out, times = {}, {lp: [] for lp in compiled}
  for lp, fn in compiled.items():  # the first call also moves the inputs: not timed
    out[lp] = jax.block_until_ready(fn(*args))
  for _ in range(rounds):
    for lp, fn in compiled.items():
      t0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn(*args))
      times[lp].append((time.perf_counter() - t0, time.process_time() - c0))
  res = {}
  for lp, o in out.items():
    wall, cpu = np.median(times[lp], axis=0)
    res[lp] = {"run_s": float(wall), "run_cpu_s": float(cpu)}
    if hasattr(o, "tokens"):
      res[lp].update(forwards=int(o.stats.forwards),
                     token_hash=int(np.asarray(o.tokens, np.int64).sum() * 7919
                                    + np.asarray(o.lengths, np.int64).sum()))
  return res


def main(argv=None):
  ap = cli.ArgumentParser(description=__doc__)
  _common.add_shared_flags(ap, out="runs/bench_compile.json", prompts=4, group=8,
                           max_new_tokens=128)
  ap.add_argument("--layers", type=int, default=None,
                  help="widen to this many layers of the same width (identity layers added)")
  ap.add_argument("--shape", choices=sorted(QWEN25_SHAPES), default=None,
                  help="widen into this Qwen2.5 shape (abstract parameters)")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                  help="widened model dtype (default: the source's)")
  ap.add_argument("--buckets", type=int, nargs="+", default=[1, 4], choices=(1, 2, 3, 4))
  ap.add_argument("--programs", nargs="+", default=list(PROGRAMS[:3]), choices=PROGRAMS,
                  help="trainer: the gradient of the responses' logprobs")
  ap.add_argument("--loops", nargs="+", default=list(LOOPS), choices=LOOPS)
  ap.add_argument("--lower-only", action="store_true", help="measure lowering, skip compiling")
  ap.add_argument("--run", type=int, default=0, help="warm calls to time per program (median)")
  a = ap.parse_args(argv)
  _common.check_shared_flags(a, run=0)
  if a.lower_only and a.run:
    cli.fail("--run", a.run, "needs compiled programs: drop --lower-only")
  if a.layers is not None and a.shape is not None:
    cli.fail("--layers", a.layers, "and --shape are exclusive")
  if a.layers is not None and a.layers < 1:
    cli.fail("--layers", a.layers, "must be >= 1")
  if a.shape is not None and a.run:
    cli.fail("--run", a.run, "needs real parameters: use --layers, not --shape")
  config, params, heads, tok = build_model(a)
  ids, _ = pipeline.prompts(tok, "test", a.prompts)
  batch, sids = pipeline.grpo_batch(ids, a.group)
  pb = rollout.prepare_batch(config, batch, max_new_tokens=a.max_new_tokens, sample_ids=sids,
                             eos_ids=tok.eos_ids)
  eng, args = engine_and_args("vanilla", 1, config, params, heads, tok, a, pb)
  compile_once(eng, args, a.loops[0], a.lower_only)  # warm-up: a process's first compile is slower
  results = []
  if "cost" in a.programs and (a.shape is not None or a.lower_only):
    cli.fail("--programs", "cost", "times a real measurement: drop --shape / --lower-only")
  for kind in a.programs:
    if kind == "cost":
      r = {"program": "cost", "buckets": 1, "loop": "default",
           **cost_model_seconds(config, params, heads, ids, a)}
      print(json.dumps(r), flush=True)
      results.append(r)
      continue
    for b in (1,) if kind == "trainer" else a.buckets:
      eng, args = engine_and_args(kind, b, config, params, heads, tok, a, pb)
      rows, compiled = {}, {}
      for loop in a.loops:
        times, compiled[loop] = compile_once(eng, args, loop, a.lower_only)
        rows[loop] = {"program": kind, "buckets": b, "loop": loop, **times}
      if a.run:
        for loop, r in run_interleaved(compiled, args, a.run).items():
          rows[loop].update(r)
      for r in rows.values():
        print(json.dumps(r), flush=True)
        results.append(r)
  default = layer_loop.layer_loop_policy()
  meta = {"command": "experiments/bench_compile.py " + " ".join(argv or sys.argv[1:]),
          "cpu": cpu_model(), "machine": platform.machine(), "jax": jax.__version__,
          "backend": jax.default_backend(), "num_layers": config.num_layers,
          "hidden_size": config.hidden_size, "dtype": config.dtype, "rows": len(batch),
          "max_new_tokens": a.max_new_tokens, "cache_length": pb.cache_length,
          "default_loop": {"full": default.full, "cached": default.cached}}
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
  report(results, meta)
  print(f"wrote {out}")
  return results


def report(results: list[dict], meta: dict) -> None:
  """One row per program; each cell lists the loops in the order of the header."""
  from rich.console import Console
  from rich.table import Table
  costs = [r for r in results if r["program"] == "cost"]
  results = [r for r in results if r["program"] != "cost"]
  by = {(r["program"], r["buckets"], r["loop"]): r for r in results}
  loops = [lp for lp in LOOPS if any(r["loop"] == lp for r in results)]
  cols = [k for k in ("lower_s", "compile_s", "compile_cpu_s", "run_s")  # the rest: in the JSON
          if any(k in r for r in results)]
  key = "compile_cpu_s" if "compile_cpu_s" in cols else "lower_s"
  d = meta["default_loop"]
  t = Table(title=f"{meta['num_layers']} layers x {meta['hidden_size']} ({meta['dtype']}), "
                  f"{meta['rows']} rows, {meta['max_new_tokens']} new tokens; default loop: "
                  f"full={d['full']}, cached={d['cached']}; jax {meta['jax']} "
                  f"{meta['backend']}, {meta['cpu']}")
  t.add_column("program")
  names = {"lower_s": "lower s", "compile_s": "compile s", "compile_cpu_s": "compile CPU s",
           "run_s": "run s"}
  for c in cols:
    t.add_column(f"{names[c]} ({' / '.join(loops)})", justify="right")
  t.add_column(f"{names[key]} scan / unroll", justify="right")
  t.add_column(f"{names[key]} / vanilla's", justify="right")
  for prog, b in dict.fromkeys((r["program"], r["buckets"]) for r in results):
    rs = [by[(prog, b, lp)] for lp in loops]
    row = [f"{prog} {b}b"]
    row += [" / ".join(f"{r[c]:.2f}" if c in r else "-" for r in rs) for c in cols]
    u, s_ = by.get((prog, b, "unroll")), by.get((prog, b, "scan"))
    row.append(f"{s_[key] / u[key]:.2f}" if u and s_ else "-")
    van = [by.get(("vanilla", b, lp)) for lp in loops]
    row.append(" / ".join(f"{r[key] / v[key]:.2f}" if v else "-"
                          for r, v in zip(rs, van, strict=True)))
    t.add_row(*row)
  con = Console(width=200)
  if results:
    con.print(t)
  for r in costs:
    van = by.get(("vanilla", 1, "mixed"))
    vs = "" if van is None else (f" ({r['compile_s'] / van['compile_s']:.2f}x the 1-bucket "
                                 "vanilla's compile)")
    con.print(f"goodput's cost model ({meta['rows']} rows; rows {r['cost_rows']} x nodes "
              f"{r['cost_nodes']}): {r['programs']} programs compiled, trace + lower "
              f"{r['lower_s']:.1f} s, XLA compile {r['compile_s']:.1f} s{vs}, "
              f"{r['total_s']:.1f} s in all with the timed steps")


if __name__ == "__main__":
  main()
