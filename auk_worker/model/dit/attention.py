"""The DiT's attention: per-head RMSNorm and rotary positions on q and k, then attention over the visible keys.

Where a context hides keys (batch or bucket padding, a masked reference frame), the attention either takes the
boolean mask (SDPA, as upstream does) or, with the DiT's ``varlen_attention`` kernel, runs over each row's
visible keys put first (``VisibleKeys``, built once in ``prepare``); both attend over the same keys. With the
``attention_inputs`` kernel, q, k and v go from the qkv projection to the attention's input in one call (q and k
normed and rotated, the double blocks' two streams straight into the joint sequence, k and v straight into the
visible-first order).

Shapes: bc rows, m positions, h heads, dh head width, na audio positions, nt text tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from auk_worker.model.dit.config import AttentionInputs, JointLayout, Rope, SingleLayout, VisibleKeys
from auk_worker.model.dit.layers import apply_rope


def attend(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, visible_keys: VisibleKeys | None,
    keys_in_order: bool = False, split: int | None = None, first: int = 0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of q, k, v [bc, m, h, dh] over the keys ``key_mask`` [bc, 1, 1, m] lets through (None = all);
    returns [bc, m, h*dh]. With ``visible_keys`` (the same mask, reordered) its variable-length kernel runs
    instead of a masked one: the same sum over the same keys, on the [bc * m, h, dh] layout the projections
    already have (no transposes). ``keys_in_order``: k and v already come in ``visible_keys``' order.

    With ``split`` it returns the first ``split`` positions and the rest as two parts, [bc, split, h*dh] and
    [bc, m - split, h*dh]; the hand-written kernel writes each part contiguous, so that each goes into its own
    output projection as one plain matrix (a strided part would cost the audio stream's projection a slower
    product and a separate bias add).

    With ``first`` only the queries from position ``first`` on are attended, over the same keys: [bc, m - first,
    h*dh]. SDPA and the hand-written kernel compute only those; FlashAttention's attends every query."""
    bc, m, h, dh = q.shape
    if visible_keys is None:
        q, k, v = (t.transpose(1, 2) for t in (q[:, first:], k, v))  # [bc, h, m (q: m - first), dh] views
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask).transpose(1, 2).flatten(2)
    else:
        if not keys_in_order:
            order = visible_keys.order[:, :, None, None].expand(bc, m, h, dh)
            k, v = k.gather(1, order), v.gather(1, order)
        q, k, v = (t.reshape(bc * m, h, dh) for t in (q, k, v))
        starts, count = visible_keys.starts, visible_keys.count
        kernel = visible_keys.attention_kernel
        if kernel is not None and split is not None:  # the two parts, each written in one piece
            out = kernel(q, k, v, starts, count, m, split=split)
            return out[: bc * split].view(bc, split, h * dh), out[bc * split :].view(bc, m - split, h * dh)
        if kernel is not None and first:
            out = kernel(q, k, v, starts, count, m, first=first)
            return out.view(bc, m - first, h * dh)
        kernel = visible_keys.varlen_attention if kernel is None else kernel
        out = kernel(q, k, v, starts, count, m).reshape(bc, m, h * dh)[:, first:]
    return out if split is None else (out[:, :split], out[:, split:])



