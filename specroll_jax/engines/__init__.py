"""The engines: everything that turns prompts into the target's own samples.

``core``: the two engines as frozen objects (``VanillaEngine``, ``SpecEngine``) and the traced
prompt batch (``PromptBatch``); ``vanilla`` / ``speculative``: the traceable loops; ``verify``:
exact verification of a tree; ``buckets``: the row buckets both loops compact into;
``responses``: the commit rule; ``results``: what a rollout returns; ``config``: the static
settings (``DecodeSettings``, ``SpecConfig``); ``executables``: compiled programs held once.
"""

from specroll_jax.engines.core import PromptBatch, SpecEngine, VanillaEngine, check_seed

__all__ = ["PromptBatch", "SpecEngine", "VanillaEngine", "check_seed"]
