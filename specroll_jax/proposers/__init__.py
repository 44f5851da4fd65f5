"""Proposers: what proposes each row's candidate tree (``base`` holds the interface, ``Tree`` and
its rules are in ``specroll_jax.proposers.tree``; docs/design.md, "Proposers").

Fixed-shape proposers: ``HeadsProposer`` (static future-token heads) and ``PromptLookup`` (n-gram
copy from the row's own prompt + response; the group lookup's search on one segment). Ranked
proposers (``RankedProposer``: every candidate scored by its calibrated acceptance, the best kept
within the row's budget): ``RankedHeads`` (Medusa or root-conditioned heads, expanded depth by
depth), ``GroupLookup`` (the row's own text, its GRPO siblings' and earlier responses to the same
prompt) and ``Merged`` (both in one tree). ``ReflexProposer``: heads with Reflex corrections
(the math in ``specroll_jax.adaptation.reflex``); ``MergedReflex``: ``Merged`` with Reflex
corrections on its root-conditioned heads (what ``specroll_jax.SpecRoll`` proposes with by default).
"""

from specroll_jax.proposers.base import (
  Feedback,
  ProposeInput,
  Proposer,
  RowsInit,
  RowsShared,
  Target,
)
from specroll_jax.proposers.group_lookup import GroupLookup, LookupContext
from specroll_jax.proposers.lookup import LookupState, PromptLookup
from specroll_jax.proposers.merged import (
  Merged,
  MergedParams,
  MergedReflex,
  MergedReflexParams,
  MergedReflexStats,
)
from specroll_jax.proposers.ranked import RankedProposer, TreeStats
from specroll_jax.proposers.ranked_heads import HeadsParams, RankedHeads
from specroll_jax.proposers.reflex_heads import ReflexParams, ReflexProposer
from specroll_jax.proposers.static_heads import HeadsProposer
from specroll_jax.proposers.tree import Tree

__all__ = ["Feedback", "GroupLookup", "HeadsParams", "HeadsProposer", "LookupContext",
           "LookupState", "Merged", "MergedParams", "MergedReflex", "MergedReflexParams",
           "MergedReflexStats", "PromptLookup", "ProposeInput", "Proposer", "RankedHeads",
           "RankedProposer", "ReflexParams", "ReflexProposer", "RowsInit", "RowsShared", "Target",
           "Tree", "TreeStats"]
