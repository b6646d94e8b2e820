"""Stage 0's prompt: the chat-template string, the snapshot's thinker config, and ``PromptProcessor``, which turns
(instruction, 16 kHz clip) into the thinker's inputs as Qwen2_5OmniProcessor would.

- ``render_prompt``: the chat-template string the processor would produce, written out by hand.
- ``PromptProcessor``: tokenizer + Whisper log-mel features, expanding ``<|AUDIO|>`` to one token per audio
  embedding, without the image/video processors (and so without torchvision).

Shapes: nt prompt tokens (audio placeholders included), m mel bins (128), f mel frames.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from auk_worker.errors import AudioError, CheckpointError, InputError

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a helpful assistant."
NO_PROMPT_AUDIO = "|<no_prompt_audio>|"
AUDIO_PLACEHOLDER = "<|AUDIO|>"
AUDIO_ITEM = "<|audio_bos|>" + AUDIO_PLACEHOLDER + "<|audio_eos|>"
SAMPLE_RATE = 16_000


# ---------------------------------------------------------------------------------------------------------------
# Prompt


def render_prompt(instruction: str, has_audio: bool) -> str:
    """The string ``apply_chat_template(..., add_generation_prompt=True)`` renders for AuK's single user turn.

    The Qwen2.5-Omni template injects the default system turn, then concatenates the user's content items with
    nothing between them: the text item, then the audio item (or, without audio, the no-audio marker that
    upstream appends to the instruction text).
    """
    audio_part = AUDIO_ITEM if has_audio else NO_PROMPT_AUDIO
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{instruction}{audio_part}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def audio_token_count(num_frames: int) -> int:
    """Audio tokens for ``num_frames`` mel frames: conv2 (stride 2, pad 1) then an average pool of 2."""
    after_conv = (num_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


# ---------------------------------------------------------------------------------------------------------------
# Config


def read_thinker_config(qwen_dir: Path):
    """The thinker's transformers config from a snapshot's config.json (full Qwen2.5-Omni or a bare thinker)."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig

    path = Path(qwen_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"Qwen snapshot {qwen_dir} has no config.json")
    raw = json.loads(path.read_text())
    model_type = raw.get("model_type")
    if model_type == "qwen2_5_omni":
        if "thinker_config" not in raw:
            raise CheckpointError(f"{path}: a qwen2_5_omni config without thinker_config")
        # Only the thinker section: building the talker/token2wav configs would only log warnings.
        return Qwen2_5OmniThinkerConfig.from_dict(raw["thinker_config"])
    if model_type == "qwen2_5_omni_thinker":
        return Qwen2_5OmniThinkerConfig.from_dict(raw)
    raise CheckpointError(f"{path}: model_type {model_type!r} is not qwen2_5_omni or qwen2_5_omni_thinker")


def is_full_omni_snapshot(qwen_dir: Path) -> bool:
    return json.loads((Path(qwen_dir) / "config.json").read_text()).get("model_type") == "qwen2_5_omni"


@dataclass(frozen=True)
class ThinkerSpec:
    """The few thinker dimensions the encoder checks against; read from the snapshot's own config."""

    hidden_size: int
    num_layers: int
    audio_token_id: int
    num_mel_bins: int

    @classmethod
    def from_config(cls, thinker_config) -> ThinkerSpec:
        return cls(
            hidden_size=thinker_config.text_config.hidden_size,
            num_layers=thinker_config.text_config.num_hidden_layers,
            audio_token_id=thinker_config.audio_token_index,
            num_mel_bins=thinker_config.audio_config.num_mel_bins,
        )


# ---------------------------------------------------------------------------------------------------------------
# Processor (tokenizer + Whisper features; no image or video processor)


def _check_audio(audio: np.ndarray) -> np.ndarray:
    audio = np.asarray(audio)
    if audio.ndim != 1 or audio.size == 0:
        raise AudioError(f"prompt audio must be a non-empty mono 16 kHz array, got shape {audio.shape}")
    if not np.issubdtype(audio.dtype, np.floating):
        raise AudioError(f"prompt audio must be floating point, got {audio.dtype}")
    if not np.isfinite(audio).all():
        raise AudioError("prompt audio contains NaN or infinite samples")
    return audio.astype(np.float32, copy=False)


