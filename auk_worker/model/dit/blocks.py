"""The DiT's blocks: double-stream (MMDiT) blocks over [audio, text] and single-stream blocks over the whole sequence.

A block runs in three phases per stream (``BlockPhases``): the way into the attention (adaptive norm, qkv
projection), the attention, and the way out (output projection and gated residual, then the feed-forward). The
pipeline's wiring compiles the streams' phases once for every block, and may run a double block's text stream
on a second CUDA stream beside its audio stream.

Shapes: bc rows, m positions, d model width, h heads, dh head width, na audio positions, nt text tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from auk_worker.model.dit.attention import Attention, JointAttention
from auk_worker.model.dit.config import DiTConfig, GatedResidualNorm, JointLayout, ModulatedNorm, SingleLayout
from auk_worker.model.dit.layers import AdaLayerNorm, FeedForward, gated_residual_norm, modulated_norm
from auk_worker.model.streams import beside, join


def block_inputs(h: Tensor, shift: Tensor, scale: Tensor, to_qkv: nn.Module, norm: ModulatedNorm | None) -> Tensor:
    """One stream's way into a block's attention: its adaptive norm (by the ``norm`` kernel; None: torch ops),
    then the qkv projection. [bc, m, d] -> [bc, m, 3*h*dh]."""
    return to_qkv(modulated_norm(h, shift, scale, norm))


def block_outputs(
    h: Tensor, attended: Tensor, to_out: nn.Module, gate: Tensor, keep: Tensor | None, shift_ff: Tensor,
    scale_ff: Tensor, ff: nn.Module, gate_ff: Tensor, norm: GatedResidualNorm | None,
) -> Tensor:
    """One stream's way out of a block: the attention's output projection into the residual stream through its
    gate (zeroed at the rows ``keep`` drops), then the feed-forward through its own norm and gate (the residual
    and that norm by the ``norm`` kernel; None: torch ops). [bc, m, d]."""
    h, normed = gated_residual_norm(h, to_out(attended), gate, keep, shift_ff, scale_ff, norm)
    return h + gate_ff * ff(normed)


@dataclass(frozen=True)
class BlockPhases:
    """What a block runs, in three phases per stream: the way into the attention, the attention, the way out.
    The wiring swaps in compiled phases (``compile_dit_blocks``). Split this way, a double block's text stream can
    run its phases on a second CUDA stream, beside the audio stream's (``AuKDiT.text_stream``)."""

    inputs: Callable[..., Tensor] = block_inputs
    attention: Callable[..., Tensor] = Attention.attend_qkv  # (attn, qkv, layout, first)
    joint_attention: Callable[..., tuple[Tensor, Tensor]] = JointAttention.attend_streams  # (attn, qkv, qkv_c, layout)
    outputs: Callable[..., Tensor] = block_outputs

    def compiled(self, **options: Any) -> BlockPhases:
        """The streams' phases (``inputs``, ``outputs``) through ``torch.compile(phase, **options)``. The attention
        phases stay as they are: on the fast path they are the hand-written kernels already (see bench/RESULTS.md
        on what compiling them cost)."""
        return replace(self, inputs=torch.compile(self.inputs, **options), outputs=torch.compile(self.outputs, **options))


PLAIN_PHASES = BlockPhases()


class DoubleStreamBlock(nn.Module):
    """MMDiT block: separate modulation and feed-forward per stream, one joint attention."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.attn_norm_c = AdaLayerNorm(config.dim)
        self.attn_norm_x = AdaLayerNorm(config.dim)
        self.attn = JointAttention(config.dim, config.heads, config.dim_head)
        self.ff_c = FeedForward(config.dim, config.ff_inner_dim)
        self.ff_x = FeedForward(config.dim, config.ff_inner_dim)

    def forward(
        self,
        x: Tensor,
        c: Tensor,
        modulation: tuple[Tensor, Tensor],
        layout: JointLayout,
        phases: BlockPhases = PLAIN_PHASES,
        text_stream: torch.cuda.Stream | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``text_stream``: the text stream's phases run there, beside the audio stream's (None: one after the
        other on the current stream). Each stream's arithmetic is the same either way."""
        x_mod, c_mod = modulation  # [r, 6d] each, r = 1 or bc
        x_shift, x_scale, x_gate, x_shift_ff, x_scale_ff, x_gate_ff = self.attn_norm_x(x_mod)
        c_shift, c_scale, c_gate, c_shift_ff, c_scale_ff, c_gate_ff = self.attn_norm_c(c_mod)
        attn, norm, residual_norm = self.attn, layout.modulated_norm, layout.gated_residual_norm
        with beside(text_stream):
            qkv_c = phases.inputs(c, c_shift, c_scale, attn.to_qkv_c, norm)
        qkv = phases.inputs(x, x_shift, x_scale, attn.to_qkv, norm)
        join(text_stream)
        out_x, out_c = phases.joint_attention(attn, qkv, qkv_c, layout)  # [bc, na, h*dh], [bc, nt, h*dh]
        with beside(text_stream):
            c = phases.outputs(c, out_c, attn.to_out_c, c_gate, layout.text_keep, c_shift_ff, c_scale_ff, self.ff_c,
                               c_gate_ff, residual_norm)
        x = phases.outputs(x, out_x, attn.to_out[0], x_gate, layout.audio_keep, x_shift_ff, x_scale_ff, self.ff_x,
                           x_gate_ff, residual_norm)
        join(text_stream)
        return x, c


class SingleStreamBlock(nn.Module):
    """DiT block over the whole [text | ref | target] sequence."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNorm(config.dim)
        self.attn = Attention(config.dim, config.heads, config.dim_head)
        self.ff = FeedForward(config.dim, config.ff_inner_dim)

    def forward(
        self, h: Tensor, modulation: Tensor, layout: SingleLayout, phases: BlockPhases = PLAIN_PHASES,
        target: int | None = None,
    ) -> Tensor:  # modulation [r, 6d]
        """``target``: only the last ``target`` positions come out, [bc, target, d], their queries over the keys
        and values of every position. The DiT's last block runs so: only the target is projected to latents, so
        the rest of its queries, output projection and feed-forward would be thrown away."""
        shift, scale, gate, shift_ff, scale_ff, gate_ff = self.attn_norm(modulation)
        attn = self.attn
        qkv = phases.inputs(h, shift, scale, attn.to_qkv, layout.modulated_norm)
        keep = layout.keep
        if target is None:
            out = phases.attention(attn, qkv, layout)
        else:
            first = h.shape[1] - target
            out = phases.attention(attn, qkv, layout, first)
            # Contiguous, as every other block's input: the compiled phase then serves this block as well.
            h, keep = h[:, first:].contiguous(), layout.target_keep
        return phases.outputs(h, out, attn.to_out[0], gate, keep, shift_ff, scale_ff, self.ff, gate_ff,
                              layout.gated_residual_norm)
