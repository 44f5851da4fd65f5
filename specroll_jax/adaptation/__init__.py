"""What adapts between and within batches: Reflex (``reflex``: per-row corrections of the heads
inside the decode loop), the slow path (``slow_path``: refits of the heads on sustained
degradation), their records (``records``, ``trainer_records``), the acceptance tables measured
online (``calibration``), node budgets from measured cost (``goodput``) and earlier responses per
prompt (``store``). ``specroll_jax.SpecRoll`` carries their state."""