class PromptProcessor:
    """Turns (instruction, 16 kHz clip or None) into the thinker's inputs, as Qwen2_5OmniProcessor would.

    The log-mel features are the Whisper feature extractor's, as the processor calls it (sampling_rate 16000,
    padding "max_length", truncation, attention mask), computed here with the same torch operations (its STFT,
    mel filters, log floor and scaling) on any device, so that on a GPU the host only copies the samples over.
    The padding stops a little past the clip instead of at the extractor's full window (300 s for Qwen2.5-Omni):
    every frame whose STFT window touches the clip is computed from the same samples either way and the log-mel
    floor is the same, so the valid frames are the processor's; only the all-padding frames that the thinker
    discards are not computed.
    """

    def __init__(self, tokenizer, feature_extractor, audio_token_id: int) -> None:
        placeholder = tokenizer.convert_ids_to_tokens(audio_token_id)
        if placeholder != AUDIO_PLACEHOLDER:
            raise CheckpointError(
                f"thinker audio_token_index {audio_token_id} is {placeholder!r} in the tokenizer, "
                f"expected {AUDIO_PLACEHOLDER!r}"
            )
        if feature_extractor.sampling_rate != SAMPLE_RATE:
            raise CheckpointError(f"feature extractor expects {feature_extractor.sampling_rate} Hz, not {SAMPLE_RATE}")
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.audio_token_id = audio_token_id
        self._stft_tables: dict[torch.device, tuple[Tensor, Tensor]] = {}  # device -> (window, mel filters)
        self.log_mel_graphs = None  # set by the wiring: replays `log_mel` from CUDA graphs (LogMelGraphs)
        # Chat markers and multimodal placeholders: inside an instruction they would change the prompt's layout.
        self.reserved_tokens = tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)

    @classmethod
    def from_pretrained(cls, qwen_dir: Path) -> PromptProcessor:
        from transformers import Qwen2TokenizerFast, WhisperFeatureExtractor

        qwen_dir = Path(qwen_dir)
        has = lambda name: (qwen_dir / name).is_file()  # noqa: E731
        missing = [] if has("preprocessor_config.json") else ["preprocessor_config.json"]
        if not (has("tokenizer.json") or (has("vocab.json") and has("merges.txt"))):
            missing.append("tokenizer.json (or vocab.json and merges.txt)")
        if missing:
            raise CheckpointError(
                f"Qwen snapshot {qwen_dir} has no {' and no '.join(missing)}: a model's save_pretrained writes "
                f"weights and config only; copy the processor's files (tokenizer and preprocessor_config.json) "
                f"from the Qwen2.5-Omni-3B snapshot into it, or save them there with "
                f"Qwen2_5OmniProcessor.save_pretrained"
            )
        spec = ThinkerSpec.from_config(read_thinker_config(qwen_dir))
        # The Qwen2 tokenizer class directly: AutoTokenizer would parse the whole Omni config.json, whose talker
        # section makes transformers log token-id warnings that have nothing to do with the thinker.
        tokenizer = Qwen2TokenizerFast.from_pretrained(qwen_dir, local_files_only=True)
        feature_extractor = WhisperFeatureExtractor.from_pretrained(qwen_dir, local_files_only=True)
        if feature_extractor.feature_size != spec.num_mel_bins:
            raise CheckpointError(
                f"feature extractor makes {feature_extractor.feature_size} mel bins, "
                f"the audio tower takes {spec.num_mel_bins}"
            )
        return cls(tokenizer, feature_extractor, spec.audio_token_id)

    def __call__(
        self,
        instruction: str,
        audio_16k: np.ndarray | None,
        device: torch.device | str = "cpu",
        input_ids: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The thinker's inputs: ``input_ids`` and ``attention_mask`` on the host, and with a clip its
        ``input_features`` on ``device`` and their ``feature_attention_mask`` on the host. ``input_ids``: the
        prompt's tokens where the caller made them ahead (the method below); without them the clip's features are
        launched first, so that the GPU computes them while the host tokenizes."""
        self._check_instruction(instruction)
        batch: dict[str, Tensor] = {}
        if audio_16k is not None:
            features, feature_mask = self.audio_features(audio_16k, device)
            batch.update(input_features=features, feature_attention_mask=feature_mask)
        if input_ids is None:
            input_ids = self.input_ids(instruction, None if audio_16k is None else len(audio_16k))
        batch.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        return batch

    def input_ids(self, instruction: str, clip_samples: int | None) -> Tensor:
        """The prompt's token ids [1, nt] on the host, for a clip of ``clip_samples`` at 16 kHz (None: no clip).
        The clip's length alone sets its audio token count, so a render tokenizes while the clip is resampled.

        These are the ids of the prompt with its audio placeholder repeated once per audio token, made a faster
        way, in about a quarter of the time: the tokenizer's backend (the ids of calling the tokenizer, without its
        Python wrapping) encodes the prompt with one placeholder, and that id is then repeated. The placeholder is
        an added token, which the tokenizer splits out of the text before anything else, so n of them give n ids
        in its place and leave the text around them as it is."""
        self._check_instruction(instruction)
        ids = self.tokenizer.backend_tokenizer.encode(render_prompt(instruction, clip_samples is not None)).ids
        if clip_samples is not None:
            at = ids.index(self.audio_token_id)
            ids[at : at + 1] = [self.audio_token_id] * audio_token_count(self.audio_frames(clip_samples))
        return torch.tensor([ids], dtype=torch.long)

    def _check_instruction(self, instruction: str) -> None:
        for token in self.reserved_tokens:
            if token in instruction:
                raise InputError(f"instruction contains the reserved token {token!r}")

    def audio_frames(self, clip_samples: int) -> int:
        """The mel frames the extractor's attention mask keeps for a clip: one per hop begun, of at most the
        extractor's window."""
        extractor = self.feature_extractor
        return -(-min(clip_samples, extractor.n_samples) // extractor.hop_length)

    def audio_features(self, audio_16k: np.ndarray, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """Log-mel features of the clip's frames, [1, m, f] on ``device``, and their (all-ones) mask, [1, f] on
        the host."""
        audio = _check_audio(audio_16k)
        extractor = self.feature_extractor
        hop, n_fft = extractor.hop_length, extractor.n_fft
        if audio.size > extractor.n_samples:
            logger.warning(
                "prompt audio: %.1f s truncated to the extractor's %.1f s",
                audio.size / SAMPLE_RATE,
                extractor.n_samples / SAMPLE_RATE,
            )
            audio = audio[: extractor.n_samples]
        # n_fft samples of silence past the clip cover every window that touches it (see the class docstring).
        padded = min(extractor.n_samples, -(-(audio.size + n_fft) // hop) * hop)
        frames = self.audio_frames(audio.size)
        device = torch.device(device)
        if self.log_mel_graphs is not None and device == self.log_mel_graphs.device:
            log_mel = self.log_mel_graphs.log_mel(audio, padded)  # [m, >= padded / hop]
        else:
            wave = torch.zeros(padded, dtype=torch.float32, device=device)
            wave[: audio.size].copy_(torch.from_numpy(audio), non_blocking=True)
            log_mel = self.log_mel(wave)
        return log_mel[None, :, :frames], torch.ones(1, frames, dtype=torch.int32)

    def log_mel(self, wave: Tensor) -> Tensor:
        """The extractor's normalised log-mel spectrogram of a zero-padded clip: [s] -> [m, s / hop], s a multiple
        of the hop. More silence past the padding adds frames and changes none: silent frames sit at the log floor
        of 1e-10, under the clip's peak, which sets the floor they are raised to."""
        n_fft, hop = self.feature_extractor.n_fft, self.feature_extractor.hop_length
        if wave.device not in self._stft_tables:
            filters = np.asarray(self.feature_extractor.mel_filters, dtype=np.float32)  # [n_fft / 2 + 1, m]
            self._stft_tables[wave.device] = (
                torch.hann_window(n_fft, device=wave.device),
                torch.from_numpy(filters).T.contiguous().to(wave.device),
            )
        window, mel_filters = self._stft_tables[wave.device]
        stft = torch.stft(wave, n_fft, hop, window=window, return_complex=True)  # [n_fft / 2 + 1, s / hop + 1]
        power = (stft[..., :-1].abs() ** 2).contiguous()  # the last frame is dropped, as the extractor drops it
        log_spec = torch.clamp(mel_filters @ power, min=1e-10).log10()  # [m, s / hop]
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)  # the floor: 80 dB under the clip's peak
        return (log_spec + 4.0) / 4.0


