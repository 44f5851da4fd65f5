"""Reproduce the embedded default model that ships in ``specroll_jax/assets/gsm8k-tiny``.

  .venv/bin/python experiments/build_default_model.py --out specroll_jax/assets/gsm8k-tiny

Trains the byte-level BPE tokenizer on GSM8K train, then the Qwen2-architecture model of
``ModelConfig.embedded_default`` by SFT on the train solutions for a fixed number of steps (optax
AdamW, warmup + cosine), writes it in Hugging Face layout (config.json, model.safetensors,
tokenizer.json), future-token heads fitted on the model's own T = 1 rollouts of 128 train prompts
(heads.safetensors) and a metrics.json with: SFT losses, GSM8K test loss, greedy test accuracy, the
heads' held-out top-1 accuracy, and the GRPO signal at T = 1 on 32 train prompts x 8 samples
(accuracy, pass@8, groups with mixed rewards).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import _common  # noqa: F401
import numpy as np

from app import cli, sft
from app.cli import fail
from specroll_jax import models


def grpo_signal(path, *, prompts: int = 32, group: int = 8, max_new_tokens: int = 256,
                temperature: float = 1.0, seed: int = 0, task=None) -> dict:
  """Rewards of ``prompts`` train prompts of ``task`` (default GSM8K) x ``group`` samples at
  ``temperature``."""
  from app import pipeline
  from specroll_jax import rewards, rollout
  from specroll_jax.data import gsm8k
  config, params, tok, _ = pipeline.load_model(path)
  exs = (task.examples("train") if task is not None else gsm8k.load("train"))[:prompts]
  ids = [tok.encode(gsm8k.format_prompt(e.question)) for e in exs]
  golds = [e.gold for e in exs]
  batch, sids = pipeline.grpo_batch(ids, group)
  r = rollout.generate(config, params, batch, max_new_tokens=max_new_tokens, seed=seed,
                       sample_ids=sids, eos_ids=tok.eos_ids,
                       sampling=rollout.SamplingConfig(temperature=temperature))
  lens = np.asarray(r.lengths)
  texts = [tok.decode(np.asarray(r.tokens[i, : lens[i]]).tolist()) for i in range(len(batch))]
  correct = rewards.batch_rewards(texts, [g for g in golds for _ in range(group)])
  correct = correct.reshape(prompts, group)
  return {"signal_prompts": prompts, "signal_group": group, "signal_temperature": temperature,
          "signal_accuracy": float(correct.mean()),
          "signal_pass_at_group": float((correct > 0).any(1).mean()),
          "signal_groups_mixed": int((correct.std(1) > 0).sum())}


def fit_and_save_heads(path, *, seed: int = 1234, task=None) -> dict:
  """Fit K = 3 Medusa heads on the model's own T = 1 rollouts of 128 train prompts of ``task``
  (default GSM8K; 600 AdamW steps), write ``heads.safetensors`` beside it; returns the heads'
  top-1 accuracy on held-out rollouts."""
  import jax

  from app import pipeline
  from specroll_jax import rollout
  from specroll_jax.heads import medusa as H
  config, params, tok, _ = pipeline.load_model(path)
  t1 = rollout.SamplingConfig(temperature=1.0)
  tr = pipeline.self_rollouts(config, params, tok, num_prompts=128, max_new_tokens=256,
                              sampling=t1, seed=seed, task=task)
  hd = H.init(jax.random.key(seed), config, 3)
  hd, _ = H.fit_heads(config, params, hd, *tr, steps=600, progress=sys.stdout.isatty())
  H.save(Path(path) / "heads.safetensors", hd)
  held = pipeline.self_rollouts(config, params, tok, num_prompts=32, offset=1000,
                                max_new_tokens=256, sampling=t1, seed=seed + 1, task=task)
  acc = H.head_accuracy(config, params, hd, *held)
  return {"heads_fit": "K=3, 128 train prompts x 1 at T=1, 256 tokens, 600 AdamW steps",
          "heads_heldout_top1": [float(x) for x in acc]}


def synthetic_stage(base, out, *, level: int, steps: int, lr: float, batch_size: int,
                    seq_len: int, seed: int) -> dict:
  """Continue SFT of the GSM8K model in ``base`` on GSM8K + synthetic problems (alternating, the
  same tokenizer), write the result to ``out`` (model, tokenizer) and return its metrics: losses,
  greedy accuracy on synthetic test problems and GSM8K test, the GRPO signal at T = 1 on
  synthetic train prompts."""
  import shutil

  from app import evaluation, pipeline, tasks
  config, params, tok, _ = pipeline.load_model(base)
  mix = tasks.Task(name="mix", level=level, seed=seed)
  cfg = sft.SFTConfig(vocab_size=config.vocab_size, seq_len=seq_len, batch_size=batch_size,
                      steps=steps, learning_rate=lr, warmup=20, seed=seed)
  params, metrics = sft.train(config, tok, cfg, progress=sys.stdout.isatty(),
                              examples=mix.examples("train"), init=params)
  out = Path(out)
  tmp = out.with_name(out.name + ".tmp")
  if tmp.exists():
    shutil.rmtree(tmp)
  tmp.mkdir(parents=True)
  models.save_pretrained(tmp, config, params)
  tok.save(tmp)
  syn = tasks.Task(name="synthetic", level=level, seed=seed)
  metrics.update(
      stage="synthetic", base=str(base), level=level, sft_config=dataclasses.asdict(cfg),
      gsm8k_test_loss=sft.test_loss(config, params, tok, 288),
      synthetic_greedy=evaluation.accuracy(config, params, tok, syn.examples("test")[:128],
                                           max_new_tokens=96).to_dict(),
      gsm8k_greedy=evaluation.accuracy(config, params, tok, tasks.Task().examples("test")[:64],
                                       max_new_tokens=192).to_dict())
  (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2))
  if out.exists():
    shutil.rmtree(out)
  tmp.rename(out)
  metrics.update(grpo_signal(out, task=syn, max_new_tokens=96))
  return metrics


def fit_and_save_cond_heads(path, *, task=None, num_prompts: int = 2048, steps: int = 4000,
                            max_new_tokens: int = 256, seed: int = 1234) -> dict:
  """Root-conditioned heads fitted on the model's own T = 1 rollouts of ``num_prompts`` train
  prompts of ``task`` (default GSM8K), written as ``cond_heads.safetensors``; returns their head-1
  quality on held-out rollouts (other prompts) against the target's own top-k mass."""
  from app import pipeline
  from specroll_jax import rollout
  from specroll_jax.heads import conditioned as CH
  config, params, tok, _ = pipeline.load_model(path)
  sampling = rollout.SamplingConfig(temperature=1.0)
  hd = pipeline.fitted_cond_heads(config, params, tok, path, num_prompts=num_prompts,
                                  steps=steps, max_new_tokens=max_new_tokens, sampling=sampling,
                                  seed=seed, progress=sys.stdout.isatty(), cache=False, task=task,
                                  tv_weight=0.0)  # the shipped heads' loss (no TV term)
  CH.save(Path(path) / "cond_heads.safetensors", hd)
  held = pipeline.self_rollouts(config, params, tok, num_prompts=128, offset=num_prompts,
                                max_new_tokens=max_new_tokens, sampling=sampling, seed=seed + 1,
                                task=task)
  return {"cond_heads_fit": f"K=3, {num_prompts} train prompts x 1 at T=1, {max_new_tokens} "
                            f"tokens, {steps} AdamW steps, soft self-distillation",
          "cond_heads_heldout": CH.hit_rates(config, params, hd, *held,
                                             sampling=sampling).to_dict()}


