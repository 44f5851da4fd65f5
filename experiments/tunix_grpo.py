"""GRPO in google/tunix with SpecRoll rollouts: tunix's RLCluster and GRPOLearner train the embedded
model (a Hugging Face Qwen2 folder loaded into tunix's Qwen2) on synthetic GSM8K-format problems,
and ``SpecRollRollout`` decodes for them (the ``tunix`` extra: ``pip install -e '.[tunix]'``).

  .venv-tunix/bin/python experiments/tunix_grpo.py                        # SpecRoll rollouts
  .venv-tunix/bin/python experiments/tunix_grpo.py --proposer vanilla     # our vanilla engine
  .venv-tunix/bin/python experiments/tunix_grpo.py --quick                # CI-sized

Each step: P problems x G samples from tunix's actor (the module it trains, which the rollout reads
in place), the GSM8K reward on the completion text (1 for the right final number, +0.1 for a
"#### N" line), one GRPO update (beta = 0: no reference model). ``--proposer specroll`` (default)
decodes through the ``SpecRoll`` object with the heads shipped beside the model
(``cond_heads.safetensors``), its state carried across steps; each step prints the reward mean and
the rollout's report (mode, tau, probe_tau). At the end the first step's batch is decoded again,
from the initial weights, by the other backend (vanilla for SpecRoll and vice versa) with the same
seed and sample ids: the tokens must be identical (exit status 1 otherwise). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import _common
import jax
import numpy as np
import optax
from jax.sharding import Mesh
from transformers import AutoTokenizer
from tunix.rl import rl_cluster as rlc
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from app import cli, pipeline
from app.tasks import Task
from specroll_jax import rewards
from specroll_jax.adaptation.slow_path import SlowPathConfig
from specroll_jax.data import gsm8k
from specroll_jax.engines.config import SpecConfig
from specroll_jax.integrations import tunix as sr
from specroll_jax.mesh import ModelMesh

FORMAT_WEIGHT = 0.1  # the reward's bonus for a well-formed "#### N" line (as experiments/gsm8k.py)


def parse(argv):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  _common.add_shared_flags(ap, out="runs/tunix_grpo.json", prompts=4, group=4, max_new_tokens=48,
                           prompts_help="problems per step")
  ap.add_argument("--steps", type=int, default=8, help="GRPO steps")
  ap.add_argument("--proposer", choices=["specroll", "vanilla"], default="specroll",
                  help="rollout backend: SpecRoll with the shipped heads, or our vanilla engine")
  ap.add_argument("--budget", choices=["goodput", "fixed"], default="goodput",
                  help="SpecRoll's node budget: goodput's measured choice or the fixed one")
  ap.add_argument("--lr", type=float, default=3e-4, help="Adam learning rate")
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--mesh", default="1x1", metavar="FSDPxTP",
                  help="every role's ('fsdp', 'tp') mesh over the first FSDP x TP devices: tunix "
                       "shards the trainer, the rollout decodes on it (rows over fsdp, weights "
                       "and KV cache over tp; tp must divide the model's KV heads)")
  ap.add_argument("--quick", action="store_true",
                  help="CI-sized: 2 steps of 2 problems x 2, 16 tokens; SpecRoll with the fixed "
                       "budget, one bucket, no Reflex, no slow path (one program to compile)")
  a = ap.parse_args(argv)
  _common.check_shared_flags(a, steps=1, lr=1e-12, temperature=0.0)
  if a.quick:
    a.steps, a.prompts, a.group, a.max_new_tokens, a.budget = 2, 2, 2, 16, "fixed"
  try:
    a.mesh_shape = tuple(int(x) for x in a.mesh.lower().split("x"))
    assert len(a.mesh_shape) == 2 and min(a.mesh_shape) >= 1
  except (ValueError, AssertionError):
    cli.fail("--mesh", a.mesh, "expected FSDPxTP, e.g. 2x2")
  if a.mesh_shape[0] * a.mesh_shape[1] > jax.device_count():
    cli.fail("--mesh", a.mesh, f"needs {a.mesh_shape[0] * a.mesh_shape[1]} devices, there are "
             f"{jax.device_count()}")
  return a


def engine(kind: str, heads, a):
  """The rollout engine the cluster builds: SpecRoll with ``heads``, or the vanilla engine."""
  settings = {"budget": a.budget}
  if a.quick:
    settings.update(spec=SpecConfig(bucket_fractions=(1.0,), node_budget=16), reflex=None,
                    slow=SlowPathConfig(mode="off"))
  kw = dict(heads=heads, specroll=settings) if kind == "specroll" else {}
  return functools.partial(sr.SpecRollRollout, num_generations=a.group, seed=a.seed, **kw)


def responses(rollout: sr.SpecRollRollout) -> list[np.ndarray]:
  """The last call's responses (our engine's output: each row up to its length, EOS included)."""
  out = rollout.last_rollout
  return [t[:n] for t, n in zip(np.asarray(out.tokens), np.asarray(out.lengths), strict=True)]


def main(argv=None):
  a = parse(argv)
  config, params, ours, path = _common.load_model(a)  # the embedded model unless --model
  heads = pipeline.default_heads(config, params, ours, path, conditioned=True, progress=False)
  try:  # tunix's Qwen2 holding the folder's weights; the tokenizer from the same folder
    model = sr.tunix_qwen2_from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
  except (ValueError, OSError) as e:
    cli.fail("--model", a.model, str(e))
  del params  # tunix trains `model`; the rollout reads its Params in place
  problems = Task(name="synthetic", level=0, train_size=a.steps * a.prompts).examples("train")
  questions = [gsm8k.format_prompt(e.question) for e in problems]
  golds = [e.gold for e in problems]
  longest = max(len(tok.encode(q)) for q in questions)
  rc = base_rollout.RolloutConfig(max_tokens_to_generate=a.max_new_tokens,
                                  max_prompt_length=1 << (longest - 1).bit_length(),
                                  temperature=a.temperature, top_p=1.0, top_k=None, seed=a.seed)
  fsdp, tp = a.mesh_shape
  mesh = Mesh(np.array(jax.devices()[:fsdp * tp]).reshape(fsdp, tp), ("fsdp", "tp"))
  if tp > 1:
    try:
      ModelMesh(mesh, data="fsdp", model="tp").check_config(config)
    except ValueError as e:
      cli.fail("--mesh", a.mesh, str(e))
  cluster_config = rlc.ClusterConfig(
      role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
      rollout_engine=engine(a.proposer, heads, a), rollout_config=rc,
      training_config=rlc.RLTrainingConfig(actor_optimizer=optax.adam(a.lr), max_steps=a.steps,
                                           eval_every_n_steps=10**9))
  cluster = rlc.RLCluster(actor=model, reference=None, tokenizer=tok, cluster_config=cluster_config)
  rollout = cluster.rollout
  print(f"tunix GRPO: {path.name}, {a.steps} steps of {a.prompts} problems x {a.group}, "
        f"{a.max_new_tokens} tokens, rollout: {a.proposer}"
        + (f" ({a.budget} budget)" if rollout.speculative else ""), flush=True)
  log: list[dict] = []
  first: list[np.ndarray] = []

  def reward(prompts, completions, answer, **kw):  # tunix calls it once per step, after the rollout
    r = rewards.batch_rewards(completions, list(answer), format_weight=FORMAT_WEIGHT)
    if not first:
      first.extend(responses(rollout))
    line = {"step": len(log) + 1, "reward_mean": round(float(r.mean()), 4)}
    if rollout.report is not None:
      rep = rollout.report
      line.update(mode=rep.mode, tau=round(rep.tau, 3),
                  probe_tau=None if rep.probe_tau is None else round(rep.probe_tau, 3))
    log.append(line)
    print("  ".join(f"{k} {v}" for k, v in line.items()), flush=True)
    return r.tolist()

  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=reward,
      algo_config=grpo_learner.GRPOConfig(num_generations=a.group, num_iterations=1, beta=0.0))
  p = a.prompts
  learner.train([{"prompts": np.array(questions[i * p:(i + 1) * p]),
                  "answer": np.array(golds[i * p:(i + 1) * p])} for i in range(a.steps)])

  # the first step again from the initial weights, through the other backend
  other = "vanilla" if a.proposer == "specroll" else "specroll"
  again = engine(other, heads, a)(rollout_actor=sr.tunix_qwen2_from_pretrained(path),
                                  tokenizer=tok, rollout_config=rc)
  again.generate(list(np.repeat(questions[:p], a.group)), rc)
  same = len(first) == p * a.group and all(
      np.array_equal(x, y) for x, y in zip(first, responses(again), strict=True))
  print(f"first step, {a.proposer} vs {other} on the same batch, seed and sample ids: "
        f"{'identical' if same else 'DIFFERENT'} tokens ({len(first)} responses, "
        f"{sum(len(t) for t in first)} tokens)", flush=True)
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  res = {"command": "experiments/tunix_grpo.py " + " ".join(argv or sys.argv[1:]),
         "steps": log, "first_step_identical": same}
  out.write_text(json.dumps(res, indent=1))
  if not same:
    raise SystemExit(1)
  return res


if __name__ == "__main__":
  main()
