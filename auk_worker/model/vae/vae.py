"""AuK's audio codec ("BigVGAN-flow" VAE): 24 kHz mono waveform <-> 50 Hz, 64-channel normalised latents.

Inference only. The encoder is a strided convolution stack with symmetric ("same") padding, emitting a
posterior mean and log-std per latent frame; the decoder is a BigVGAN generator that is causal everywhere
except ``conv_pre`` (centred) and the alias-free upsamplers (centred), and ends in a clamp, not a tanh. The
release also stores a residual coupling flow (``flow.*``); it only serves the training loss and is skipped.

Parameter and buffer names equal the release ``vae.safetensors`` keys, except that every convolution holds
one plain ``weight`` where the file holds the weight-norm pair ``weight_g`` / ``weight_v``: ``load_vae``
folds the pair on the target device (see there) and ``AuKVAE.release_state_dict`` writes it back out.

Shapes: ``b`` batch, ``t`` waveform samples (24 kHz), ``n`` latent frames (50 Hz, 480 samples each),
``d`` latent channels (64), ``c`` conv channels.

Fast paths: the modules are their plain torch form. Slots set by the pipeline's wiring change how they run, not
what they compute: each ``AliasFreeActivation``'s polyphase function (``alias_free.use_fused_activations``), the
narrow convolutions' and the upsamplers' kernels (:func:`use_conv_kernel`, :func:`use_upsample_kernel`), and the
decoder's branch streams (``AuKVAE.branch_streams``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from auk_worker.errors import AudioError, InputError
from auk_worker.model.streams import beside, join
from auk_worker.model.vae.alias_free import AliasFreeActivation
from auk_worker.model.vae.config import ENCODER_WIDTH, RELEASE_CONTEXT, VAEConfig, decoder_context, plan_tiles
from auk_worker.model.vae.kernels.narrow_conv import tap_major

TRAINING_ONLY_PREFIX = "flow."
# (x [b, c, reach + t], weight [kernel, out, in], bias, dilation, residual) -> [b, c, t]
CausalConv = Callable[..., torch.Tensor]
# (x [b, in, n], weight [in, out, 2 * stride], bias, stride) -> [b, out, n * stride]
CausalUpsample = Callable[..., torch.Tensor]


# ----------------------------------------------------------------------------------------------- layers


class PaddedConv1d(nn.Conv1d):
    """Stride-1 conv that keeps the length: centred zero padding, or ``causal`` zero padding on the left only."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, *, causal: bool, bias: bool = True):
        reach = dilation * (kernel - 1)
        super().__init__(cin, cout, kernel, dilation=dilation, padding=0 if causal else reach // 2, bias=bias)
        self.left_pad = reach if causal else 0
        # The kernel that runs ``forward_padded`` in place of torch's convolution, and the weight as it reads it
        # (``use_conv_kernel``; None: torch's).
        self.kernel: CausalConv | None = None
        self.fast_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, cin, t] -> [b, cout, t]
        return super().forward(F.pad(x, (self.left_pad, 0)) if self.left_pad else x)

    def forward_padded(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:  # [b, cin, left_pad + t] -> [b, cout, t]
        """``forward`` of an input that already starts with its ``left_pad`` zeros (an activation wrote them),
        plus ``residual`` when given."""
        if self.kernel is not None:
            return self.kernel(x, self.fast_weight, self.bias, self.dilation[0], residual)
        y = super().forward(x)
        return y if residual is None else residual + y


class UpsampleConv(nn.ConvTranspose1d):
    """Transposed conv multiplying the length by ``stride``; causal drops the trailing ``stride`` samples."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, *, causal: bool):
        super().__init__(cin, cout, kernel, stride=stride, padding=0 if causal else (kernel - stride) // 2)
        self.trim = stride if causal else 0
        # The kernel that runs ``forward`` in place of torch's transposed convolution (``use_upsample_kernel``;
        # None: torch's).
        self.kernel: CausalUpsample | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, cin, n] -> [b, cout, n * stride]
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.bias, self.stride[0])
        x = super().forward(x)
        return x[..., : x.shape[-1] - self.trim]


class _Cut:
    """Zeroes every sample of a [b, c, t] signal at or past its row's length, in place, touching only the last
    ``w`` samples: the ones where a row's padding can be (every row's length is at least t - w)."""

    def __init__(self, lengths: torch.Tensor, t: int, tail: int | None, dtype: torch.dtype) -> None:
        w = t if tail is None else min(t, tail)
        at = torch.arange(t - w, t, device=lengths.device)
        self.kept = (at < lengths[:, None]).to(dtype)[:, None, :]  # [b, 1, w]: 1 inside the row, 0 past it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x[..., x.shape[-1] - self.kept.shape[-1] :].mul_(self.kept)
        return x


class EncoderConv(nn.Module):
    """Symmetric-padded conv held under ``layer`` (the checkpoint's key path)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1):
        super().__init__()
        self.layer = nn.Conv1d(cin, cout, kernel, stride=stride, padding=(kernel - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:  # [b] -> [b]
        conv = self.layer
        reach = conv.kernel_size[0] - 1 - 2 * conv.padding[0]
        return torch.where(lengths > reach, (lengths - reach - 1) // conv.stride[0] + 1, 0)

    def output_padding(self, padding: int) -> int:
        """The most output frames past a row's ``output_lengths`` when at most ``padding`` samples are past its
        length: floor(a) - floor(b) <= floor(a - b) + 1 for the two lengths' quotients."""
        return padding // self.layer.stride[0] + 1


class ResStack(nn.Module):
    """Six residual pairs (LeakyReLU 0.01 -> conv k3 dilation 2^i -> LeakyReLU 0.01 -> conv k3), all centred."""

    def __init__(self, channels: int, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LeakyReLU(0.01),
                nn.Conv1d(channels, channels, 3, dilation=2**i, padding=2**i),
                nn.LeakyReLU(0.01),
                nn.Conv1d(channels, channels, 3, padding=1),
            )
            for i in range(depth)
        )

    def forward(self, x: torch.Tensor, cut: _Cut | None = None) -> torch.Tensor:
        """With ``cut``, every conv output is cut to the rows' lengths (see ``Encoder.forward``), and ``x`` is
        updated in place."""
        for layer in self.layers:
            if cut is None:
                x = x + layer(x)
                continue
            act_a, conv_a, act_b, conv_b = layer
            h = cut(conv_a(act_a(x)))
            # x is 0 past each row's length, so cutting x + y there is cutting y: one full-size kernel, the add.
            x = cut(x.add_(conv_b(act_b(h))))
        return x


class Encoder(nn.Module):
    """[b, 1, t] -> [b, 2d, n]: a flat Sequential (``generator.{idx}`` in the checkpoint)."""

    def __init__(self, config: VAEConfig):
        super().__init__()
        widths = config.downsample_channels
        layers: list[nn.Module] = [EncoderConv(1, ENCODER_WIDTH, 3), nn.LeakyReLU(0.2)]
        for cin, cout, rate in zip(widths[:-1], widths[1:], config.downsample_rates):
            layers += [EncoderConv(cin, cout, 2 * rate, stride=rate), ResStack(cout), nn.LeakyReLU(0.2)]
        layers.append(EncoderConv(widths[-1], 2 * config.latent_dim, 3))
        self.generator = nn.Sequential(*layers)

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor | None = None, padding: int | None = None
    ) -> torch.Tensor:
        """[b, 1, t] -> [b, 2d, n]. With ``lengths`` [b], only the first ``lengths`` samples of each row are the
        clip and the rest is padding: every conv output is cut back to the length the unpadded clip would give
        it, so the padding reaches each conv exactly as its own zero padding would, and the first n frames equal
        an encode of the clip alone. Shapes then depend on t only (a CUDA graph per padded length). ``padding``:
        no row has more than that many samples past its length, so each cut touches only the signal's end."""
        if lengths is None:
            return self.generator(wav)
        cut = _Cut(lengths, wav.shape[-1], padding, wav.dtype)
        x = cut(wav.clone())
        for layer in self.generator:
            if isinstance(layer, EncoderConv):
                lengths = layer.output_lengths(lengths)
                padding = None if padding is None else layer.output_padding(padding)
                x = layer(x)
                cut = _Cut(lengths, x.shape[-1], padding, x.dtype)  # one for all the convs of a rate
                x = cut(x)
            elif isinstance(layer, ResStack):
                x = layer(x, cut)
            else:  # LeakyReLU keeps zeros zero
                x = layer(x)
        return x


class AMPBlock(nn.Module):
    """x += conv2(act2(conv1(act1(x)))) for each dilation; activations alternate act1, act2, act1, ..."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...], config: VAEConfig):
        super().__init__()
        conv = lambda d: PaddedConv1d(channels, channels, kernel, d, causal=config.causal)  # noqa: E731
        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations = nn.ModuleList(
            AliasFreeActivation(channels, config.snake_logscale, config.act_causal) for _ in range(2 * len(dilations))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, c, t] -> [b, c, t]
        acts1, acts2 = self.activations[0::2], self.activations[1::2]
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, acts1, acts2):
            h = conv1.forward_padded(act1(x, conv1.left_pad))
            x = conv2.forward_padded(act2(h, conv2.left_pad), residual=x)
        return x


# ----------------------------------------------------------------------------------------------- model


class AuKVAE(nn.Module):
    """Encoder and decoder with plain (folded) conv weights; build with ``load_vae`` for released weights."""

    def __init__(self, config: VAEConfig):
        super().__init__()
        self.config = config
        self.hop = config.downsample_rate
        self.register_buffer("global_mean", torch.zeros(config.latent_dim))
        self.register_buffer("global_log_std", torch.ones(config.latent_dim))
        self.audio_encoder = Encoder(config)

        width = config.upsample_initial_channel
        self.conv_pre = PaddedConv1d(config.latent_dim, width, 7, causal=False)  # centred even in a causal model
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for rate, kernel in zip(config.upsample_rates, config.upsample_kernel_sizes):
            # One-element inner list: the checkpoint keys are ups.{i}.0.*
            self.ups.append(nn.ModuleList([UpsampleConv(width, width // 2, kernel, rate, causal=config.causal)]))
            width //= 2
            for size, dilations in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes):
                self.resblocks.append(AMPBlock(width, size, tuple(dilations), config))
        self.activation_post = AliasFreeActivation(width, config.snake_logscale, config.act_causal)
        self.conv_post = PaddedConv1d(width, 1, 7, causal=config.causal, bias=False)
        self.blocks_per_stage = len(config.resblock_kernel_sizes)
        # CUDA streams for a stage's AMP blocks after the first, which then run beside it (the wiring sets them;
        # None: one after the other on the current stream).
        self.branch_streams: list[torch.cuda.Stream] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_pre.weight.dtype

    # -- geometry

    def valid_frames(self, num_samples: int) -> int:
        """Latent frames covered by whole hops of a ``num_samples`` clip (the length upstream reports)."""
        return num_samples // self.hop

    def encoded_frames(self, num_samples: int) -> int:
        """Frames ``encode`` actually emits: one more than ``valid_frames`` for some remainders."""
        length = num_samples
        for rate in self.config.downsample_rates:
            length = (length - 2) // rate + 1 if length >= 2 else 0  # kernel 2r, stride r, padding r - 1
        return length

    def receptive_field(self) -> tuple[int, int]:
        """Latent frames of (left, right) context one decoded frame depends on: exactly (52, 7) at release
        geometry, inside the published tiling bound (53, 9)."""
        return decoder_context(self.config)

    # -- encode / decode

    def encode(
        self, wav: torch.Tensor, sample: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """[b, t] 24 kHz waveform -> [b, n, d] normalised latents (posterior mean, or a draw when ``sample``).

        ``n`` is ``encoded_frames(t)``: the symmetric padding can add a frame past ``valid_frames(t)``. A draw
        uses ``generator`` (the global RNG when None, as upstream does).
        """
        if wav.dim() != 2:
            raise InputError(f"vae encode expects a [b, t] waveform, got {tuple(wav.shape)}")
        if wav.shape[1] < self.hop:
            raise AudioError(f"vae encode needs at least {self.hop} samples, got {wav.shape[1]}")
        with torch.autocast(device_type=wav.device.type, enabled=False):
            stats = self.audio_encoder(wav[:, None, :].to(self.dtype)).float()  # [b, 1, t] -> [b, 2d, n]
        return self.latents(stats, sample, generator)

    def latents(
        self, stats: torch.Tensor, sample: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """The encoder's statistics [b, 2d, n] -> [b, n, d] normalised latents (the second half of ``encode``)."""
        with torch.autocast(device_type=stats.device.type, enabled=False):
            stats = stats.float()
            mean, log_std = stats.chunk(2, dim=1)  # [b, d, n] each
            z = mean
            if sample:
                device = mean.device if generator is None else generator.device
                noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=device)
                z = mean + noise.to(mean.device) * torch.exp(log_std)
            z = z.transpose(1, 2)  # [b, n, d]
            return (z - self.global_mean.float()) / torch.sqrt(self.global_log_std.float())

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[b, n, d] normalised latents -> [b, n * 480] waveform in [-1, 1]."""
        if latents.dim() != 3 or latents.shape[-1] != self.config.latent_dim:
            raise InputError(f"vae decode expects [b, n, {self.config.latent_dim}] latents, got {tuple(latents.shape)}")
        with torch.autocast(device_type=latents.device.type, enabled=False):
            z = latents.float() * torch.sqrt(self.global_log_std.float()) + self.global_mean.float()
            x = self.conv_pre(z.transpose(1, 2).to(self.dtype))  # [b, d, n] -> [b, c, n]
            for stage, (up,) in enumerate(self.ups):
                x = up(x)  # [b, c / 2, t * rate]
                first = stage * self.blocks_per_stage
                x = self._blocks_mean(x, self.resblocks[first : first + self.blocks_per_stage])
            x = self.conv_post.forward_padded(self.activation_post(x, self.conv_post.left_pad))  # [b, 1, n * 480]
            return torch.clamp(x, -1.0, 1.0).squeeze(1).float()

    def _blocks_mean(self, x: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
        """The mean of a stage's AMP blocks, each over ``x``. With ``branch_streams`` every block after the first
        runs on its own CUDA stream beside the first; the sum is taken in the same order either way."""
        streams = self.branch_streams or [None] * (len(blocks) - 1)
        outs = []
        for block, stream in zip(blocks[1:], streams):
            with beside(stream):
                outs.append(block(x))
        total = blocks[0](x)
        join(*streams)
        for out in outs:
            total = total + out
        return total / len(blocks)

    def decode_tiled(
        self, latents: torch.Tensor, tile_frames: int, left: int = RELEASE_CONTEXT[0], right: int = RELEASE_CONTEXT[1]
    ) -> torch.Tensor:
        """``decode`` in windows of ``tile_frames`` (see ``plan_tiles``); equals ``decode`` to fp rounding when
        (left, right) covers ``receptive_field()``. Peak memory is bounded by the window."""
        hop = self.hop
        wav = latents.new_empty((latents.shape[0], latents.shape[1] * hop), dtype=torch.float32)  # [b, n * 480]
        for start, width, emit_start, emit_end in plan_tiles(latents.shape[1], tile_frames, left, right):
            window = self.decode(latents[:, start : start + width])  # [b, width * 480]
            first, last = (emit_start - start) * hop, (emit_end - start) * hop
            wav[:, emit_start * hop : emit_end * hop] = window[:, first:last]
        return wav

    # -- checkpoint layout

    def release_state_dict(self) -> dict[str, torch.Tensor]:
        """This module's weights in the on-disk layout: each conv ``weight`` as v = weight, g = ||v||."""
        norm_keys = weight_norm_keys(self)
        out: dict[str, torch.Tensor] = {}
        for key, tensor in self.state_dict().items():
            tensor = tensor.detach().clone()
            if key in norm_keys:
                out[key + "_g"] = torch.norm_except_dim(tensor, 2, 0)
                out[key + "_v"] = tensor
            else:
                out[key] = tensor
        return out


def weight_norm_keys(model: nn.Module) -> set[str]:
    """Module keys of every conv weight: these are ``weight_g`` / ``weight_v`` pairs on disk."""
    convs = (nn.Conv1d, nn.ConvTranspose1d)
    return {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, convs)}


