"""Future-token heads: Medusa heads (``medusa``: head k reads the anchor hidden state),
root-conditioned heads (``conditioned``: head k also reads the root and the path above it) and
the small interface both share (``kinds``)."""
