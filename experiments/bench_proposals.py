"""Proposals worth verifying: every proposer side by side against the compacting vanilla engine.

  .venv/bin/python experiments/bench_proposals.py                   # T = 1, 0.7, 0 (embedded model)
  .venv/bin/python experiments/bench_proposals.py --quick           # CI-sized smoke run

For each temperature: GRPO-shaped batches (--prompts GSM8K *test* prompts x --group, the same
prompts, sample ids and seed for every engine), rows for

  * vanilla without compaction (the engine before compaction; reported once, old vs new) and the
    compacting vanilla engine, the baseline of every ratio;
  * each proposer with --nodes nodes for every row in every bucket (proposal quality: tau,
    depth-1 acceptance, nodes verified per committed token): static Medusa heads (``HeadsProposer``,
    today's), root-conditioned heads (``RankedHeads`` + ``CondHeads``), own-text lookup
    (``PromptLookup``), group-aware lookup with siblings, and with siblings + earlier responses of
    the same prompts (a previous batch at another seed, the way a later epoch sees them), and
    everything merged (``Merged``);
  * the ranked proposers again with node budgets chosen by measured goodput (``goodput.choose``
    over a cost model measured on this machine, the acceptance estimates calibrated on --warmup
    batches of other prompts): the wall-clock rows.

Heads are fitted per temperature on the target's own rollouts of train prompts (cached). Also the
held-out quality of head 1 (root-conditioned vs Medusa) against the target's own top-k mass.
Compile is excluded from every time (each configuration runs once first); per-configuration
compile seconds are reported apart. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import _common
import jax
import numpy as np

from app import cli, pipeline
from specroll_jax import rollout
from specroll_jax.adaptation import calibration, goodput
from specroll_jax.adaptation import store as S
from specroll_jax.engines.config import DecodeSettings
from specroll_jax.heads import conditioned as CH
from specroll_jax.kernels import Kernels
from specroll_jax.proposers import HeadsProposer, PromptLookup
from specroll_jax.proposers.group_lookup import GroupLookup
from specroll_jax.proposers.merged import Merged
from specroll_jax.proposers.ranked import RankedProposer
from specroll_jax.proposers.ranked_heads import RankedHeads

# case name -> the --proposers key that selects it
PROPOSERS = {"static Medusa heads": "medusa", "root-conditioned heads": "cond",
             "own lookup": "lookup", "group lookup (siblings)": "group",
             "group lookup (siblings + earlier)": "group-earlier", "merged": "merged"}


def _row(name, mode, out, seconds, compile_s, van, nodes=None):
  st = out.stats
  sp = st.spec
  fwd = st.forwards  # the prefill counts as a forward
  row = {"proposer": name, "mode": mode, "seconds": seconds, "compile_s": compile_s,
         "forwards": fwd, "tau": st.tokens_per_forward, "tokens": int(st.tokens),
         "ms_per_forward": 1e3 * seconds / fwd,
         "identical": bool((np.asarray(out.tokens) == np.asarray(van.tokens)).all()
                           and (np.asarray(out.lengths) == np.asarray(van.lengths)).all())}
  if sp is not None:
    prop, acc = np.asarray(sp.depth_proposed), np.asarray(sp.depth_accepted)
    row.update(depth1=float(acc[0] / max(prop[0], 1)) if prop.size else 0.0,
               nodes_per_token=int(sp.nodes_verified) / max(int(st.tokens), 1),
               nodes=list(nodes) if nodes is not None else None,
               bucket_forwards=np.asarray(sp.bucket_forwards).tolist())
  return row


def _prior_store(config, prompts, prompt_ids, previous, max_tokens):
  store = S.store_init(vocab_size=config.vocab_size, prompts=len(set(np.asarray(
      prompt_ids).tolist())), per_prompt=8, max_tokens=max_tokens)
  store = S.store_add(store, prompt_ids, prompts, np.asarray(previous.tokens),
                      np.asarray(previous.lengths))
  return S.store_context(store, prompt_ids, prompts, vocab_size=config.vocab_size)


def run_temperature(a, config, params, tok, path, temperature, sink=lambda t, rows: None):
  sampling = rollout.SamplingConfig(temperature=temperature)
  g, m = a.group, a.max_new_tokens
  print(f"== T = {temperature}: fitting / loading heads ==", flush=True)
  keep = set(a.proposers or PROPOSERS.values())
  medusa = None  # fitted only when a case or the head-quality table uses it
  if "medusa" in keep:
    medusa = pipeline.fitted_heads(config, params, tok, path, temperature=temperature,
                                   num_prompts=a.medusa_prompts, steps=a.medusa_steps,
                                   max_new_tokens=m)
  cond = pipeline.fitted_cond_heads(config, params, tok, path, sampling=sampling,
                                    num_prompts=a.cond_prompts, steps=a.cond_steps,
                                    max_new_tokens=m)
  ids, _ = pipeline.prompts(tok, "test", a.prompts)
  batch, sids = pipeline.grpo_batch(ids, g)
  prompt_ids = np.repeat(np.arange(a.prompts), g)
  kw = dict(sampling=sampling, max_new_tokens=m, seed=a.seed, sample_ids=sids,
            eos_ids=tok.eos_ids)
  rows = []
  van, t_van, c_van = _common.timed(lambda: rollout.generate(config, params, batch, **kw),
                                    a.repeats)
  old, t_old, c_old = _common.timed(lambda: rollout.generate(
      config, params, batch, options=rollout.DecodeOptions(bucket_fractions=(1.0,)), **kw),
      a.repeats)
  rows.append(_row("vanilla (no compaction)", "-", old, t_old, c_old, van))
  rows.append(_row("vanilla (compacting)", "-", van, t_van, c_van, van))
  # a previous epoch's responses of the same prompts (another seed): the store's content
  previous = rollout.generate(config, params, batch, **{**kw, "seed": a.seed + 1000})
  prior = _prior_store(config, batch, prompt_ids, previous, m)
  rh, gl = RankedHeads(max_nodes=max(a.nodes, 8)), GroupLookup(group_size=g)
  mg = Merged(heads=rh, lookup=gl, max_nodes=max(a.nodes, 8))
  cases = [  # name, proposer, params from (a calibrated table or None, earlier responses)
      ("static Medusa heads", HeadsProposer(), lambda t, pr: medusa),
      ("root-conditioned heads", rh, lambda t, pr: rh.params(cond, t)),
      ("own lookup", PromptLookup(), lambda t, pr: ()),
      ("group lookup (siblings)", gl, lambda t, pr: gl.context(t)),
      ("group lookup (siblings + earlier)", gl, lambda t, pr: gl.context(t, prior=pr)),
      ("merged", mg, lambda t, pr: mg.params(cond, t, prior=pr)),
  ]
  n_buckets = len(rollout.SpecConfig().bucket_fractions)
  fixed = rollout.SpecConfig(nodes=(a.nodes,) * n_buckets)
  pb = rollout.prepare_batch(config, batch, max_new_tokens=m, sample_ids=sids)
  # one cost model per proposer and sampling path (greedy vs sampled), measured once (cached)
  cost_settings = DecodeSettings(
      sampling=rollout.SamplingConfig(temperature=0.0 if sampling.greedy else 1.0),
      max_new_tokens=m, cache_length=pb.cache_length, kernels=Kernels.resolve("auto"))
  rows_b = tuple(r for r, _ in fixed.bucket_shapes(len(batch), 64))
  quality = {}
  cases = [c for c in cases if PROPOSERS[c[0]] in keep]
  for name, prop, make in cases:
    ranked = isinstance(prop, RankedProposer)
    table = None
    if ranked:  # calibrate on warm-up batches of other prompts (train split), under the same
      cal = calibration.init(_flat_prior(prop))  # conditions: earlier responses of them too
      for w in range(a.warmup):
        wid, _ = pipeline.prompts(tok, "train", a.prompts, offset=3000 + w * a.prompts)
        wb, ws = pipeline.grpo_batch(wid, g, 3000 + w * a.prompts)
        wkw = {**kw, "sample_ids": ws}
        w_prev = rollout.generate(config, params, wb, **{**wkw, "seed": a.seed + 1000})
        w_prior = _prior_store(config, wb, prompt_ids, w_prev, m)
        wpp = make(_shaped(prop, cal.table()), w_prior)
        w_out = rollout.generate(config, params, wb,
                                 speculation=rollout.Speculation(prop, wpp, fixed), **wkw)
        cal = cal.update(w_out.stats.spec.proposer)
      table = _shaped(prop, cal.table())
    pp = make(table, prior)
    out, t, c = _common.timed(lambda prop=prop, pp=pp: rollout.generate(
        config, params, batch, speculation=rollout.Speculation(prop, pp, fixed), **kw),
        a.repeats)
    rows.append(_row(name, f"{a.nodes} nodes/row", out, t, c, van, fixed.nodes))
    print(f"  {name} @ {a.nodes}: tau {rows[-1]['tau']:.3f}, depth-1 {rows[-1]['depth1']:.3f}, "
          f"{t_van / t:.2f}x", flush=True)
    if not ranked:
      _release()
      sink(temperature, rows)
      continue
    expected = out.stats.spec.proposer.expected_per_row_step()
    quality[name] = expected.tolist()
    cost = goodput.measure_cost(config, params, prop, pp, pb.tokens, pb.lengths,
                                settings=cost_settings,
                                rows=rows_b, node_counts=tuple(a.cost_nodes))
    for gated in (False, True):
      spec, why = goodput.choose(cost, expected, len(batch), rollout.SpecConfig(),
                                 capacity=prop.capacity, gated=gated)
      out, t, c = _common.timed(lambda prop=prop, pp=pp, spec=spec: rollout.generate(
          config, params, batch, speculation=rollout.Speculation(prop, pp, spec), **kw),
          a.repeats)
      mode = "goodput + gate" if gated else "goodput"
      rows.append(_row(name, mode, out, t, c, van, spec.nodes))
      rows[-1].update(goodput=why, skipped=int(out.stats.spec.skipped))
      print(f"  {name} @ {mode} {spec.nodes}: tau {rows[-1]['tau']:.3f}, {t_van / t:.2f}x, "
            f"{rows[-1]['skipped']} steps gated", flush=True)
    _release()
    sink(temperature, rows)
  for r in rows:
    r["vs_vanilla"] = t_van / r["seconds"]
  # head 1 quality on held-out rollouts (test prompts) against the target's own top-k mass
  held = rollout.generate(config, params, batch,
                          options=rollout.DecodeOptions(return_hidden=True), **kw)
  hq = {}
  for name, hd in (("Medusa", medusa), ("root-conditioned", cond)):
    if hd is None:
      continue
    hq[name] = CH.hit_rates(config, params, hd, np.asarray(held.tokens), np.asarray(held.lengths),
                            np.asarray(held.hidden), sampling=sampling).to_dict()
  return {"temperature": temperature, "rows": rows, "head_quality": hq,
          "expected_by_nodes": quality}


def _release():
  """Drop compiled programs no later case reuses: each speculative rollout program holds ~3k
  memory mappings (XLA:CPU maps every kernel), and one process may hold 65530."""
  import gc
  jax.clear_caches()
  gc.collect()


def _flat_prior(prop):
  return np.asarray(prop.default_acceptance(), np.float32).reshape(-1)


def _shaped(prop, table):
  """A calibration table in the shape the proposer's params take."""
  if isinstance(prop, GroupLookup):
    return np.asarray(table).reshape(prop.acceptance_shape)
  if isinstance(prop, RankedHeads):
    return np.asarray(table).reshape(prop.num_heads, prop.depth_bins)
  return np.asarray(table)