class Attention(nn.Module):
    """Self-attention with per-head RMSNorm (torch's default eps) on q and k, then rotary positions. Holds the
    weights; the block runs the qkv and output projections as parts of its phases (:class:`BlockPhases`)."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head)
        self.q_norm = nn.RMSNorm(dim_head, elementwise_affine=True)
        self.k_norm = nn.RMSNorm(dim_head, elementwise_affine=True)
        self.to_out = nn.ModuleList([nn.Linear(heads * dim_head, dim)])  # named `to_out.0` in the release

    def _project(self, qkv: Tensor, q_norm: nn.Module, k_norm: nn.Module, rope: Rope) -> tuple[Tensor, ...]:
        q, k, v = (part.unflatten(-1, (self.heads, self.dim_head)) for part in qkv.chunk(3, dim=-1))
        # q, k, v: [bc, m, h*dh] -> [bc, m, h, dh]
        return apply_rope(q_norm(q), rope), apply_rope(k_norm(k), rope), v

    def _fused_attention(
        self,
        kernel: AttentionInputs,
        streams: list[tuple[Tensor, nn.RMSNorm, nn.RMSNorm, Rope]],
        key_mask: Tensor | None,
        visible_keys: VisibleKeys | None,
        first: int = 0,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attention over the (qkv, q_norm, k_norm, rope) streams joined along the sequence, their q, k, v made by
        the attention-inputs ``kernel`` (k and v straight into ``visible_keys``' order): [bc, sum m, h*dh], or with
        two streams the output of each ([bc, m_i, h*dh], see ``attend``'s ``split``); ``first`` as ``attend``'s."""
        eps = self.q_norm.eps if self.q_norm.eps is not None else torch.finfo(torch.float32).eps  # torch's default
        slot = None if visible_keys is None else visible_keys.slot
        q, k, v = kernel(
            [(qkv, q_norm.weight, k_norm.weight, rope.cos, rope.sin) for qkv, q_norm, k_norm, rope in streams],
            self.heads, eps, slot,
        )
        split = streams[0][0].shape[1] if len(streams) == 2 else None
        return attend(q, k, v, key_mask, visible_keys, keys_in_order=True, split=split, first=first)

    def attend_qkv(self, qkv: Tensor, layout: SingleLayout, first: int = 0) -> Tensor:
        """The attention from the qkv projection [bc, m, 3*h*dh] to the output projection's input [bc, m, h*dh];
        ``first``: only the queries from that position on, [bc, m - first, h*dh] (keys from every position)."""
        if layout.attention_inputs is not None:
            return self._fused_attention(layout.attention_inputs, [(qkv, self.q_norm, self.k_norm, layout.rope)],
                                         layout.key_mask, layout.visible_keys, first)
        q, k, v = self._project(qkv, self.q_norm, self.k_norm, layout.rope)
        return attend(q, k, v, layout.key_mask, layout.visible_keys, first=first)


class JointAttention(Attention):
    """Audio (x) and text (c) keep their own projections and norms, and attend together as [audio, text]."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__(dim, heads, dim_head)
        self.to_qkv_c = nn.Linear(dim, 3 * heads * dim_head)
        self.c_q_norm = nn.RMSNorm(dim_head, elementwise_affine=True)
        self.c_k_norm = nn.RMSNorm(dim_head, elementwise_affine=True)
        self.to_out_c = nn.Linear(heads * dim_head, dim)

    def attend_streams(self, qkv: Tensor, qkv_c: Tensor, layout: JointLayout) -> tuple[Tensor, Tensor]:
        """The joint attention from the two streams' qkv projections ([bc, na, 3*h*dh], [bc, nt, 3*h*dh]) to the
        output projections' inputs, audio [bc, na, h*dh] and text [bc, nt, h*dh], over the joint sequence (audio
        positions first). Padded rows are zeroed by the block (layout.audio_keep, text_keep)."""
        if layout.attention_inputs is not None:  # both streams written straight into the joint sequence
            streams = [(qkv, self.q_norm, self.k_norm, layout.rope_audio),
                       (qkv_c, self.c_q_norm, self.c_k_norm, layout.rope_text)]  # fmt: skip
            return self._fused_attention(layout.attention_inputs, streams, layout.key_mask, layout.visible_keys)
        q, k, v = self._project(qkv, self.q_norm, self.k_norm, layout.rope_audio)
        cq, ck, cv = self._project(qkv_c, self.c_q_norm, self.c_k_norm, layout.rope_text)
        q, k, v = (torch.cat(pair, dim=1) for pair in ((q, cq), (k, ck), (v, cv)))  # [bc, na + nt, h, dh]
        return attend(q, k, v, layout.key_mask, layout.visible_keys, split=qkv.shape[1])
