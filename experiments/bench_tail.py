"""The tail of a GRPO batch at a real model's cost: speculative steps vs vanilla steps, few rows.

  .venv/bin/python experiments/bench_tail.py                 # widened Qwen2.5-0.5B, f32, 1 2 4 rows
  .venv/bin/python experiments/bench_tail.py --quick         # CI-sized smoke run (tiny widening)

The embedded model widened into a Qwen2.5 shape (``app.widen``: the embedded model's tokens and
acceptance at the real shape's weight bytes and FLOPs per token), its root-conditioned heads widened
with it. For each row count R (one synthetic test prompt x R samples: the rows a batch's tail
keeps) the vanilla engine and the speculative engine (``Merged``: root-conditioned heads + group
lookup, one bucket) with each of --nodes nodes per row, its heads ranking coupled to the target's
noise and not (--ranking), at --temperature; with --specroll also the ``SpecRoll`` object with its
defaults (goodput choosing the nodes from this machine's cost; after --specroll-warmup batches of
the same prompt at other seeds), timed per ``generate`` call (host work included). Each engine
runs once to
compile; then --rounds rounds call every engine in turn (the same machine state for all) and each
engine's median is reported. The prefill is timed apart (a one-token rollout of the same prompts)
and taken out: ms per step = (seconds - prefill) / steps. The table gives tau, steps, ms per step
and its ratio to the vanilla step's, the speedup over vanilla (wall clock, prefill included) and
whether the tokens are the vanilla engine's. Compile seconds apart. Writes JSON and a PNG.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import _common
import jax
import numpy as np

from app import cli, pipeline, tasks
from app.widen import QWEN25_SHAPES, byte_count, widen
from specroll_jax import rollout
from specroll_jax.data import gsm8k
from specroll_jax.engines import executables
from specroll_jax.engines.config import SpecConfig
from specroll_jax.proposers import GroupLookup, Merged, RankedHeads
from specroll_jax.specroll import SpecRoll


def _call(fn):
  t0 = time.perf_counter()
  out = fn()
  jax.block_until_ready(out.tokens)
  return out, time.perf_counter() - t0


def tail_rows(a, config, params, heads, tok, rows: int) -> dict:
  """Every engine at ``rows`` rows: compile, then --rounds interleaved timed rounds."""
  ex = tasks.Task(name="synthetic").examples("test")[a.prompt]
  batch, sids = pipeline.grpo_batch([tok.encode(gsm8k.format_prompt(ex.question))], rows)
  pb = rollout.prepare_batch(config, batch, max_new_tokens=a.max_new_tokens, sample_ids=sids,
                             eos_ids=tok.eos_ids)
  kw = dict(prompt_lengths=pb.lengths, sample_ids=sids, seed=a.seed, eos_ids=tok.eos_ids,
            sampling=rollout.SamplingConfig(temperature=a.temperature),
            options=rollout.DecodeOptions(cache_length=pb.cache_length))
  fns = {"prefill": lambda: rollout.generate(config, params, pb.tokens, max_new_tokens=1, **kw),
         "vanilla": lambda: rollout.generate(config, params, pb.tokens,
                                             max_new_tokens=a.max_new_tokens, **kw)}
  for ranking in a.ranking:
    mg = Merged(heads=RankedHeads(max_nodes=8, coupled=ranking == "coupled"),
                lookup=GroupLookup(group_size=rows), max_nodes=8)
    pp = mg.params(heads)
    for n in a.nodes:
      sp = rollout.Speculation(mg, pp, SpecConfig(bucket_fractions=(1.0,), nodes=(n,)))
      name = f"{n} nodes" + ("" if len(a.ranking) == 1 else f", {ranking}")
      fns[name] = lambda sp=sp: rollout.generate(config, params, pb.tokens, speculation=sp,
                                                 max_new_tokens=a.max_new_tokens, **kw)
  choice = None
  if a.specroll:  # the object with its defaults (goodput choosing the nodes), warm and calibrated
    more = {} if a.cost_nodes is None else {"cost_nodes": tuple(a.cost_nodes)}
    sr = SpecRoll(config, sampling=kw["sampling"], group_size=rows,
                  max_new_tokens=a.max_new_tokens, eos_ids=tuple(tok.eos_ids), **more)
    gb = sr.batch([pb.tokens[0, : pb.lengths[0]]], np.asarray([a.prompt]))
    state = sr.init(heads)
    for w in range(a.specroll_warmup):  # earlier epochs of the same prompt: calibration, store
      _, _, state = sr.generate(params, gb, state, seed=a.seed + 1000 + w)
    warm_state = state

    reports = []

    def object_call():
      out, rep, _ = sr.generate(params, gb, warm_state, seed=a.seed)
      reports.append(rep)
      return out

    fns["SpecRoll defaults"] = object_call
  first, outs, times = {}, {}, {k: [] for k in fns}
  for k, fn in fns.items():
    outs[k], first[k] = _call(fn)
  if a.specroll:
    rep = reports[-1]
    choice = {"mode": rep.mode, "nodes": list(rep.nodes), "rollout_s": rep.rollout_seconds,
              "host_s": rep.host_seconds, "reflex": rep.reflex,
              "slow": None if rep.slow is None else rep.slow.decision}
  for _ in range(a.rounds):
    for k, fn in fns.items():
      times[k].append(_call(fn)[1])
  sec = {k: float(np.median(v)) for k, v in times.items()}
  ref = outs["vanilla"]
  engines = []
  for k in fns:
    if k == "prefill":
      continue
    o = outs[k]
    steps = int(o.stats.target_forwards)
    engines.append({
        "engine": k, "tau": o.stats.tokens_per_forward, "steps": steps, "seconds": sec[k],
        "ms_per_step": 1e3 * (sec[k] - sec["prefill"]) / max(steps, 1),
        "compile_s": max(first[k] - sec[k], 0.0),
        "identical": bool((np.asarray(o.tokens) == np.asarray(ref.tokens)).all()
                          and (np.asarray(o.lengths) == np.asarray(ref.lengths)).all())})
  van = engines[0]
  for e in engines:
    e["step_vs_vanilla"] = e["ms_per_step"] / van["ms_per_step"]
    e["speedup"] = van["seconds"] / e["seconds"]
  return {"rows": rows, "prefill_s": sec["prefill"], "tokens": int(np.asarray(ref.lengths).sum()),
          "engines": engines, "specroll_choice": choice}


def main(argv=None):
  ap = cli.ArgumentParser(description=__doc__)
  _common.add_shared_flags(ap, out="runs/bench_tail.json", max_new_tokens=48, batch=False)
  ap.add_argument("--shape", choices=sorted(QWEN25_SHAPES), default="0.5b",
                  help="the Qwen2.5 shape to widen into")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="rows of the tail")
  ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4], help="nodes per row")
  ap.add_argument("--prompt", type=int, default=0, help="index of the synthetic test prompt")
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--ranking", nargs="+", choices=("coupled", "deterministic"),
                  default=["coupled", "deterministic"],
                  help="how the heads rank their candidates (RankedHeads.coupled)")
  ap.add_argument("--specroll", action="store_true",
                  help="also the SpecRoll object with its defaults (goodput choosing the nodes "
                       "from this machine's measured cost), after --specroll-warmup batches")
  ap.add_argument("--specroll-warmup", type=int, default=2)
  ap.add_argument("--cost-nodes", type=int, nargs="+", default=None,
                  help="the object's SpecRoll.cost_nodes (default: SpecRoll's)")
  ap.add_argument("--quick", action="store_true", help="CI-sized: a tiny widening, 2 rows")
  a = ap.parse_args(argv)
  _common.check_shared_flags(a, prompt=0, temperature=0.0, rounds=1, rows=1, nodes=1,
                             specroll_warmup=1, cost_nodes=0)
  if a.quick:
    a.rows, a.nodes, a.rounds, a.max_new_tokens = [2], [2], 1, 16
    a.ranking = a.ranking[:1]
  config, params, tok, path = _common.load_model(a)
  heads = pipeline.default_heads(config, params, tok, path, conditioned=True)
  shape = _common.quick_shape() if a.quick else QWEN25_SHAPES[a.shape]
  config, params, heads = widen(config, params, shape, key=jax.random.key(0), heads=heads,
                                dtype=a.dtype)
  meta = {"command": "experiments/bench_tail.py " + " ".join(argv or sys.argv[1:]),
          "cpu": _common.cpu_model(), "jax": jax.__version__,
          "device": jax.devices()[0].device_kind, "shape": "quick" if a.quick else a.shape,
          "dtype": a.dtype, "layers": config.num_layers, "hidden": config.hidden_size,
          "body_bytes": byte_count(config, a.dtype).body,
          "temperature": a.temperature, "max_new_tokens": a.max_new_tokens}
  res = {"meta": meta, "tails": []}
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  for r in a.rows:
    res["tails"].append(tail_rows(a, config, params, heads, tok, r))
    out.write_text(json.dumps(res, indent=1))
    executables.clear()  # every row count compiles its own programs: free their code mappings
    jax.clear_caches()
    print(f"  {r} rows done", flush=True)
  _print(res)
  _plot(res, out.with_suffix(".png"))
  print(f"wrote {out} and {out.with_suffix('.png')}")
  return res


def _print(res):
  from rich.console import Console
  from rich.table import Table
  m = res["meta"]
  t = Table(title=f"The tail at the {m['shape']} shape ({m['layers']} layers x {m['hidden']}, "
                  f"{m['dtype']}), T = {m['temperature']}, {m['max_new_tokens']} new tokens "
                  f"({m['cpu']}; {m['device']}; compile apart)")
  for c in ("rows", "prefill s", "engine", "tau", "steps", "ms/step", "step vs vanilla's",
            "seconds", "vs vanilla", "compile s", "identical"):
    t.add_column(c)
  for tail in res["tails"]:
    for e in tail["engines"]:
      name = e["engine"]
      if name == "SpecRoll defaults" and tail.get("specroll_choice"):
        name += f" ({tail['specroll_choice']['mode']} {tail['specroll_choice']['nodes']})"
      t.add_row(str(tail["rows"]), f"{tail['prefill_s']:.3f}", name, f"{e['tau']:.3f}",
                str(e["steps"]), f"{e['ms_per_step']:.1f}", f"{e['step_vs_vanilla']:.2f}",
                f"{e['seconds']:.3f}", f"{e['speedup']:.2f}x", f"{e['compile_s']:.1f}",
                str(e["identical"]))
  Console(width=200).print(t)


def _plot(res, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(11, 4))
  for tail in res["tails"]:
    for ranking, style in (("coupled", "o-"), ("deterministic", "s--"), ("", "o-")):
      es = [e for e in tail["engines"][1:] if e["engine"][0].isdigit()
            and (e["engine"].endswith(ranking) if ranking else "," not in e["engine"])]
      if not es:
        continue
      nodes = [int(e["engine"].split()[0]) for e in es]
      label = f"{tail['rows']} rows" + (f", {ranking}" if ranking else "")
      ax[0].plot(nodes, [e["step_vs_vanilla"] for e in es], style, label=label)
      ax[1].plot(nodes, [e["speedup"] for e in es], style, label=label)
      ax[1].plot(nodes, [e["tau"] for e in es], "x:", color=ax[1].lines[-1].get_color())
    obj = [e for e in tail["engines"] if e["engine"] == "SpecRoll defaults"]
    if obj:
      ax[1].axhline(obj[0]["speedup"], ls="-.", lw=0.8, color=ax[1].lines[-1].get_color())
  ax[0].set(xlabel="nodes per row", ylabel="step cost / vanilla step", title="verify cost")
  ax[1].axhline(1.0, color="grey", lw=0.8)
  ax[1].set(xlabel="nodes per row", ylabel="speedup (o) and tau (x)", title="speedup vs vanilla")
  for x in ax:
    x.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