def main(argv=None):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  _common.add_shared_flags(ap, out="runs/bench_proposals.json")
  ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7, 0.0])
  ap.add_argument("--nodes", type=int, default=4, help="nodes per row for proposal quality")
  ap.add_argument("--cost-nodes", type=int, nargs="+", default=list(goodput.DEFAULT_NODE_COUNTS))
  ap.add_argument("--warmup", type=int, default=2, help="calibration batches before measuring")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--medusa-prompts", type=int, default=128)
  ap.add_argument("--medusa-steps", type=int, default=600)
  ap.add_argument("--cond-prompts", type=int, default=2048)
  ap.add_argument("--cond-steps", type=int, default=4000)
  ap.add_argument("--proposers", nargs="+", choices=sorted(set(PROPOSERS.values())),
                  default=None, help="run only these proposers (default: all)")
  ap.add_argument("--quick", action="store_true", help="CI-sized: 2 prompts x 4, 32 tokens, T=1")
  a = ap.parse_args(argv)
  _common.check_shared_flags(a, temperatures=0.0, nodes=1, cost_nodes=0, warmup=0, repeats=1,
                             medusa_prompts=1, medusa_steps=1, cond_prompts=1, cond_steps=1)
  if a.quick:
    a.temperatures, a.prompts, a.group, a.max_new_tokens = [1.0], 2, 4, 32
    a.repeats, a.warmup, a.cost_nodes = 1, 1, [0, 2]
    a.medusa_prompts, a.medusa_steps, a.cond_prompts, a.cond_steps = 16, 20, 16, 20
  config, params, tok, path = _common.load_model(a)
  meta = {"command": "experiments/bench_proposals.py " + " ".join(argv or sys.argv[1:]),
          "cpu": _common.cpu_model(), "jax": jax.__version__,
          "device": jax.devices()[0].device_kind, "model": str(path),
          "args": {k: v for k, v in vars(a).items()}}
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  partial = out.with_suffix(".partial.json")
  done = []

  def sink(temperature, rows):  # every finished row on disk: a killed run keeps what it measured
    tmp = partial.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "results": done,
                               "running": {"temperature": temperature, "rows": rows}},
                              indent=1, default=_jsonable))
    tmp.replace(partial)

  results = []
  for t in a.temperatures:
    results.append(run_temperature(a, config, params, tok, path, t, sink))
    done.append(results[-1])
  _print(results, a)
  out.write_text(json.dumps({"meta": meta, "results": results}, indent=2, default=_jsonable))
  _plot(results, out.with_suffix(".png"))
  partial.unlink(missing_ok=True)
  print(f"wrote {out} and {out.with_suffix('.png')}")
  return results


