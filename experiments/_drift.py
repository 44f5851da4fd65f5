"""The GRPO policy sequence that experiments/bench_adaptation.py replays, its drift measures and
the refit ceiling; every function reads the script's parsed flags ``a``.

Phase 1 (``ensure_policies``): a GRPO run (``app.loop.Run``, vanilla rollouts at T = 1, synthetic
task) saves its policy with orbax at step 0, every --save-every steps and the last, each meta
naming the model, the GRPO settings and the step's metrics; ``Policies`` restores them. Drift along
a batch: entropy and KL to step 0 (``policy_scores``), relative parameter change
(``param_change``). Ceiling (``fit_ceilings``): heads fitted from scratch on a policy's own
rollouts, cached beside the policies.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path

import _common  # noqa: F401  (the repository on sys.path, as for the scripts)
import jax
import jax.numpy as jnp
import numpy as np

from app import cli, pipeline
from app.checkpoint import Checkpointer
from app.tasks import Task
from specroll_jax import rollout
from specroll_jax.grpo.logprobs import trainer_hidden
from specroll_jax.heads import conditioned as CH
from specroll_jax.models import decoder as _dec
from specroll_jax.progress import progress_range
from specroll_jax.sampling import allowed_logits

GRPO_TEMPERATURE = 1.0


def one_line(e) -> str:
  """An exception's message on one line (for ``cli.fail``)."""
  return " ".join(str(e).split())


# -- Phase 1: the policy sequence


def policy_steps(a) -> list[int]:
  """GRPO steps whose policy is saved: 0, every --save-every-th and the last."""
  return sorted(set(range(0, a.grpo_steps + 1, a.save_every)) | {a.grpo_steps})


def grpo_settings(a) -> dict:
  return {"task": "synthetic", "level": a.level, "steps": a.grpo_steps, "save_every": a.save_every,
          "learning_rate": a.grpo_lr, "warmup_steps": a.grpo_warmup,
          "prompts_per_step": a.grpo_prompts, "group": a.grpo_group,
          "max_new_tokens": a.grpo_max_new_tokens, "temperature": GRPO_TEMPERATURE,
          "seed": a.seed, "rollout": "vanilla"}


def model_identity(params, path) -> dict:
  """The model folder, a hash of its config.json and a fingerprint of its weights (every leaf's
  path, shape, dtype and first 4096 values)."""
  h = hashlib.sha1()
  for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    x = np.ascontiguousarray(np.asarray(jnp.ravel(leaf)[:4096]))
    h.update(f"{jax.tree_util.keystr(kp)} {np.shape(leaf)} {x.dtype}".encode() + x.tobytes())
  cfg = hashlib.sha1((Path(path) / "config.json").read_bytes()).hexdigest()[:16]
  return {"path": str(Path(path).resolve()), "config_hash": cfg, "weights_hash": h.hexdigest()[:16]}


class Policies:
  """The saved policy sequence; ``get(i)`` restores policy i (all kept when they fit in 4 GiB)."""

  def __init__(self, ckpt: Checkpointer, steps: list[int], like, metas: dict):
    self.ckpt, self.steps, self.like, self.metas, self._cache = ckpt, steps, like, metas, {}

  def get(self, i: int):
    if self.steps[i] not in self._cache:
      if sum(x.nbytes for x in jax.tree.leaves(self.like)) * len(self.steps) >= 4 * 2 ** 30:
        self._cache.clear()
      self._cache[self.steps[i]] = self.ckpt.restore(self.steps[i], like=self.like)[0]
    return self._cache[self.steps[i]]

  def frozen(self) -> Policies:
    """As many policies, every one the first (--no-drift)."""
    return Policies(self.ckpt, [self.steps[0]] * len(self.steps), self.like, self.metas)


