"""The DiT's hand-written kernels, each with its torch reference and an ``available`` probe: variable-length
attention, the attention's inputs, the modulated norms, the position convolutions."""
