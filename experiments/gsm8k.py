"""The main job: GRPO-shaped GSM8K rollouts of the target, vanilla and speculative, with rewards.

  make run                                     # embedded tiny model on CPU (built on first use)
  .venv/bin/python experiments/gsm8k.py --model /path/to/Qwen2.5-1.5B-Instruct --prompts 64

For P test prompts x G responses it samples with the vanilla engine and with the speculative engine
(future-token heads fitted on the target's own rollouts of *train* prompts), checks that both return
the same tokens, scores every response with the GSM8K reward and reports accuracy, pass@G, the
GRPO group advantages' spread, tau and wall-clock. Writes metrics JSON and a PNG into --out.
(The GRPO training step builds on this; until it lands, this job measures rollouts and rewards.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _common  # noqa: F401
import jax
import numpy as np

from specroll_jax import pipeline, rewards, rollout


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default=None, help="HF model folder (default: embedded tiny model)")
  ap.add_argument("--prompts", type=int, default=8, help="GSM8K test prompts")
  ap.add_argument("--group", type=int, default=8, help="responses per prompt (G)")
  ap.add_argument("--max-new-tokens", type=int, default=256)
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--top-p", type=float, default=1.0)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--spec", default="cpu", choices=["cpu", "h200", "off"],
                  help="SpecConfig preset for the speculative engine")
  ap.add_argument("--kernels", default="auto",
                  choices=["auto", "reference", "pallas", "pallas_interpret"])
  ap.add_argument("--out", default="runs/gsm8k")
  a = ap.parse_args(argv)

  config, params, tok, path = pipeline.load_model(a.model)
  ids, golds = pipeline.prompts(tok, "test", a.prompts)
  batch, sids = pipeline.grpo_batch(ids, a.group)
  cfg = rollout.SamplingConfig(temperature=a.temperature, top_p=a.top_p)
  kw = dict(sampling=cfg, max_new_tokens=a.max_new_tokens, seed=a.seed, sample_ids=sids,
            eos_ids=tok.eos_ids, kernels=a.kernels)
  results = {}
  t0 = time.perf_counter()
  van = rollout.generate(config, params, batch, **kw)
  jax.block_until_ready(van.tokens)
  results["vanilla_seconds_incl_compile"] = time.perf_counter() - t0
  spec_out = None
  if a.spec != "off":
    heads = pipeline.fitted_heads(config, params, tok, path, temperature=a.temperature,
                                  max_new_tokens=a.max_new_tokens)
    spec = rollout.SpecConfig.for_h200() if a.spec == "h200" else rollout.SpecConfig.for_cpu()
    t0 = time.perf_counter()
    spec_out = rollout.generate(config, params, batch, spec=spec, heads=heads, **kw)
    jax.block_until_ready(spec_out.tokens)
    results["speculative_seconds_incl_compile"] = time.perf_counter() - t0
    results["identical_to_vanilla"] = bool(
        (np.asarray(spec_out.tokens) == np.asarray(van.tokens)).all()
        and (np.asarray(spec_out.lengths) == np.asarray(van.lengths)).all())
    results["tau"] = spec_out.stats.tokens_per_forward
    results["head_acceptance"] = spec_out.stats.head_acceptance.tolist()
    results["target_forwards"] = {"vanilla": int(van.stats.target_forwards) + 1,
                                  "speculative": int(spec_out.stats.target_forwards) + 1}

  lens = np.asarray(van.lengths)
  texts = [tok.decode(np.asarray(van.tokens[i, : lens[i]]).tolist()) for i in range(len(batch))]
  r = rewards.batch_rewards(texts, [g for g in golds for _ in range(a.group)],
                            format_weight=0.1).reshape(a.prompts, a.group)
  correct = rewards.batch_rewards(texts, [g for g in golds for _ in range(a.group)]
                                  ).reshape(a.prompts, a.group)
  adv = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)
  results.update({
      "model": str(path), "prompts": a.prompts, "group": a.group, "sampling": vars(cfg),
      "accuracy": float(correct.mean()), "pass_at_group": float((correct > 0).any(1).mean()),
      "mean_reward_with_format": float(r.mean()),
      "groups_with_signal": int((r.std(1) > 0).sum()),
      "mean_abs_advantage": float(np.abs(adv).mean()),
      "mean_response_tokens": float(lens.mean()), "max_response_tokens": int(lens.max()),
      "eos_rate": float((lens < a.max_new_tokens).mean()),
  })
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "metrics.json").write_text(json.dumps(results, indent=2))
  (out / "samples.txt").write_text("\n\n".join(
      f"[prompt {i // a.group} member {i % a.group}] reward={r.flat[i]:.1f}\n{texts[i]}"
      for i in range(min(len(texts), 16))))
  _plot(lens, r, spec_out, out / "rollouts.png", a.max_new_tokens)
  for k, v in results.items():
    print(f"{k:36s} {v}")
  print(f"wrote {out / 'metrics.json'}, {out / 'rollouts.png'}, {out / 'samples.txt'}")
  return results


def _plot(lens, r, spec_out, path, max_new):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
  ax[0].hist(lens, bins=30)
  ax[0].set_xlabel("response length (tokens)")
  ax[0].set_title("GRPO long tail")
  ax[1].bar(range(r.shape[0]), r.mean(1))
  ax[1].set_xlabel("prompt")
  ax[1].set_ylabel("mean reward (incl. format)")
  if spec_out is not None:
    tr = np.asarray(spec_out.stats.active_trace)
    ax[2].step(range(len(tr)), tr, where="post", label="speculative")
    ax[2].step(range(max_new + 1), [(lens > f).sum() for f in range(max_new + 1)], where="post",
               label="vanilla")
    ax[2].set_xlabel("target forward")
    ax[2].set_ylabel("active rows")
    ax[2].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
