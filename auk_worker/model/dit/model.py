"""Stage 1 backbone: the AuK DiT ("Flux2Edit"), a Flux-style MMDiT that predicts flow velocities over VAE latents.

Follows the upstream backbone as auk-model.md section 3 describes it: ``num_layers`` double-stream blocks attend
jointly over the audio stream ``[ref | target]`` and the text stream (concatenated in the order [audio, text]),
then ``num_single_layers`` single-stream blocks run over ``[text | ref | target]``; only the last ``n`` positions
(the target) are projected back to latent space. Parameter and buffer names are the upstream ones without the
``transformer.`` prefix, so a release checkpoint loads with ``load_state_dict(strict=True, assign=True)``.

Prepare once, step many: :meth:`AuKDiT.prepare` computes what is fixed for a request (projected text, embedded
reference, rotary tables, masks; the CFG rows) into a :class:`DiTContext`; :meth:`AuKDiT.forward` evaluates one
velocity for the noisy target. No state is cached on the module.

Precision: works with fp32 weights (exact) or bf16 weights without autocast.

Fast paths: the module is its plain torch form. Three slots, set by the pipeline's wiring, change how it runs and
not what it computes: ``kernels`` (a :class:`DiTKernels`: the hand-written kernels, None everywhere by default),
``phases`` (the blocks' phases, compiled on the GPU) and ``text_stream`` (the double blocks' second CUDA stream).

Shapes:
    b    requests (rows of the ODE state)
    bc   rows of a context: b, or 2b with CFG (cond rows 0..b-1, then uncond rows)
    n    target frames (padded)          np   reference frames (padded; 0 without a reference)
    na   audio positions, np + n         nt   text tokens (padded)
    ns   single-stream positions, nt + na
    d    model width   h  heads   dh  head width   l  latent channels   dt  text hidden width
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from auk_worker.errors import InputError
from auk_worker.model.dit.blocks import PLAIN_PHASES, DoubleStreamBlock, SingleStreamBlock
from auk_worker.model.dit.config import (
    DiTConfig,
    DiTContext,
    DiTKernels,
    JointLayout,
    Rope,
    SingleLayout,
    VisibleKeys,
)
from auk_worker.model.dit.layers import AdaLayerNormFinal, AudioEmbedding, RotaryEmbedding, TimestepEmbedding

Branch = Literal["both", "cond", "uncond"]  # which rows of a guided step a context holds


def _all_or_none(mask: Tensor) -> Tensor | None:
    """None when every entry is True: a full mask is numerically a no-op, and no mask keeps SDPA on fast kernels."""
    return None if bool(mask.all()) else mask



def _lengths(name: str, lens: Tensor | None, rows: int, full: int, lowest: int) -> Tensor:
    """Validate per-row lengths [rows] within [lowest, full]; None means every row is full. Returns them on the
    CPU (read there without a GPU sync when the caller passes host tensors, as the pipeline does)."""
    if lens is None:
        return torch.full((rows,), full, dtype=torch.long)
    lens = torch.as_tensor(lens).cpu()
    if lens.shape != (rows,) or lens.is_floating_point() or lens.dtype == torch.bool:
        raise InputError(f"{name} must be an integer tensor of shape [{rows}], got {tuple(lens.shape)} {lens.dtype}")
    lens = lens.long()
    if rows and (int(lens.min()) < lowest or int(lens.max()) > full):
        raise InputError(f"{name} must lie in [{lowest}, {full}], got {lens.tolist()}")
    return lens


def _positions(present: Tensor) -> Tensor:
    """Rank of each present item within its row (cumsum - 1); absent items take their neighbour's position."""
    return (present.long().cumsum(dim=1) - 1).clamp_min(0)


def _key_mask(visible: Tensor) -> Tensor | None:
    mask = _all_or_none(visible)
    return None if mask is None else mask[:, None, None, :]  # [bc, m] -> [bc, 1, 1, m]


