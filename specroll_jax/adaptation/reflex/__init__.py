"""Reflex: the gradient-free fast path over the future-token heads (docs/design.md, "Reflex").

Per (row, head k) a fast state m (hidden-sized, f32) turns delayed verifier feedback into a
bounded correction of head k's output hidden state before the shared final norm and unembedding:

    h_k' = h_k + c,   c = r * rms(h_k) * m / rms(m),
    r = safety_k * (r_min,k + (r_max,k - r_min,k) * trust),   so rms(c) <= safety_k r_max,k rms(h_k)

applied only when a conservative alignment gate says past errors predict future ones: on feedback
rounds each head records its prediction (keyed by the target position it predicts, in a ring of
K + 2 slots), and when that position is committed the record matures into a feedback vector g (in
closed form from unembedding rows: no backprop) and one observation of the cosine between the
state's sketch at proposal time and g's sketch. trust and eligibility come from the running lower
confidence bound (LCB) of those cosines (Welford / Chan), the observation count, the accumulated
severity and the state's size. Everything is static-shaped and runs inside the jitted decode loop;
a proposer can only change speed, never the committed tokens. Steps where no row records skip
building records, and steps where no record matures skip the feedback math (``lax.cond``, the
results unchanged); ``ReflexConfig.stride`` > 1 makes feedback rounds rarer where rows are few.

Between rollout batches, ``end_batch`` updates each head's global safety factor from the free
counterfactual (target mass captured by the corrected vs the raw head's candidates).

Modules: ``config`` (``ReflexConfig``), ``state`` (the state structs), ``statistics`` (gate, LCB,
Welford merges, the global safety update, the host summary), ``feedback`` (closed-form feedback
of matured records). The proposer itself is ``specroll_jax.proposers.ReflexProposer``.
"""

from specroll_jax.adaptation.reflex.config import ReflexConfig
from specroll_jax.adaptation.reflex.feedback import Matured, feedback
from specroll_jax.adaptation.reflex.state import (
  FastState,
  Pending,
  ReflexGlobal,
  ReflexRows,
  ReflexShared,
  init_global,
)
from specroll_jax.adaptation.reflex.statistics import (
  ReflexStats,
  ReflexSummary,
  corrected_head_states,
  correction,
  end_batch,
  gate,
  lcb,
  summarize,
  welford_merge,
)

__all__ = ["FastState", "Matured", "Pending", "ReflexConfig", "ReflexGlobal", "ReflexProposer",
           "ReflexRows", "ReflexShared", "ReflexStats", "ReflexSummary", "corrected_head_states",
           "correction", "end_batch", "feedback", "gate", "init_global", "lcb", "summarize",
           "welford_merge"]


def __getattr__(name):
  # the proposer lives in specroll_jax.proposers (it imports this package's modules)
  if name == "ReflexProposer":
    from specroll_jax.proposers.reflex_heads import ReflexProposer
    return ReflexProposer
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
