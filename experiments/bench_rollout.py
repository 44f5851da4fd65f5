"""Vanilla vs speculative rollouts on GRPO-shaped GSM8K batches, side by side in one run.

  .venv/bin/python experiments/bench_rollout.py                  # embedded default model, CPU
  .venv/bin/python experiments/bench_rollout.py --budgets 32 64 128 --prompts 8 --group 8

Each engine runs the same prompts, sample ids and seed; every configuration is run once to compile
(all buckets it visits) and then timed over --repeats runs (median). Prints tau (tokens per target
forward), target forwards, wall-clock and its ratio to vanilla, and whether the outputs are
identical; writes JSON and a PNG (tau and speedup vs budget; active rows per forward).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import _common
import jax
import numpy as np

from app import cli, pipeline
from specroll_jax import rollout
from specroll_jax.proposers import HeadsProposer


def main(argv=None):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  _common.add_shared_flags(ap, out="runs/bench_rollout.json")
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--top-p", type=float, default=1.0)
  ap.add_argument("--top-k", type=int, default=0, help="sampling top-k (0: none)")
  ap.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128])
  ap.add_argument("--max-nodes", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--heads-steps", type=int, default=600)
  ap.add_argument("--quick", action="store_true", help="2 prompts x 4, 48 tokens, one budget")
  a = ap.parse_args(argv)
  _common.check_shared_flags(a, temperature=0.0, budgets=0, max_nodes=0, repeats=1,
                             heads_steps=1)
  if not 0 < a.top_p <= 1:
    cli.fail("--top-p", a.top_p, "must be in (0, 1]")
  if a.top_k < 0:
    cli.fail("--top-k", a.top_k, "must be >= 0 (0: no top-k)")
  if a.quick:
    a.prompts, a.group, a.max_new_tokens, a.budgets = 2, 4, 48, [32]
    a.repeats, a.heads_steps = 1, 50

  config, params, tok, path = _common.load_model(a)
  heads = pipeline.fitted_heads(config, params, tok, path, steps=a.heads_steps,
                                temperature=a.temperature,
                                num_prompts=32 if a.quick else 128,
                                max_new_tokens=a.max_new_tokens)
  ids, _ = pipeline.prompts(tok, "test", a.prompts)
  batch, sids = pipeline.grpo_batch(ids, a.group)
  cfg = rollout.SamplingConfig(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
  kw = dict(sampling=cfg, max_new_tokens=a.max_new_tokens, seed=a.seed, sample_ids=sids,
            eos_ids=tok.eos_ids)
  van, t_van, _ = _common.timed(lambda: rollout.generate(config, params, batch, **kw),
                                a.repeats)
  van_lens = np.asarray(van.lengths)
  rows = [{"engine": "vanilla", "budget": None, "tau": 1.0,
           "forwards": van.stats.forwards, "seconds": t_van,
           "speedup": 1.0, "identical": True, "tokens": int(van_lens.sum()),
           "active_trace": [int((van_lens > f).sum()) for f in range(int(van_lens.max()))]}]
  for budget in a.budgets:
    spec = rollout.Speculation(  # the static Medusa proposer this table measures
        HeadsProposer(num_heads=heads.num_heads), heads,
        rollout.SpecConfig(node_budget=budget, max_nodes=a.max_nodes))
    out, t, _ = _common.timed(lambda spec=spec: rollout.generate(
        config, params, batch, speculation=spec, **kw), a.repeats)
    same = bool((np.asarray(out.tokens) == np.asarray(van.tokens)).all()
                and (np.asarray(out.lengths) == van_lens).all())
    st = out.stats
    rows.append({"engine": "speculative", "budget": budget, "tau": st.tokens_per_forward,
                 "forwards": st.forwards, "seconds": t,
                 "speedup": t_van / t, "identical": same, "tokens": int(st.tokens),
                 "head_acceptance": st.head_acceptance.tolist(),
                 "nodes_verified": int(st.nodes_verified),
                 "buckets": [[r, n, int(f)] for (r, n), f in zip(
                     spec.spec.bucket_shapes(len(batch), spec.proposer.capacity),
                     np.asarray(st.spec.bucket_forwards), strict=True)],
                 "active_trace": np.asarray(st.active_trace).tolist()})
  for r in rows:  # cost per batched target forward, and the tau at which speculation breaks even
    r["ms_per_forward"] = 1e3 * r["seconds"] / r["forwards"]
    r["break_even_tau"] = r["ms_per_forward"] / rows[0]["ms_per_forward"] * rows[0]["tau"]
  _print(rows, a)
  out_path = Path(a.out)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  meta = {"command": "experiments/bench_rollout.py " + " ".join(argv or []),
          "machine": f"{platform.machine()} {jax.devices()[0].device_kind}",
          "jax": jax.__version__, "model": str(path), "args": vars(a)}
  out_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
  _plot(rows, out_path.with_suffix(".png"))
  print(f"wrote {out_path} and {out_path.with_suffix('.png')}")
  return rows


def _print(rows, a):
  from rich.console import Console
  from rich.table import Table
  t = Table(title=f"rollouts: {a.prompts} prompts x G={a.group}, T={a.temperature}, "
                  f"top-p={a.top_p}, top-k={a.top_k}, {a.max_new_tokens} new tokens")
  for c in ("engine", "budget", "tau", "target fwd", "seconds", "vs vanilla", "ms/forward",
            "break-even tau", "identical", "head acc.", "buckets (rows,N,steps)"):
    t.add_column(c)
  for r in rows:
    acc = " ".join(f"{x:.2f}" for x in r.get("head_acceptance", []))
    bk = " ".join(f"({b[0]},{b[1]},{b[2]})" for b in r.get("buckets", []))
    budget = "-" if r["budget"] is None else str(r["budget"])
    t.add_row(r["engine"], budget, f"{r['tau']:.2f}", str(r["forwards"]),
              f"{r['seconds']:.2f}", f"{r['speedup']:.2f}x", f"{r['ms_per_forward']:.2f}",
              f"{r['break_even_tau']:.2f}", str(r["identical"]), acc, bk)
  Console(width=200).print(t)


def _plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  spec = [r for r in rows if r["engine"] == "speculative"]
  fig, ax = plt.subplots(1, 2, figsize=(11, 4))
  b = [r["budget"] for r in spec]
  ax[0].plot(b, [r["tau"] for r in spec], "o-", label="tau (tokens / target forward)")
  ax[0].plot(b, [r["speedup"] for r in spec], "s-", label="wall-clock speedup vs vanilla")
  ax[0].axhline(1.0, color="grey", lw=0.8)
  ax[0].set_xlabel("global node budget per verify forward")
  ax[0].legend()
  for r in rows:
    lbl = "vanilla" if r["engine"] == "vanilla" else f"spec budget {r['budget']}"
    ax[1].step(range(len(r["active_trace"])), r["active_trace"], where="post", label=lbl)
  ax[1].set_xlabel("target forward")
  ax[1].set_ylabel("active rows")
  ax[1].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
