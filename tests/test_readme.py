"""The README's python blocks run as written on the embedded model: the custom loop gives the
vanilla engine's tokens at every step and compiles nothing after its first step (the object
compiles every program it can run there; parameters leaving the train step replicated over its
mesh do not recompile the rollout), and the engine block gives the same tokens inside a user's
jit."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from specroll_jax import rollout
from specroll_jax.specroll import SpecRoll

README = Path(__file__).resolve().parents[1] / "README.md"


def loop_block(section: str = "## A custom JAX RL loop") -> tuple[int, str]:
  """(first line, source) of the python block under ``section``."""
  text = README.read_text()
  head = text.index(section)
  m = re.compile(r"^```python\n(.*?)^```", re.M | re.S).search(text, head)
  return text.count("\n", 0, m.start(1)) + 1, m.group(1)


@pytest.mark.slow  # the embedded model's first batch compiles every program: minutes
def test_readme_loop_runs_exactly_with_no_recompile(monkeypatch, tmp_path):
  monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))  # the cost model is measured here
  line, src = loop_block()
  code = [x for x in src.splitlines() if x.strip()]
  assert len(code) <= 15, f"the README loop has {len(code)} lines"
  compiles, calls, outs = [], [], []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, d, **kw: compiles.append(len(calls)) if event.endswith(
          "backend_compile_duration") else None)
  generate = SpecRoll.generate

  def spy(self, params, batch, state, *, seed=0):
    calls.append(seed)
    out, report, new = generate(self, params, batch, state, seed=seed)
    outs.append((self, jax.device_get(params), batch, seed, out, report))
    return out, report, new

  monkeypatch.setattr(SpecRoll, "generate", spy)
  ns = {"__name__": "readme_loop"}
  exec(compile("\n" * (line - 1) + src, str(README), "exec"), ns)
  assert calls == [0, 1, 2, 3]
  # nothing compiled from the second batch on: programs, train step, records, slow path
  assert [c for c in compiles if c >= 2] == [], compiles
  assert ns["report"].compile_seconds == 0.0 and outs[0][5].compile_seconds > 0
  for sr, params, batch, seed, out, _ in outs:  # the vanilla tokens, step by step
    van = rollout.generate(sr.config, params, batch.tokens, prompt_lengths=batch.lengths,
                           sample_ids=batch.sample_ids, max_new_tokens=sr.max_new_tokens,
                           seed=seed, sampling=sr.sampling, eos_ids=sr.eos_ids,
                           options=rollout.DecodeOptions(cache_length=batch.cache_length))
    assert (np.asarray(out.tokens) == np.asarray(van.tokens)).all()
  assert np.isfinite(float(ns["metrics"].loss))


def test_readme_engine_block_runs_inside_a_user_jit():
  """The README's engine block (the one way to roll out inside a caller's own jit) runs as
  written: the speculative engine and the vanilla engine in one user program give the same
  tokens, the speculative one in fewer forwards."""
  line, src = loop_block("## Inside your own jit: the engines")
  ns = {"__name__": "readme_engines"}
  exec(compile("\n" * (line - 1) + src, str(README), "exec"), ns)
  out, ref = ns["out"], ns["ref"]
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
  assert int(out.stats.target_forwards) <= int(ref.stats.target_forwards)