def _visible_keys(key_mask: Tensor | None, kernels: DiTKernels, device: torch.device) -> VisibleKeys | None:
    """``key_mask`` [bc, 1, 1, m] as :class:`VisibleKeys` on ``device`` for the ``kernels``' variable-length
    attention (None without a mask, or without that kernel)."""
    if key_mask is None or kernels.varlen_attention is None:
        return None
    visible = key_mask[:, 0, 0, :]  # [bc, m]
    rows, m = visible.shape
    order = torch.argsort((~visible).to(torch.int8), dim=1, stable=True)  # built where the mask is, then moved
    return VisibleKeys(
        order=_to_device(order, device),
        slot=_to_device(torch.argsort(order, dim=1).to(torch.int32), device),
        count=_to_device(visible.sum(dim=1, dtype=torch.int32), device),
        starts=_to_device(torch.arange(rows + 1, dtype=torch.int32) * m, device),
        varlen_attention=kernels.varlen_attention,
        attention_kernel=kernels.attention_kernel,
    )


def _to_device(t: Tensor | None, device: torch.device) -> Tensor | None:
    """A host tensor copied to ``device`` without waiting for it (None stays None)."""
    return None if t is None else t.to(device, non_blocking=True)


def _keep(valid: Tensor) -> Tensor | None:
    keep = _all_or_none(valid)
    return None if keep is None else keep[..., None]  # [bc, m] -> [bc, m, 1]