def ensure_policies(a, config, params, tok, ident) -> Policies:
  """The policy sequence of --policies: reused when complete, resumed when interrupted, else made
  by a GRPO run. Refuses (exit 2) checkpoints of other parameters, models or settings."""
  want, settings, like = policy_steps(a), grpo_settings(a), jax.tree.map(jnp.asarray, params)
  bad = functools.partial(cli.fail, "--policies", a.policies)
  try:
    ck = Checkpointer(Path(a.policies), max_to_keep=None, async_save=False)
    have = ck.all_steps()
    for s in sorted({have[0], have[-1]}) if have else []:
      ck.restore(s, like=like)
  except Exception as e:  # noqa: BLE001 (a foreign folder: one line, exit 2)
    bad(f"cannot be read, or holds checkpoints that do not match the model {ident['path']}: "
        f"{one_line(e)[:400]}")
  metas = {s: ck.restore_meta(s) for s in have}
  for s, m in metas.items():
    mm = m.get("model") or {}
    if [mm.get("config_hash"), mm.get("weights_hash")] != [ident["config_hash"],
                                                           ident["weights_hash"]]:
      bad(f"step {s} was saved from another model ({mm.get('path')}), not {ident['path']}")
    if m.get("grpo") != settings or s not in want:
      bad(f"step {s} has other GRPO settings ({m.get('grpo')}); use another folder")
  if have == want:
    print(f"policies: reusing the {len(want)} saved policies in {a.policies}", flush=True)
  else:
    run_grpo(a, config, params, tok, ident, ck, have, want, metas)
  return Policies(ck, want, like, metas)


def run_grpo(a, config, params, tok, ident, ck, have, want, metas) -> None:
  from app.loop import Run, RunConfig
  from specroll_jax.grpo import GRPOConfig
  cfg = RunConfig(grpo=GRPOConfig(group_size=a.grpo_group, learning_rate=a.grpo_lr,
                                  warmup_steps=a.grpo_warmup,
                                  sampling=rollout.SamplingConfig(temperature=GRPO_TEMPERATURE)),
                  task=Task(name="synthetic", level=a.level), prompts_per_step=a.grpo_prompts,
                  max_new_tokens=a.grpo_max_new_tokens, steps=a.grpo_steps, seed=a.seed,
                  rollout="vanilla", vanilla_buckets=a.buckets and tuple(a.buckets))
  try:
    r = Run(cfg, config, params, tok, None, Path(a.policies) / "grpo", resume=bool(have),
            log=lambda m: print(f"GRPO: {m}", flush=True))
  except ValueError as e:
    cli.fail("--policies", a.policies, one_line(e))
  n = r.next_step  # updates done
  if not {s for s in want if s < n} <= set(have) <= {s for s in want if s <= n}:
    r.close()
    cli.fail("--policies", a.policies, f"holds policies {have} that do not match its GRPO run "
             f"(next step {n}); remove the folder")
  print(f"policies: GRPO, {a.grpo_prompts} x {a.grpo_group} per step, lr {a.grpo_lr}; saving "
        f"steps {want} into {a.policies}" + f" (resumed at step {n})" * bool(have), flush=True)

  def save(s, state, rec):
    keys = ("reward_mean", "accuracy", "groups_mixed", "entropy", "mean_length", "grad_norm")
    metas[s] = {"step": s, "model": ident, "grpo": grpo_settings(a),
                "metrics": rec and {k: getattr(rec, k) for k in keys}}
    ck.save(s, state, metas[s])

  for s, state in ((0, params), (n, r.local_params())):
    if s in want and s not in metas:  # step 0, or the step an interruption left unsaved
      save(s, state, None)
  for _ in progress_range(cfg.steps - n, "GRPO steps"):
    rec = r.step()  # an app.trainer.StepMetrics
    if rec.step + 1 in want:
      save(rec.step + 1, r.local_params(), rec)
  r.close()


# -- Drift of the policies along a batch


