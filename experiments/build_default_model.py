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
import json
import sys
from pathlib import Path

import _common  # noqa: F401
import numpy as np

from specroll_jax import cli, models, sft
from specroll_jax.cli import fail


def grpo_signal(path, *, prompts: int = 32, group: int = 8, max_new_tokens: int = 256,
                temperature: float = 1.0, seed: int = 0) -> dict:
  """Rewards of ``prompts`` GSM8K train prompts x ``group`` samples at ``temperature``."""
  from specroll_jax import pipeline, rewards, rollout
  config, params, tok, _ = pipeline.load_model(path)
  ids, golds = pipeline.prompts(tok, "train", prompts)
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


def fit_and_save_heads(path, *, seed: int = 1234) -> dict:
  """Fit K = 3 heads on the model's own T = 1 rollouts of 128 train prompts (600 AdamW steps),
  write ``heads.safetensors`` beside it; returns the heads' top-1 accuracy on held-out rollouts."""
  from specroll_jax import heads as H
  from specroll_jax import pipeline, rollout
  config, params, tok, _ = pipeline.load_model(path)
  hd = pipeline.fitted_heads(config, params, tok, path, num_heads=3, num_prompts=128,
                             max_new_tokens=256, temperature=1.0, steps=600, seed=seed,
                             progress=sys.stdout.isatty(), cache=False)
  H.save(Path(path) / "heads.safetensors", hd)
  ids, _ = pipeline.prompts(tok, "train", 32, offset=1000)  # not among the 128 fitted on
  r = rollout.generate(config, params, ids, max_new_tokens=256, seed=seed + 1,
                       eos_ids=tok.eos_ids, return_hidden=True)
  acc = H.head_accuracy(config, params, hd, r.tokens, r.lengths, r.hidden)
  return {"heads_fit": "K=3, 128 train prompts x 1 at T=1, 256 tokens, 600 AdamW steps",
          "heads_heldout_top1": [float(x) for x in acc]}


def main(argv=None):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--out", default="specroll_jax/assets/gsm8k-tiny")
  ap.add_argument("--steps", type=int, default=1200)
  ap.add_argument("--lr", type=float, default=5e-3)
  ap.add_argument("--batch-size", type=int, default=32)
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args(argv)
  if a.steps < 1:
    fail("--steps", a.steps, "must be >= 1")
  if not a.lr > 0:
    fail("--lr", a.lr, "must be > 0")
  out = Path(a.out)
  if out.exists() and not (out / "metrics.json").exists():
    fail("--out", str(out), "exists but holds no finished SFT model; remove it first")
  # an existing --out with a finished SFT model (an interrupted build) continues after the SFT
  cfg = sft.SFTConfig(steps=a.steps, learning_rate=a.lr, batch_size=a.batch_size, seed=a.seed)
  sft.build_model(out, models.ModelConfig.embedded_default, cfg, eval_examples=64,
                  progress=sys.stdout.isatty())
  metrics = json.loads((out / "metrics.json").read_text())
  metrics.update(fit_and_save_heads(out))
  metrics.update(grpo_signal(out))
  metrics["reproduce"] = "python experiments/build_default_model.py " + " ".join(
      f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items())
  (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
  print(json.dumps({k: v for k, v in metrics.items() if k != "sft_config"}, indent=2))


if __name__ == "__main__":
  main()
