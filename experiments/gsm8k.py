"""The main job: GRPO with SpecRoll rollouts, then the same run with vanilla rollouts.

  make run                                               # embedded tiny model, CPU
  .venv/bin/python experiments/gsm8k.py --task gsm8k --steps 12     # GSM8K itself
  .venv/bin/python experiments/gsm8k.py --model /path/to/Qwen2.5-Math-1.5B --dtype bfloat16 \\
      --prompts 32 --group 8 --max-new-tokens 512 --lr 1e-6 --spec h200      # GPU / TPU

Task: with the embedded model the default is the synthetic GSM8K-format problems
(``app/synthetic.py``; ``--task synthetic --level 0``, 80 steps of 16 prompts x 8, lr 3e-4): a
2M-parameter model solves about 3% of GSM8K, too few correct samples for GRPO to learn from, but
about a third of these at T = 1 (70% greedy), so the run shows GRPO learning. With ``--model``
the default is GSM8K; ``--task gsm8k|synthetic|mix`` chooses.

Each step: P train prompts x G samples from the current policy (rollout, jitted), their text scored
on the host (exact final-number match + a format bonus, the GSM8K reward), one data-parallel GRPO
update (every device on one ``data`` axis). Accuracy on held-out test problems (greedy, and one
sample each at the training temperature with fixed seeds) is measured
before the first step and after the last.

``--rollout specroll`` (default) rolls out through ``specroll_jax.SpecRoll`` with its defaults: the
heads shipped beside the model (root-conditioned heads when there are) and the group-aware lookup
in one ranked tree, Reflex corrections while they pay, the slow path (a bootstrap fit, then
refreshes on sustained degradation), node budgets chosen by measured goodput (``--budget``), and
probes of the trees' acceptance where goodput verifies none; the first lines printed say what is
on. Every committed token is the policy's own sample, so the vanilla run (the compacting vanilla
engine) on the same batches and seeds gives the same tokens, rewards and parameters. Both runs
write metrics.jsonl, rollout traces (tensorstore)
and orbax checkpoints; the comparison table and plots (reward, accuracy, tau, entropy, time split,
logprob gap) go to --out. Compile time is measured separately (a warm-up call per engine) and
never enters a speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

import _common
import jax
import numpy as np

from app import cli, pipeline
from app import synthetic as _synthetic
from app.loop import ROLLOUTS, Run, RunConfig, read_metrics
from app.tasks import TASKS, Task
from app.widen import QWEN25_SHAPES, widen
from specroll_jax import distributed, rollout
from specroll_jax.adaptation import slow_path as SP
from specroll_jax.engines.buckets import check_fractions
from specroll_jax.grpo import OLD_POLICIES, GRPOConfig
from specroll_jax.kernels import CHOICES as KERNEL_CHOICES
from specroll_jax.progress import is_terminal
from specroll_jax.specroll import DEFAULT_REFLEX


def parse(argv):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  _common.add_shared_flags(ap, out="runs/gsm8k", prompts=None, max_new_tokens=None,
                           prompts_help="prompts per step (default: 16 synthetic, 8 gsm8k)",
                           max_new_tokens_help="response length limit (default: 48 synthetic, "
                                               "256 gsm8k)")
  ap.add_argument("--heads", default=None, help="heads .safetensors (default: shipped or fitted)")
  ap.add_argument("--cold-start", action="store_true",
                  help="no heads: SpecRoll learns fresh root-conditioned heads from the policy's "
                       "own rollouts (SpecRoll.init('learn')); the plot shows the probes' tau "
                       "rise from the lookup's")
  ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                  help="cast the model to this dtype (default: as stored)")
  ap.add_argument("--widen", default=None, choices=sorted(QWEN25_SHAPES),
                  help="run the model's exact function inside a Qwen2.5-shaped network of this "
                       "size (app.widen: the real shape's weight and KV bytes, the small "
                       "model's acceptance; its heads widened alike): what a GPU measures")
  ap.add_argument("--task", default=None, choices=list(TASKS),
                  help="training problems (default: synthetic for the embedded model, gsm8k "
                       "with --model)")
  ap.add_argument("--level", type=int, default=0,
                  help="synthetic difficulty level (0..4; default 0: one + or - step, numbers up "
                       "to 10)")
  ap.add_argument("--steps", type=int, default=None,
                  help="GRPO steps (default: 80 synthetic, 12 gsm8k)")
  ap.add_argument("--eval-prompts", type=int, default=256,
                  help="held-out test problems for the accuracy before and after (greedy and "
                       "sampled)")
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--top-p", type=float, default=1.0)
  ap.add_argument("--top-k", type=int, default=0)
  ap.add_argument("--lr", type=float, default=None,
                  help="learning rate (default: 3e-4 synthetic and 2e-4 gsm8k for the embedded "
                       "model, 1e-6 for --model)")
  ap.add_argument("--warmup", type=int, default=None,
                  help="learning-rate warm-up steps (linear ramp; GRPOConfig.warmup_steps; "
                       "default: 10 synthetic, 0 gsm8k)")
  ap.add_argument("--beta", type=float, default=0.0, help="k3 KL weight to the initial policy")
  ap.add_argument("--clip", type=float, nargs=2, default=(0.2, 0.28), metavar=("LOW", "HIGH"),
                  help="ratio clip epsilons")
  ap.add_argument("--old-policy", choices=OLD_POLICIES, default="trainer",
                  help="the ratio's old logprobs (GRPOConfig.old_policy): trainer (default here: "
                       "the update does not depend on which engine rolled out, so the SpecRoll "
                       "and vanilla runs give bit-identical parameters) or rollout (the "
                       "library's default)")
  ap.add_argument("--node-budget", type=int, default=None,
                  help="tree nodes per verify forward (default: the --spec preset's)")
  ap.add_argument("--spec", default="auto", choices=["auto", "cpu", "h200"],
                  help="SpecConfig preset (auto: the CPU or the GPU/TPU one, by the backend)")
  ap.add_argument("--buckets", type=float, nargs="+", default=None, metavar="FRACTION",
                  help="row buckets of both engines as fractions of the batch, e.g. 1.0 0.5 "
                       "(default: the --spec preset's and the vanilla engine's). Each bucket is "
                       "one more decode loop to compile; the tokens are the same for any buckets")
  ap.add_argument("--budget", default="goodput", choices=["goodput", "fixed"],
                  help="goodput: node counts per bucket from this machine's measured cost and the "
                       "measured acceptance; fixed: the --spec preset's budget")
  ap.add_argument("--rollout", default="specroll", choices=list(ROLLOUTS))
  ap.add_argument("--slow-path", default="degradation", choices=list(SP.MODES))
  ap.add_argument("--reflex", default="on", choices=["on", "off"],
                  help="Reflex corrections on the heads (SpecRoll.reflex; off: None)")
  ap.add_argument("--reflex-sleep", type=int, default=DEFAULT_REFLEX.sleep_batches,
                  help="batches Reflex sleeps (the plain heads propose: no Reflex work in the "
                       "decode loop) after a batch whose corrections did not pay "
                       "(ReflexConfig.sleep_batches)")
  ap.add_argument("--reflex-sleep-max", type=int, default=DEFAULT_REFLEX.sleep_max_batches,
                  help="each further awake batch that did not pay doubles the sleep, up to this "
                       "many batches (ReflexConfig.sleep_max_batches; 0: no backoff)")
  ap.add_argument("--records-per-batch", type=int,
                  default=RunConfig.records_per_batch,  # the class default: no backend query
                  help="anchors drawn per batch from the rollout's hidden states for the slow "
                       "path, records per head at most (SpecRoll.records_per_batch)")
  ap.add_argument("--slow-bootstrap", type=int, default=None,
                  help="batches of the slow path's bootstrap fit of the heads to the target "
                       "(SlowPathConfig.bootstrap_batches; default: SlowPathConfig.for_model's)")
  ap.add_argument("--slow-step-chunks", type=int, default=None,
                  help="slow-path reservoir chunks per optimiser step, 0 = full batch (default: "
                       "the slow-path preset's; SlowPathConfig.step_chunks)")
  ap.add_argument("--slow-refresh-budget", type=float, default=None,
                  help="degradation mode: refresh seconds as a share of rollout seconds at most, "
                       "0 = no cap (default: the slow-path preset's; "
                       "SlowPathConfig.degradation_budget)")
  ap.add_argument("--slow-learn-budget", type=float, default=None,
                  help="a learning refresh's seconds as a share of the step's at most (its "
                       "optimiser steps are sized from the last refresh's wall-clock), 0 = no "
                       "time bound: the preset's step count, the same in every run "
                       "(default: the slow-path preset's; SlowPathConfig.learn_budget)")
  ap.add_argument("--slow-refresh-vocab", choices=list(SP.VOCABS), default=None,
                  help="the refresh's training softmax: the full vocabulary or each record's "
                       "support alone (default: the slow-path preset's; "
                       "SlowPathConfig.refresh_vocab)")
  ap.add_argument("--no-compare", action="store_true", help="skip the vanilla comparison run")
  ap.add_argument("--eval-every", type=int, default=0, help="greedy test accuracy every n steps")
  ap.add_argument("--kernels", default="auto", choices=list(KERNEL_CHOICES))
  ap.add_argument("--resume", action="store_true", help="continue the run in --out")
  ap.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                  help="several processes: process 0's address (with --num-processes, "
                       "--process-id; see specroll_jax.distributed)")
  ap.add_argument("--num-processes", type=int, default=None, help="processes in the run")
  ap.add_argument("--model-axis", type=int, default=1,
                  help="split the weights, optimizer state and KV cache over this many devices "
                       "(a (data, model) mesh; it must divide each process's devices and the "
                       "model's heads, KV heads, vocabulary and FFN width)")
  ap.add_argument("--process-id", type=int, default=None, help="this process, 0 .. N-1")
  a = ap.parse_args(argv)
  check_processes(a)
  if a.task is None:
    a.task = "synthetic" if a.model is None else "gsm8k"
  syn = a.task != "gsm8k"
  for name, if_syn, if_gsm8k in (("steps", 80, 12), ("prompts", 16, 8),
                                 ("max_new_tokens", 48, 256), ("warmup", 10, 0)):
    if getattr(a, name) is None:
      setattr(a, name, if_syn if syn else if_gsm8k)
  cli.require(a, steps=1, prompts=1, group=1, max_new_tokens=1, eval_every=0, seed=0, top_k=0,
              beta=0.0, node_budget=0, eval_prompts=1, warmup=0, reflex_sleep=0,
              reflex_sleep_max=0, records_per_batch=1, slow_step_chunks=0, slow_bootstrap=0,
              model_axis=1)
  for name in ("slow_refresh_budget", "slow_learn_budget"):  # shares of seconds
    value = getattr(a, name)
    if value is not None and not 0 <= value < float("inf"):
      cli.fail("--" + name.replace("_", "-"), value, "must be a finite number >= 0")
  try:
    _synthetic.Difficulty.from_level(a.level)
  except ValueError as e:
    cli.fail("--level", a.level, str(e))
  if not 0 <= a.temperature < float("inf"):
    cli.fail("--temperature", a.temperature, "must be a finite number >= 0")
  if not 0 < a.top_p <= 1:
    cli.fail("--top-p", a.top_p, "must be in (0, 1]")
  if a.lr is not None and not a.lr > 0:
    cli.fail("--lr", a.lr, "must be > 0")
  if a.buckets is not None:
    try:
      check_fractions(a.buckets, "--buckets")
    except ValueError as e:
      cli.fail("--buckets", a.buckets, str(e).replace("--buckets ", "", 1))
  if not (0 <= a.clip[0] < 1 and a.clip[1] >= 0):
    cli.fail("--clip", list(a.clip), "LOW must be in [0, 1) and HIGH >= 0")
  if a.model is not None and not Path(a.model).is_dir():
    cli.fail("--model", a.model, "is not a folder (a Hugging Face model folder is expected)")
  if a.heads is not None and not Path(a.heads).is_file():
    cli.fail("--heads", a.heads, "is not a file")
  if a.cold_start and (a.heads is not None or a.rollout != "specroll"):
    cli.fail("--cold-start", True, "learns heads inside SpecRoll: it goes with --rollout specroll "
             "and without --heads")
  out = Path(a.out)
  if out.exists() and not out.is_dir():
    cli.fail("--out", a.out, "exists and is not a folder")
  if a.resume and not (out / a.rollout / "checkpoints").is_dir():
    cli.fail("--resume", a.out, f"holds no {a.rollout} run to resume")
  if not a.resume and (out / a.rollout / "checkpoints").is_dir():
    cli.fail("--out", a.out, "already holds a run: pass --resume or choose another --out")
  return a


def check_processes(a) -> None:
  """--coordinator, --num-processes, --process-id: all three or none, each valid. Several
  processes: each decodes and scores the rows its devices hold, the update is one data-parallel
  step over every process's devices, process 0 writes metrics, traces, the summary and plots
  (``app.loop.Run``; tests/test_multiprocess.py). SpecRoll's state is the same in every
  process (its statistics are all-reduced)."""
  flags = {"--coordinator": a.coordinator, "--num-processes": a.num_processes,
           "--process-id": a.process_id}
  missing = [f for f, v in flags.items() if v is None]
  if missing and len(missing) < 3:
    cli.fail(missing[0], None, "--coordinator, --num-processes and --process-id go together "
             f"(all three or none); missing {', '.join(missing)}")
  if missing:
    return
  try:
    distributed.check_args(a.coordinator, a.num_processes, a.process_id)
  except ValueError as e:
    flag = "--" + str(e).split(" ", 1)[0].replace("_", "-")
    cli.fail(flag, flags.get(flag), str(e))


def run_config(a, *, rollout_kind: str) -> RunConfig:
  sampling = rollout.SamplingConfig(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
  lr = a.lr if a.lr is not None else (1e-6 if a.model is not None else
                                      (2e-4 if a.task == "gsm8k" else 3e-4))
  grpo = GRPOConfig(group_size=a.group, learning_rate=lr, beta=a.beta, warmup_steps=a.warmup,
                    clip_eps_low=a.clip[0], clip_eps_high=a.clip[1], old_policy=a.old_policy,
                    sampling=sampling)
  spec = {"auto": rollout.SpecConfig.auto, "cpu": rollout.SpecConfig.for_cpu,
          "h200": rollout.SpecConfig.for_h200}[a.spec]()
  if a.node_budget is not None:
    spec = dataclasses.replace(spec, node_budget=a.node_budget)
  buckets = None if a.buckets is None else tuple(a.buckets)
  if buckets is not None:
    spec = dataclasses.replace(spec, bucket_fractions=buckets)
  # the embedded model: the small-model preset (windows sized for tens of steps, the settings the
  # drift replay tuned for its heads); a real model: the library's defaults
  small = a.model is None
  slow = SP.SlowPathConfig.for_hidden_size(192 if small else 4096, mode=a.slow_path)
  for name, value in (("step_chunks", a.slow_step_chunks), ("degradation_budget",
                      a.slow_refresh_budget), ("learn_budget", a.slow_learn_budget),
                      ("refresh_vocab", a.slow_refresh_vocab),
                      ("bootstrap_batches", a.slow_bootstrap)):
    if value is not None:
      slow = slow.replace(**{name: value})
  reflex = None
  if a.reflex == "on":
    reflex = dataclasses.replace(DEFAULT_REFLEX, sleep_batches=a.reflex_sleep,
                                 sleep_max_batches=a.reflex_sleep_max)
  return RunConfig(grpo=grpo, task=Task(name=a.task, level=a.level), prompts_per_step=a.prompts,
                   max_new_tokens=a.max_new_tokens, steps=a.steps, seed=a.seed,
                   rollout=rollout_kind, spec=spec, reflex=reflex, slow=slow,
                   records_per_batch=a.records_per_batch, kernels=a.kernels,
                   eval_every=a.eval_every, eval_prompts=a.eval_prompts,
                   goodput=a.budget == "goodput", vanilla_buckets=buckets,
                   model_axis=a.model_axis)


def train(a, cfg: RunConfig, model, heads, out: Path, *, resume: bool) -> tuple[list, dict, Run]:
  config, params, tok = model
  r = Run(cfg, config, params, tok, heads, out, resume=resume)
  if r.sr is not None:
    print(f"[{cfg.rollout}] {r.sr.describe(r.sr_state)}", flush=True)
  compile_info = {}
  if r.next_step < cfg.steps:
    warm = r.warmup()
    compile_info = {"rollout_warmup_seconds": warm.rollout_seconds,
                    "train_warmup_seconds": warm.train_seconds}
    print(f"[{cfg.rollout}] warm-up (compile + one call): rollout "
          f"{warm.rollout_seconds:.1f} s, train step {warm.train_seconds:.1f} s", flush=True)
  recs = []
  while r.next_step < cfg.steps:
    rec = r.step().to_dict()  # (an app.trainer.StepMetrics)
    recs.append(rec)
    probe = rec.get("probe_tau")
    print(f"[{cfg.rollout}] step {rec['step'] + 1}/{cfg.steps}  reward {rec['reward_mean']:.3f}  "
          f"acc {rec['accuracy']:.3f}  mixed groups {rec['groups_mixed']}/{cfg.prompts_per_step}  "
          f"tau {rec['tau']:.2f}" + ("" if probe is None else f" (trees: {probe:.2f})") +
          f"  rollout {rec['rollout_seconds']:.2f} s  train {rec['train_seconds']:.2f} s  "
          f"gap {rec['logp_gap_max']:.1e}", flush=True)
    for event in rec.get("events") or ():
      print(f"[{cfg.rollout}]   {event}", flush=True)
  if compile_info and recs:  # warm-up minus the same work done again (the first step)
    compile_info["rollout_compile_seconds"] = max(
        compile_info["rollout_warmup_seconds"] - recs[0]["rollout_seconds"]
        - recs[0]["adaptation_seconds"], 0.0)
    compile_info["train_compile_seconds"] = max(
        compile_info["train_warmup_seconds"] - recs[0]["train_seconds"], 0.0)
  return recs, compile_info, r


def _mean_of(recs: list[dict], key: str) -> float | None:
  """The mean of ``key`` over the records that have it (None when none has)."""
  vals = [r[key] for r in recs if r.get(key) is not None]
  return float(np.mean(vals)) if vals else None


def summarize(recs: list[dict], compile_info: dict) -> dict:
  if not recs:
    return {}
  get = lambda k: np.array([x[k] for x in recs], np.float64)
  return {"steps": len(recs), "rollout_seconds": float(get("rollout_seconds").sum()),
          "adaptation_seconds": float(get("adaptation_seconds").sum()),
          "train_seconds": float(get("train_seconds").sum()),
          "step_seconds": float(get("step_seconds").sum()), "tau": float(get("tau").mean()),
          "probe_tau": _mean_of(recs, "probe_tau"),
          "reward_mean": float(get("reward_mean").mean()),
          "accuracy": float(get("accuracy").mean()),
          "groups_mixed": int(get("groups_mixed").sum()),
          "logp_gap_max": float(get("logp_gap_max").max()), **compile_info}


TASK_NOTE = {
    "synthetic": "synthetic GSM8K-format word problems (level {level}; app/synthetic.py), "
                 "scored by the GSM8K reward. Why not GSM8K itself: the embedded model has 2M "
                 "parameters and solves about 3% of GSM8K, too few correct samples for GRPO to "
                 "learn from; at T = 1 it solves about a third of these (most groups mixed), so "
                 "this run shows GRPO learning. --task gsm8k trains on GSM8K.",
    "mix": "GSM8K and synthetic problems (level {level}), alternating.",
    "gsm8k": "GSM8K train problems.",
}


def main(argv=None):
  a = parse(argv)
  if a.coordinator is not None:  # before any JAX computation
    distributed.initialize(a.coordinator, a.num_processes, a.process_id)
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  print(f"task: {a.task}: " + TASK_NOTE[a.task].format(level=a.level), flush=True)
  try:
    config, params, tok, path = pipeline.load_model(a.model, progress=is_terminal())
  except ValueError as e:
    cli.fail("--model", a.model, str(e))
  if a.dtype is not None and a.dtype != config.dtype and a.widen is None:
    config = config.replace(dtype=a.dtype)
    params = jax.tree.map(lambda x: x.astype(config.jnp_dtype), params)
  from specroll_jax.heads import kinds as head_kinds
  if a.heads is not None:
    try:
      heads = head_kinds.load(a.heads)
      head_kinds.validate(config, heads, 3)
    except ValueError as e:
      cli.fail("--heads", a.heads, str(e))
  else:
    heads = pipeline.default_heads(config, params, tok, path, progress=is_terminal(),
                                   conditioned=True)
  if a.widen is not None:
    config, params, heads = widen(config, params, QWEN25_SHAPES[a.widen],
                                  key=jax.random.key(a.seed), heads=heads, dtype=a.dtype)
    print(f"widened to the Qwen2.5-{a.widen} shape (app.widen: the same function)", flush=True)
  if a.model_axis > 1:
    from specroll_jax.mesh import ModelMesh, make_mesh
    if jax.local_device_count() % a.model_axis:
      cli.fail("--model-axis", a.model_axis, f"does not divide this process's "
               f"{jax.local_device_count()} devices")
    try:
      ModelMesh(make_mesh(1, a.model_axis, devices=jax.local_devices())).check_config(config)
    except ValueError as e:
      cli.fail("--model-axis", a.model_axis, str(e))
  source = a.heads or "shipped beside the model, or fitted"
  if a.cold_start:  # SpecRoll.init("learn"): fresh heads the slow path learns
    heads, source = "learn", "none: learned from the policy's own rollouts (--cold-start)"
  model = (config, params, tok)
  print(f"model {path} ({config.num_layers} layers, d={config.hidden_size}, vocab "
        f"{config.vocab_size}, {config.dtype}); devices {jax.devices()}", flush=True)
  print(f"heads: {'CondHeads' if heads == 'learn' else type(heads).__name__} ({source})",
        flush=True)
  kinds = [a.rollout] + ([] if a.no_compare or a.rollout == "vanilla" else ["vanilla"])
  results, runs = {}, {}
  evals = {}
  for kind in kinds:
    cfg = run_config(a, rollout_kind=kind)
    resume = a.resume and (out / kind / "checkpoints").is_dir()
    if "before" not in evals:
      evals["before"] = held_out(cfg, model, params)
      g0, s0 = evals["before"]
      print(f"held-out accuracy before training ({cfg.eval_prompts} {a.task} test problems): "
            f"greedy {g0:.3f}, sampled at T={a.temperature} {s0:.3f}", flush=True)
    recs, compile_info, r = train(a, cfg, model, heads, out / kind, resume=resume)
    all_recs = ([m.to_dict() for m in read_metrics(out / kind / "metrics.jsonl")] if r.writer
                else recs)
    evals[kind] = held_out(cfg, model, r.local_params(), r.trainer.rollout_mesh)
    (g0, s0), (g1, s1) = evals["before"], evals[kind]
    print(f"[{kind}] held-out accuracy after {cfg.steps} steps: greedy {g1:.3f} (before "
          f"{g0:.3f}), sampled at T={a.temperature} {s1:.3f} (before {s0:.3f})", flush=True)
    results[kind] = {"summary": summarize(recs, compile_info), "records": all_recs,
                     "held_out": {"before": g0, "after": g1, "sampled_before": s0,
                                  "sampled_after": s1}}
    runs[kind] = r
  if jax.process_index() != 0:  # process 0 writes the summary and the plots
    for r in runs.values():
      r.close()
    return results
  table = compare(results, runs, kinds)
  meta = {"command": "experiments/gsm8k.py " + " ".join(sys.argv[1:] if argv is None else argv),
          "model": str(path), "cpu": _common.cpu_model(),
          "devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
          "machine": platform.machine()}
  (out / "summary.json").write_text(json.dumps({"meta": meta, "table": table,
                                                "summaries": {k: v["summary"]
                                                              for k, v in results.items()}},
                                               indent=2))
  plot(results, out / "gsm8k.png")
  for r in runs.values():
    r.close()
  print(f"wrote {out / 'summary.json'}, {out / 'gsm8k.png'} and per-run metrics.jsonl, traces, "
        f"checkpoints in {', '.join(str(out / k) for k in kinds)}")
  return results


def held_out(cfg: RunConfig, model, params, mesh=None) -> tuple[float, float]:
  """Strict accuracy on the first ``cfg.eval_prompts`` test problems of the task: greedy, and one
  sample per problem under the run's sampling rule (fixed seed: the same responses for the same
  parameters); ``mesh``: the rollout mesh ``params`` are split over."""
  from app import evaluation
  config, _, tok = model
  exs = cfg.task.examples("test")[: cfg.eval_prompts]
  greedy = evaluation.accuracy(config, params, tok, exs, max_new_tokens=cfg.max_new_tokens,
                               mesh=mesh)
  sampled = evaluation.accuracy(config, params, tok, exs, max_new_tokens=cfg.max_new_tokens,
                                sampling=cfg.grpo.sampling, seed=10**6 + cfg.seed, mesh=mesh)
  return greedy.accuracy_strict, sampled.accuracy_strict


def compare(results, runs, kinds) -> dict:
  from rich.console import Console
  from rich.table import Table
  base = results.get("vanilla", {}).get("summary")
  t = Table(title="GRPO: the same batches and seeds, rollouts by each engine (seconds exclude "
                  "compile; vanilla = the compacting vanilla engine)")
  for c in ("engine", "steps", "rollout s", "adaptation s", "train s", "step s", "tau",
            "tau of verified trees", "rollout speedup", "step speedup", "reward first 3 -> last 3",
            "held-out greedy before -> after", "held-out sampled before -> after",
            "mixed groups", "compile rollout s", "max |dlogp|"):
    t.add_column(c)
  table = {}
  for kind in kinds:
    s = results[kind]["summary"]
    if not s:
      continue
    roll = s["rollout_seconds"] + s["adaptation_seconds"]
    rw = [x["reward_mean"] for x in results[kind]["records"]]
    held = results[kind].get("held_out", {})
    row = {"engine": kind, **s, "reward_first3": float(np.mean(rw[:3])),
           "reward_last3": float(np.mean(rw[-3:])), "held_out": held}
    if base and kind != "vanilla":
      row["rollout_speedup"] = base["rollout_seconds"] / max(roll, 1e-9)
      row["step_speedup"] = base["step_seconds"] / max(s["step_seconds"], 1e-9)
    table[kind] = row
    t.add_row(kind, str(s["steps"]), f"{s['rollout_seconds']:.2f}",
              f"{s['adaptation_seconds']:.2f}", f"{s['train_seconds']:.2f}",
              f"{s['step_seconds']:.2f}", f"{s['tau']:.3f}",
              "-" if s.get("probe_tau") is None else f"{s['probe_tau']:.3f}",
              f"{row.get('rollout_speedup', 1.0):.2f}x", f"{row.get('step_speedup', 1.0):.2f}x",
              f"{row['reward_first3']:.3f} -> {row['reward_last3']:.3f}",
              f"{held.get('before', float('nan')):.3f} -> {held.get('after', float('nan')):.3f}",
              f"{held.get('sampled_before', float('nan')):.3f} -> "
              f"{held.get('sampled_after', float('nan')):.3f}",
              str(s["groups_mixed"]),
              f"{s.get('rollout_compile_seconds', float('nan')):.1f}", f"{s['logp_gap_max']:.1e}")
  Console(width=200).print(t)
  if len(runs) == 2:  # the objective is unchanged: same rewards, same parameters
    recs = [results[k]["records"] for k in kinds]
    same_rewards = all(x["reward_mean"] == y["reward_mean"] for x, y in zip(*recs, strict=False))
    pa, pb = (jax.device_get(runs[k].state.train.params) for k in kinds)
    diff = max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
               for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True))
    table["same_rewards"] = bool(same_rewards)
    table["max_param_diff"] = diff
    print(f"same rewards at every step: {same_rewards}; max |param difference| after the runs: "
          f"{diff:.2e}")
  return table


def plot(results, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 6, figsize=(26, 4))
  for kind, res in results.items():
    recs = res["records"]
    if not recs:
      continue
    x = [r["step"] for r in recs]
    style = "o-" if kind != "vanilla" else "s--"
    ax[0].plot(x, [r["reward_mean"] for r in recs], style, label=kind)
    ax[1].plot(x, [r["accuracy"] for r in recs], style, label=f"{kind}: train samples (T)")
    held = res.get("held_out")
    if held:
      ax[1].plot([x[0] - 0.5, x[-1] + 0.5], [held["before"], held["after"]], style[0] + ":",
                 ms=9, label=f"{kind}: held-out greedy, before / after")
      ax[1].plot([x[0] - 0.5, x[-1] + 0.5], [held["sampled_before"], held["sampled_after"]],
                 style[0] + "-.", ms=9, label=f"{kind}: held-out sampled (T), before / after")
    ax[2].plot(x, [r["tau"] for r in recs], style, label=f"{kind}: tau used")
    probes = [(r["step"], r["probe_tau"]) for r in recs if r.get("probe_tau") is not None]
    if probes and kind != "vanilla":
      ax[2].plot(*zip(*probes, strict=True), "^", ms=8, label=f"{kind}: tau of verified trees")
    ax[3].plot(x, [r["entropy"] for r in recs], style, label=kind)
    ax[5].semilogy(x, [max(r["logp_gap_max"], 1e-9) for r in recs], style, label=kind)
  kinds = [k for k in results if results[k]["records"]]
  parts = ("rollout_seconds", "adaptation_seconds", "reward_seconds", "train_seconds")
  bottom = np.zeros(len(kinds))
  for p in parts:
    vals = np.array([np.mean([r[p] for r in results[k]["records"]]) for k in kinds])
    ax[4].bar(kinds, vals, bottom=bottom, label=p.replace("_seconds", ""))
    bottom += vals
  titles = ("mean reward per step", "accuracy", "tau (tokens / target forward)",
            "policy entropy (nats)", "mean step time split (s)", "max |trainer - rollout logprob|")
  for a_, t in zip(ax, titles, strict=True):
    a_.set_title(t)
    a_.legend(fontsize=8)
  for a_ in (ax[0], ax[1], ax[2], ax[3], ax[5]):
    a_.set_xlabel("GRPO step")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


if __name__ == "__main__":
  main()