@functools.partial(jax.jit, static_argnames=("config", "sampling"))
def policy_scores(params, ref, prompts, prompt_lengths, tokens, lengths, *, config, sampling):
  """Mean next-token entropy of ``params`` and mean KL(params || ref) over the response tokens
  (the sampling rule's distributions, teacher forced as the trainer does)."""
  def logp(p):
    h = trainer_hidden(config, p, prompts, prompt_lengths, tokens, lengths)
    return jax.nn.log_softmax(allowed_logits(_dec.logits_from_hidden(config, p, h), sampling), -1)

  lp, lq = logp(params), logp(ref)
  pr = jnp.exp(lp)
  live = (jnp.arange(tokens.shape[1])[None] < lengths[:, None])
  on = live[..., None] & (pr > 0)
  mean = lambda x: jnp.where(on, x, 0.0).sum() / jnp.maximum(live.sum(), 1)
  return mean(-pr * lp), mean(pr * (lp - lq))


def param_change(params, ref) -> float:
  """||params - ref|| / ||ref|| over every leaf."""
  f64 = lambda t: [np.asarray(x, np.float64) for x in jax.tree.leaves(t)]
  num = sum(((x - y) ** 2).sum() for x, y in zip(f64(params), f64(ref), strict=True))
  return float(np.sqrt(num / max(sum((y ** 2).sum() for y in f64(ref)), 1e-30)))


# -- The ceiling: heads refitted on each policy


def commit(tree):
  """``tree`` committed to the first device, like the restored policies: a jitted call whose
  arguments change from uncommitted to committed compiles again."""
  return jax.device_put(tree, jax.devices()[0])


def fit_ceilings(a, config, policies, tok, task, sampling, heads0, batches: int):
  """(heads, fit seconds, final per-head soft CE) per batch: heads fitted from scratch on policy
  b's own rollouts of *train* prompts, every --ceiling-every-th policy (reused in between); cached
  in --policies/ceiling, keyed by every setting the fit reads (a rerun reports the first fit's
  seconds)."""
  heads, secs, ce = [], [], []
  for b in progress_range(batches, f"ceiling: fit heads on policies' own rollouts "
                                     f"({a.ceiling_prompts} prompts, {a.ceiling_steps} steps)"):
    if b % a.ceiling_every:
      heads, secs, ce = [*heads, heads[-1]], [*secs, 0.0], [*ce, ce[-1]]
      continue
    step = policies.steps[b]
    what = {"step": step, "model": policies.metas[step].get("model"), "grpo": grpo_settings(a),
            "prompts": a.ceiling_prompts, "fit_steps": a.ceiling_steps, "seed": a.seed,
            "max_new_tokens": a.max_new_tokens, "sampling": repr(sampling), "level": a.level,
            "num_heads": heads0.num_heads, "width": heads0.width,
            **({} if a.buckets is None else {"buckets": list(a.buckets)})}
    key = hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
    file = Path(a.policies) / "ceiling" / f"step{step:05d}_{key}.safetensors"
    side = file.with_suffix(".json")
    if file.exists() and side.exists():
      info, hd = json.loads(side.read_text()), CH.load(file)
    else:
      t0, params = time.perf_counter(), policies.get(b)
      toks, lens, hid = pipeline.self_rollouts(
          config, params, tok, num_prompts=a.ceiling_prompts, max_new_tokens=a.max_new_tokens,
          sampling=sampling, seed=a.seed + 1, chunk=64, task=task,
          bucket_fractions=a.buckets and tuple(a.buckets))
      hd = CH.init(jax.random.key(a.seed + 1234), config, heads0.num_heads, width=heads0.width)
      hd, hist = CH.fit(config, params, hd, toks, lens, hid, sampling=sampling,
                        steps=a.ceiling_steps, progress=False)
      info = {"fit_seconds": time.perf_counter() - t0,
              "final_soft_ce": np.asarray(hist[-1]).tolist()}
      file.parent.mkdir(parents=True, exist_ok=True)
      CH.save(file, hd)
      side.with_suffix(".tmp").write_text(json.dumps(info))
      side.with_suffix(".tmp").replace(side)
    heads, secs, ce = [*heads, commit(hd)], [*secs, info["fit_seconds"]], [
        *ce, info["final_soft_ce"]]
  return heads, secs, ce
