"""Voices by name, and a text request made into the AuK job that renders it.

A request names its voice as ``voice``: one of this key's voices by id (``voice_...``) or by name, or a built-in
voice (``config/voices.yaml``: OpenAI's names and ``default``). ``VoiceBook`` finds it, in that order (an id, a
built-in name, then the key's own names, newest first), and an unknown name is a 422 ``unknown_voice`` that lists
the names there are. A voice is either a clip (zero-shot TTS) or a description and a seed (instruct TTS): built-in
voices, and voices a caller made with ``POST /v1/voices {"description": ...}``.

``compose`` turns a request that gives the text to speak (``input``) into the parts the service writes AuK's
instruction from (``auk_worker/longform/``, which plans it into one pass or several segments):

- a described voice (none named: ``default``): its description, plus the request's ``instructions`` as a speaking
  style; the voice's seed unless the request gives one; the instruct TTS sentence (the Chinese one for Chinese text
  or ``language: Chinese``), the length estimated from the text at ``speed`` and the script's speaking rate;
- a clip (a clip voice, an upload, an input key, a speech request's ``ref_audio``): the zero-shot sentence; the
  length estimated from ``ref_text`` and the clip's length when the transcript is given, else from the rates.

A given length wins; with a ``speed`` other than 1 the two are refused only when they disagree. A request that
already gives the whole ``instruction`` passes unchanged (it may not also give ``input``, a style, a speed, a
language or a transcript, which only apply to a text).

Every route that creates jobs composes through here (``api/submit.py``, ``api/routes/speech.py``), so a speech
request, a job and a batch line take the same voices and fields.
"""

from __future__ import annotations

from typing import Any

from api.deps import Services
from auk_worker.errors import InputError
from auk_worker.longform.duration import Estimator, check_agreement, check_speed, language_code
from auk_worker.service.records.requests import JobRequest
from auk_worker.service.records.voices import VOICE_PREFIX, Voice
from auk_worker.voice_catalogue import NamedVoice

MAX_OWN_VOICES = 1000  # a key's voices searched by name
TEXT_FIELDS = ("instructions", "speed", "language", "ref_text")


class VoiceBook:
    """Finds the voices one request (or one batch) names, each once."""

    def __init__(self, svc: Services, owner: str) -> None:
        self.svc = svc
        self.owner = owner
        self.catalogue = svc.catalogue
        self._found: dict[str, NamedVoice | Voice] = {}
        self._own: dict[str, Voice] | None = None

    def find(self, name: str) -> NamedVoice | Voice:
        """The voice ``name`` stands for; ``InputError`` ``unknown_voice`` listing the names there are."""
        if name in self._found:
            return self._found[name]
        voice: NamedVoice | Voice | None = None
        if name.startswith(VOICE_PREFIX):
            voice = self.svc.voices.get(name, self.owner)
        if voice is None:
            voice = self.catalogue.get(name)
        if voice is None:
            voice = self.own().get(name)
        if voice is None:
            own = sorted(self.own())
            mine = f"; this key's voices: {', '.join(own)}" if own else ""
            raise InputError(f"voice: no voice {name!r}; built-in voices: {', '.join(self.catalogue.names)}{mine}",
                             code="unknown_voice", details={"builtin": self.catalogue.names, "own": own})
        self._found[name] = voice
        return voice

    def own(self) -> dict[str, Voice]:
        """This key's named voices by name (the newest of two with one name)."""
        if self._own is None:
            voices = self.svc.voices.list(self.owner, limit=MAX_OWN_VOICES)
            self._own = {voice.name: voice for voice in reversed(voices) if voice.name}
        return self._own

    def clip(self, name: str) -> dict[str, Any] | None:
        """The clip a job with this voice reads (None for a described voice)."""
        voice = self.find(name)
        if isinstance(voice, Voice) and not voice.description:
            return voice.clip(self.svc.storage.bucket)
        return None


def described(voice: NamedVoice | Voice | None) -> bool:
    return isinstance(voice, NamedVoice) or (isinstance(voice, Voice) and bool(voice.description))


def compose(request: JobRequest, clip: dict[str, Any] | None, voice: NamedVoice | Voice | None, *,
            default_voice: NamedVoice, length_field: str = "gen_seconds") -> JobRequest:
    """``request`` with its text (``input``) and voice made into the parts the service writes AuK's instruction
    from (``auk_worker/longform``: the text, a voice description or the clip, a style), so that a text of any
    length renders, split into segments where it is longer than one pass (see the module docstring).
    ``length_field`` is the name the caller knows the length by (``duration_seconds`` on the speech route)."""
    if request.input is None:
        given = [name for name in TEXT_FIELDS if getattr(request, name) is not None and name != "instructions"]
        if request.instructions is not None:
            given.insert(0, "instructions")
        if given and request.instruction is not None:
            raise InputError(f"{given[0]}: applies to a text given as input; with a whole instruction, write it "
                             "into the instruction")  # fmt: skip
        if described(voice):
            raise InputError(f"voice: {request.voice!r} is a described voice: give the text to speak as input, "
                             "not a whole instruction")  # fmt: skip
        return request
    language_code(request.language)  # a language that is not one is refused by name
    speed = check_speed(request.speed)
    text = request.input.strip()
    if not text:
        raise InputError("input: give the text to speak")
    update: dict[str, Any] = {"text": text, "input": None, "instructions": None}
    if clip is not None:
        if request.instructions and request.instructions.strip():
            raise InputError("instructions: a speaking style applies to a described voice; a clip's voice speaks "
                             "as recorded (describe the change in a whole instruction instead)")  # fmt: skip
        if request.ref_text and request.ref_text.strip():
            natural = Estimator(clip_seconds=clip["duration_s"], ref_text=request.ref_text)(text)
        else:
            natural = None
    else:
        if request.ref_text is not None:
            raise InputError("ref_text: the transcript of a reference clip; this request has no clip")
        voice = voice if described(voice) else default_voice
        style = request.instructions.strip() if request.instructions and request.instructions.strip() else None
        update.update(description=voice.description, style=style,
                      seed=request.seed if request.seed is not None else voice.seed)
        natural = Estimator(language=request.language)(text)
    if request.gen_seconds is not None and natural is not None:
        check_agreement(request.gen_seconds, natural, speed, length_field)
    return request.model_copy(update=update)