def _jsonable(x):
  if dataclasses.is_dataclass(x):
    return dataclasses.asdict(x)
  if isinstance(x, np.generic):
    return x.item()
  return str(x)


def _print(results, a):
  from rich.console import Console
  from rich.table import Table
  con = Console(width=200)
  for res in results:
    t = Table(title=f"T = {res['temperature']}: {a.prompts} GSM8K test prompts x G = {a.group}, "
                    f"{a.max_new_tokens} new tokens ({_common.cpu_model()})")
    for c in ("proposer", "nodes", "tau", "depth-1 acc", "nodes / token", "ms / fwd",
              "seconds", "vs compacting vanilla", "compile s", "identical"):
      t.add_column(c)
    for r in res["rows"]:
      nodes = r.get("nodes")
      t.add_row(r["proposer"], "-" if nodes is None else " ".join(map(str, nodes)),
                f"{r['tau']:.3f}", f"{r.get('depth1', 0):.3f}" if "depth1" in r else "-",
                f"{r['nodes_per_token']:.2f}" if "nodes_per_token" in r else "-",
                f"{r['ms_per_forward']:.2f}", f"{r['seconds']:.3f}", f"{r['vs_vanilla']:.2f}x",
                f"{r['compile_s']:.1f}", str(r["identical"]))
    con.print(t)
    q = Table(title=f"T = {res['temperature']}: head 1 on held-out rollouts vs the target's own "
                    "top-k mass")
    for c in ("heads", "hit@1", "hit@4", "mass@1", "mass@4", "bound@1", "bound@4"):
      q.add_column(c)
    for name, h in res["head_quality"].items():
      q.add_row(name, *(f"{h[k]:.3f}" for k in ("hit@1", "hit@4", "mass@1", "mass@4", "bound@1",
                                                 "bound@4")))
    con.print(q)


def _plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 5), squeeze=False)
  for ax, res in zip(axes[0], results, strict=True):
    rows = res["rows"]
    labels = [f"{r['proposer']} [{r['mode']}]" for r in rows]
    y = np.arange(len(rows))
    ax.barh(y - 0.2, [r["vs_vanilla"] for r in rows], 0.4, label="wall-clock vs compacting vanilla")
    ax.barh(y + 0.2, [r["tau"] for r in rows], 0.4, label="tau")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_title(f"T = {res['temperature']}")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
