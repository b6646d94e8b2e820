"""The decoder's hand-written kernels, each with an ``available`` probe: the anti-aliased activation (Triton, and
CUDA C++ built with NVRTC), the narrow causal convolutions, the causal upsamplers."""