def is_filter_key(key: str) -> bool:
    """The alias-free activations' low-pass taps: deterministic buffers a checkpoint may or may not carry."""
    return key.endswith(".upsample.filter") or key.endswith(".downsample.lowpass.filter")


# ----------------------------------------------------------------------------------------------- kernel slots


def use_conv_kernel(model: nn.Module, kernel: CausalConv | None, max_width: int) -> int:
    """Hand the causal, square, fp32 convolutions with a bias of ``model``'s AMP blocks, up to ``max_width``
    channels, to ``kernel`` (None: every one back to torch's); returns how many the kernel runs."""
    count = 0
    for block in model.modules():
        if isinstance(block, AMPBlock):
            for conv in (*block.convs1, *block.convs2):
                fits = kernel is not None and (conv.left_pad and conv.in_channels == conv.out_channels <= max_width
                                               and conv.bias is not None and conv.weight.dtype == torch.float32)
                conv.kernel = kernel if fits else None
                conv.fast_weight = tap_major(conv.weight.detach()) if fits else None
                count += bool(fits)
    return count


def use_upsample_kernel(model: nn.Module, kernel: CausalUpsample | None) -> int:
    """Hand ``model``'s causal fp32 upsamplers to ``kernel`` (None: every one back to torch's); returns how many
    the kernel runs."""
    count = 0
    for module in model.modules():
        if isinstance(module, UpsampleConv):
            stride = module.stride[0]
            fits = kernel is not None and (module.trim == stride and module.kernel_size[0] == 2 * stride
                                           and module.bias is not None and module.weight.dtype == torch.float32)
            module.kernel = kernel if fits else None
            count += fits
    return count
