"""SpecRoll as one object (``core.SpecRoll``): its carried types (``state``), the programs it
plans and compiles (``programs``), the fold of a batch into its state (``fold``) and its report
(``report``)."""

from specroll_jax.specroll.core import (
  BUDGETS,
  DEFAULT_COST_NODES,
  DEFAULT_REFLEX,
  SpecRoll,
)
from specroll_jax.specroll.report import SpecRollReport
from specroll_jax.specroll.state import (
  Mapped,
  Mode,
  Plan,
  ReflexMode,
  SpecRollState,
)

__all__ = ["BUDGETS", "DEFAULT_COST_NODES", "DEFAULT_REFLEX",
           "Mapped", "Mode", "Plan", "ReflexMode", "SpecRoll", "SpecRollReport", "SpecRollState"]
