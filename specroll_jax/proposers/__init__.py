"""Proposers: what proposes each row's candidate tree (see ``base`` for the interface).

``HeadsProposer`` (static future-token heads), ``PromptLookup`` (n-gram copy from the row's own
prompt + response) and ``HeadsAndLookup`` (both merged into one tree).
"""

from specroll_jax.proposers.base import Feedback, ProposeInput, Proposer, RowsInit, Target
from specroll_jax.proposers.heads import HeadsProposer
from specroll_jax.proposers.lookup import HeadsAndLookup, LookupState, PromptLookup

__all__ = ["Feedback", "HeadsAndLookup", "HeadsProposer", "LookupState", "PromptLookup",
           "ProposeInput", "Proposer", "RowsInit", "Target"]