def main(argv=None):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--stage", default="sft", choices=["sft", "synthetic"],
                  help="sft: GSM8K SFT from scratch; synthetic: continue --base on GSM8K + the "
                       "synthetic task")
  ap.add_argument("--base", default=None, help="--stage synthetic: the GSM8K model to continue")
  ap.add_argument("--out", default="specroll_jax/assets/gsm8k-tiny")
  ap.add_argument("--steps", type=int, default=1200)
  ap.add_argument("--lr", type=float, default=5e-3)
  ap.add_argument("--batch-size", type=int, default=32)
  ap.add_argument("--seq-len", type=int, default=288)
  ap.add_argument("--level", type=int, default=1, help="synthetic difficulty level")
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args(argv)
  cli.require(a, steps=1, batch_size=1, seq_len=16, level=0, seed=0)
  if not a.lr > 0:
    fail("--lr", a.lr, "must be > 0")
  out = Path(a.out)
  if a.stage == "synthetic":
    from app import synthetic, tasks
    try:
      synthetic.Difficulty.from_level(a.level)
    except ValueError as e:
      fail("--level", a.level, str(e))
    if a.base is None or not (Path(a.base) / "model.safetensors").exists():
      fail("--base", a.base, "must be a model folder (the GSM8K SFT model to continue)")
    metrics = synthetic_stage(a.base, out, level=a.level, steps=a.steps, lr=a.lr,
                              batch_size=a.batch_size, seq_len=a.seq_len, seed=a.seed)
    task = tasks.Task(name="synthetic", level=a.level, seed=a.seed)
    metrics.update(fit_and_save_heads(out, task=task))
    metrics.update(fit_and_save_cond_heads(out, task=task))
  else:
    if out.exists() and not (out / "metrics.json").exists():
      fail("--out", str(out), "exists but holds no finished SFT model; remove it first")
    # an existing --out with a finished SFT model (an interrupted build) continues after the SFT
    cfg = sft.SFTConfig(steps=a.steps, learning_rate=a.lr, batch_size=a.batch_size, seed=a.seed,
                        seq_len=a.seq_len)
    sft.build_model(out, models.ModelConfig.embedded_default, cfg, eval_examples=64,
                    progress=sys.stdout.isatty())
    metrics = json.loads((out / "metrics.json").read_text())
    metrics.update(fit_and_save_heads(out))
    metrics.update(grpo_signal(out))
  metrics["reproduce"] = "python experiments/build_default_model.py " + " ".join(
      f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None)
  (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
  print(json.dumps({k: v for k, v in metrics.items()
                    if k not in ("sft_config", "train_loss_curve")}, indent=2))


if __name__ == "__main__":
  main()
