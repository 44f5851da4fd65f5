"""Bridges from other JAX libraries to specroll-jax's engines.

Each integration lives in its own module and imports its library only there, so the package itself
needs none of them:

* ``specroll_jax.integrations.tunix``: ``SpecRollRollout``, a rollout engine for google/tunix's RL
  cluster (``ClusterConfig(rollout_engine=functools.partial(SpecRollRollout, ...))``); needs the
  ``tunix`` extra (``google-tunix``).
"""