class AuKDiT(nn.Module):
    """The AuK velocity model. Build on the meta device and load the release weights strictly."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        self.time_embed = TimestepEmbedding(config.dim)
        self.txt_proj = nn.Linear(config.text_hidden_dim, config.dim)
        self.txt_norm = nn.RMSNorm(config.dim, elementwise_affine=True)
        self.audio_embed = AudioEmbedding(config.latent_dim, config.dim)
        self.rotary_embed = RotaryEmbedding(config.dim_head)
        self.transformer_blocks = nn.ModuleList(DoubleStreamBlock(config) for _ in range(config.num_layers))
        self.single_transformer_blocks = nn.ModuleList(
            SingleStreamBlock(config) for _ in range(config.num_single_layers)
        )
        self.norm_out = AdaLayerNormFinal(config.dim)
        self.proj_out = nn.Linear(config.dim, config.latent_dim)
        # The fast-path slots (see the module docstring), all the torch form until the wiring sets them: the
        # hand-written kernels, the blocks' phases, and the CUDA stream the double blocks' text stream runs on
        # beside the audio stream (None: the current stream).
        self.kernels = DiTKernels()
        self.phases = PLAIN_PHASES
        self.text_stream: torch.cuda.Stream | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    def prepare(
        self,
        text: Tensor,
        text_lens: Tensor,
        ref: Tensor | None,
        ref_lens: Tensor | None,
        ref_valid_lens: Tensor | None,
        target_len: int,
        target_lens: Tensor | None = None,
        *,
        cfg: bool,
        branch: Branch = "both",
    ) -> DiTContext:
        """Compute the per-request context for a batch of ``b`` rows.

        text [b, nt, dt] fused condition, valid for the first ``text_lens`` tokens of each row.
        ref [b, np, l] normalised reference latents (or None / np == 0): the first ``ref_lens`` frames of a row take
        sequence positions, of which the first ``ref_valid_lens`` are visible to attention (an encoder's extra
        frame past floor(T/480) takes a position but is masked; None = all). ``target_len`` is the padded target
        length n, ``target_lens`` the valid frames per row (None = n). With ``cfg`` the rows are doubled into
        [cond..., uncond...]: uncond rows see zero projected text (same text mask) and a reference of zero latents.
        ``branch`` "cond" or "uncond" (with ``cfg``) builds only that half, ``b`` rows equal to the doubled
        context's rows of that branch: the two halves of a guided step computed on two devices.

        The lengths are read on the host: pass host tensors (as the pipeline does) and preparing never waits for
        the GPU. Positions count only the items a row holds, so a padded row gets the positions it would have
        alone. Batch padding is never visible as a key. Masked reference frames are hidden as keys when
        ``attn_mask_enabled``; with it off they stay visible, as upstream does for a single request.
        """
        config, device, dtype = self.config, self.device, self.dtype
        if text.ndim != 3 or text.shape[-1] != config.text_hidden_dim or text.shape[1] < 1:
            raise InputError(f"text must be [b, nt >= 1, {config.text_hidden_dim}], got {tuple(text.shape)}")
        rows, nt = text.shape[:2]
        if isinstance(target_len, bool) or not isinstance(target_len, int) or target_len < 1:
            raise InputError(f"target_len must be a positive integer, got {target_len!r}")
        if ref is not None and (ref.ndim != 3 or ref.shape[0] != rows or ref.shape[-1] != config.latent_dim):
            raise InputError(f"ref must be [{rows}, np, {config.latent_dim}], got {tuple(ref.shape)}")
        np_ = 0 if ref is None else ref.shape[1]
        if branch not in ("both", "cond", "uncond"):
            raise InputError(f"branch must be both, cond or uncond, got {branch!r}")
        if branch != "both" and not cfg:
            raise InputError(f"branch {branch!r} is a half of a guided step: it needs cfg=True")
        doubled = cfg and branch == "both"

        # The masks are built on the host from host lengths and moved once, so preparing never waits for the GPU.
        text_valid = torch.arange(nt) < _lengths("text_lens", text_lens, rows, nt, 1)[:, None]  # [b, nt]
        target_valid = torch.arange(target_len) < _lengths("target_lens", target_lens, rows, target_len, 1)[:, None]
        ref_lens = _lengths("ref_lens", ref_lens, rows, np_, 0)
        ref_valid_lens = ref_lens if ref_valid_lens is None else _lengths("ref_valid_lens", ref_valid_lens, rows, np_, 0)
        if bool((ref_valid_lens > ref_lens).any()):
            raise InputError("ref_valid_lens must not exceed ref_lens")
        ref_present = torch.arange(np_) < ref_lens[:, None]  # [b, np]
        ref_valid = torch.arange(np_) < ref_valid_lens[:, None]  # [b, np]

        kernels = self.kernels
        if kernels.position_conv is not None:
            self.audio_embed.conv_pos_embed.packed_weights()  # here, not in a step graph's capture
        c = self.txt_norm(self.txt_proj(text.to(device=device, dtype=dtype)))  # [b, nt, d]
        ref_embed = None
        ref_conv_mask = _to_device(_all_or_none(ref_valid), device)
        if np_ > 0:
            ref = ref.to(device=device, dtype=dtype)
            ref_embed = self.audio_embed(ref if branch != "uncond" else torch.zeros_like(ref), ref_conv_mask,
                                         kernels.position_conv)  # [b, np, d]  # fmt: skip

        def branches(cond: Tensor, uncond: Tensor) -> Tensor:
            return torch.cat((cond, uncond), dim=0) if doubled else cond

        if branch == "uncond":
            c = torch.zeros_like(c)  # uncond text is zeroed after txt_proj + txt_norm
        c = branches(c, torch.zeros_like(c))
        if ref_embed is not None and doubled:  # embedded only for CFG's uncond rows
            uncond = self.audio_embed(torch.zeros_like(ref), ref_conv_mask, kernels.position_conv)
            ref_embed = branches(ref_embed, uncond)
        text_valid, ref_present, ref_valid, target_present = (
            branches(mask, mask) for mask in (text_valid, ref_present, ref_valid, target_valid)
        )

        audio_present = torch.cat((ref_present, target_present), dim=1)  # [bc, na]
        audio_valid = torch.cat((ref_valid, target_present), dim=1)
        audio_visible = audio_valid if config.attn_mask_enabled else audio_present
        single_present = torch.cat((text_valid, audio_present), dim=1)  # [bc, ns]

        def rope(present: Tensor) -> Rope:
            return self.rotary_embed.tables(_to_device(_positions(present), device))

        joint_mask = _key_mask(torch.cat((audio_visible, text_valid), dim=1))
        single_mask = _key_mask(torch.cat((text_valid, audio_visible), dim=1))
        joint = JointLayout(
            rope_audio=rope(audio_present),
            rope_text=rope(text_valid),
            key_mask=_to_device(joint_mask, device),
            visible_keys=_visible_keys(joint_mask, kernels, device),
            audio_keep=_to_device(_keep(audio_valid), device),
            text_keep=_to_device(_keep(text_valid), device),
            attention_inputs=kernels.attention_inputs,
            modulated_norm=kernels.modulated_norm,
            gated_residual_norm=kernels.gated_residual_norm,
        )
        single = SingleLayout(
            rope=rope(single_present),
            key_mask=_to_device(single_mask, device),
            visible_keys=_visible_keys(single_mask, kernels, device),
            keep=_to_device(_keep(torch.cat((text_valid, audio_valid), dim=1)), device),
            target_keep=_to_device(_keep(target_present), device),
            attention_inputs=kernels.attention_inputs,
            modulated_norm=kernels.modulated_norm,
            gated_residual_norm=kernels.gated_residual_norm,
        )
        return DiTContext(
            cfg=doubled,
            text=c,
            ref=ref_embed,
            target_mask=_to_device(_all_or_none(target_valid), device),
            target_len=target_len,
            joint=joint,
            single=single,
            position_conv=kernels.position_conv,
        )

    def _modulation_layers(self) -> list[nn.Module]:
        """Every adaLN layer in the order their rows are laid out in :meth:`modulation`."""
        layers: list[nn.Module] = []
        for block in self.transformer_blocks:
            layers += [block.attn_norm_x, block.attn_norm_c]
        layers += [block.attn_norm for block in self.single_transformer_blocks]
        return [*layers, self.norm_out]

    @property
    def modulation_widths(self) -> list[int]:
        """Width of each adaLN layer's part of a :meth:`modulation` row, in layout order."""
        return [layer.linear.out_features for layer in self._modulation_layers()]

    def modulation(self, t: Tensor) -> Tensor:
        """Every adaLN linear's output at times ``t`` [s]: the modulation rows [s, width], laid out block by
        block (double blocks' audio then text, single blocks, the final norm).

        They depend on t alone, so a sampler can compute them for a whole time grid once per render
        (``forward(..., modulation=rows[i : i + 1])``) rather than re-reading every modulation weight each step."""
        act = F.silu(self.time_embed(t))  # [s, d]
        return torch.cat([layer.linear(act) for layer in self._modulation_layers()], dim=1)

    def forward(self, x: Tensor, t: Tensor | float, ctx: DiTContext, modulation: Tensor | None = None) -> Tensor:
        """Velocity for every context row: x [b, n, l] noisy target (the ODE state, NOT doubled for CFG),
        t a 0-d or [b] time in [0, 1]. Returns [bc, n, l] in the weight dtype, cond rows then uncond rows.

        ``modulation`` [1, width] is ``self.modulation(t[None])`` computed ahead (every row at the same t); when
        None it is computed here, per row. The target is embedded once and shared by both CFG branches."""
        b = ctx.batch
        if x.shape != (b, ctx.target_len, self.config.latent_dim):
            raise InputError(f"x must be [{b}, {ctx.target_len}, {self.config.latent_dim}], got {tuple(x.shape)}")
        if modulation is None:
            t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
            t = t.expand(b) if t.ndim == 0 else t
            if t.shape != (b,):
                raise InputError(f"t must be a scalar or of shape [{b}], got {tuple(t.shape)}")
            modulation = self.modulation(t)  # [b, width]
            if ctx.cfg:
                modulation = modulation.repeat(2, 1)  # [2b, width]: cond rows, then uncond rows
        rows = iter(modulation.split(self.modulation_widths, dim=1))  # one [r, width_i] per adaLN layer, in layout order

        target = self.audio_embed(x.to(self.dtype), ctx.target_mask, ctx.position_conv)  # [b, n, d]
        if ctx.cfg:
            target = target.repeat(2, 1, 1)  # [2b, n, d]: cond rows, then uncond rows
        audio = target if ctx.ref is None else torch.cat((ctx.ref, target), dim=1)  # [bc, na, d]
        text = ctx.text  # [bc, nt, d]

        for block in self.transformer_blocks:
            audio, text = block(audio, text, (next(rows), next(rows)), ctx.joint, self.phases, self.text_stream)
        h = torch.cat((text, audio), dim=1)  # [bc, ns, d]
        *blocks, last = self.single_transformer_blocks or [None]
        for block in blocks:
            h = block(h, next(rows), ctx.single, self.phases)
        # Only the target, the last n positions, is projected to latents: the last block computes only those.
        n = ctx.target_len
        h = h[:, -n:] if last is None else last(h, next(rows), ctx.single, self.phases, target=n)  # [bc, n, d]
        return self.proj_out(self.norm_out(h, next(rows), ctx.single.modulated_norm))  # [bc, n, l]
