"""AuK's instruction wording, written from a request's parts with the templates the model was trained on.

The templates are the upstream cookbook's (``auk-model.md`` 6.2). The order of the instruct template matters:
other orderings can make the model speak the description. Each function takes plain strings and returns the
instruction; ``write_instruction`` is the one entry (jobs, batch lines and the speech endpoint call it).

- ``speak`` with a clip: zero-shot, ``Say the following with the same voice: "{text}"``.
- ``speak`` without: instruct TTS, ``Generate speech based on the following description: "{description}". The
  content to speak is: "{text}".`` (the Chinese variant for Chinese text), the description defaulting to sglang's
  ``A clear, natural voice.``; an extra ``style`` ("whispered, slowly") is appended to the description.
- The recording tasks keep the source's length (enhancement, separation, repair): fixed sentences.
"""

from __future__ import annotations

import re

from auk_worker.errors import InputError
from auk_worker.longform.duration import language_code, script_counts

ZERO_SHOT = 'Say the following with the same voice: "{text}"'
INSTRUCT = 'Generate speech based on the following description: "{description}". The content to speak is: "{text}".'
INSTRUCT_ZH = '请基于下面的描述: "{description}",生成语音内容"{text}".'
DEFAULT_DESCRIPTION = "A clear, natural voice."  # sglang's default for a request without one

SPEAK = "speak"
# Tasks whose output is as long as the source: a long recording renders as overlapping windows (windows.py).
RECORDING_TASKS: dict[str, str] = {
    "denoise": "Remove only the background noise, preserve everything else, and output audio of the same length.",
    # The cookbook names a dereverberation analogue of the denoise sentence; this is that sentence's wording.
    "dereverb": "Remove only the reverberation, preserve everything else, and output audio of the same length.",
    "enhance": "Preserve all speakers, remove noise and reverberation, and output clean speech of the same length.",
    "repair_telephone": "Repair the telephone effect and restore natural, clear speech.",
    "repair_muffling": "Repair the muffling and restore natural, clear speech.",
    "repair_clipping": "Repair the clipping and restore natural, clear speech.",
    "repair_dropouts": "Repair the dropouts and restore natural, clear speech.",
    "keep_first_speaker": "Keep only the first speaker to start talking and remove all other speakers.",
    "keep_second_speaker": "Keep only the second speaker to start talking and remove all other speakers.",
    "keep_singing": "Keep only the singing voice and remove everything else.",
    "keep_speaker": 'Keep only the speaker who says "{text}" and remove all other speakers.',
}
TASKS = (SPEAK, *RECORDING_TASKS)


def is_chinese(text: str, language: str | None = None) -> bool:
    """The Chinese template for ``language`` zh, or (no language) a text mostly of CJK characters with no kana."""
    code = language_code(language)
    if code is not None:
        return code == "zh"
    if re.search(r"[\u3040-\u30ff\uac00-\ud7af]", text):  # kana or Hangul: Japanese or Korean, not Chinese
        return False
    counts = script_counts(text)
    return counts["cjk"] > 0.5 * sum(counts.values())


def speak_instruction(text: str, *, description: str | None = None, has_clip: bool = False,
                      style: str | None = None, language: str | None = None) -> str:  # fmt: skip
    """The instruction that speaks ``text``: zero-shot with a clip, instruct TTS with a description otherwise."""
    if has_clip:
        if description is not None:
            raise InputError("description: a job speaks in its clip's voice or in a described one, not both")
        if style is not None:
            raise InputError("style: the zero-shot template has no place for a style; describe the voice instead of "
                             "giving a clip, or ask for the style in a raw instruction")  # fmt: skip
        return ZERO_SHOT.format(text=text)
    parts = [p.strip() for p in (description, style) if p is not None and p.strip()]
    described = " ".join(parts) or DEFAULT_DESCRIPTION
    template = INSTRUCT_ZH if is_chinese(text, language) else INSTRUCT
    return template.format(description=described, text=text)


def recording_instruction(task: str, text: str | None = None) -> str:
    """The fixed sentence of a recording task (``keep_speaker`` takes the words its speaker says as ``text``)."""
    if task not in RECORDING_TASKS:
        raise InputError(f"task: unknown task {task!r}; one of {', '.join(TASKS)}")
    template = RECORDING_TASKS[task]
    if "{text}" in template:
        if not text:
            raise InputError(f"text: task {task!r} needs the words its speaker says as text")
        return template.format(text=text)
    if text:
        raise InputError(f"text: task {task!r} takes no text")
    return template


def write_instruction(task: str, text: str | None = None, *, description: str | None = None, has_clip: bool = False,
                      style: str | None = None, language: str | None = None) -> str:  # fmt: skip
    """AuK's instruction for a request's parts: ``task`` (``speak`` or a recording task), the text, a voice
    ``description`` or a clip (``has_clip``), an optional extra ``style``. Raises InputError naming the field."""
    if task == SPEAK:
        if not text:
            raise InputError("text: give the text to speak")
        return speak_instruction(text, description=description, has_clip=has_clip, style=style, language=language)
    if not has_clip:
        raise InputError(f"audio: task {task!r} works on a recording; give audio")
    if description is not None or style is not None:
        raise InputError(f"{'description' if description is not None else 'style'}: task {task!r} takes none")
    return recording_instruction(task, text)


_QUOTED = [
    re.compile(r'^Say the following(?: with the same voice)?: "(?P<text>.*)"\s*$', re.S),
    re.compile(r'The content to speak is: "(?P<text>.*)"\.?\s*$', re.S),
    re.compile(r'生成语音内容"(?P<text>.*)"\.?\s*$', re.S),
]


def speaks(instruction: str) -> bool:
    """Whether a raw instruction is one of the speaking templates (zero-shot or instruct TTS)."""
    return any(pattern.search(instruction) for pattern in _QUOTED)


def spoken_text(instruction: str) -> str:
    """The words a raw instruction speaks, for its length estimate: the quoted text of the templates above, else
    the last quoted passage, else the whole instruction."""
    for pattern in _QUOTED:
        match = pattern.search(instruction)
        if match:
            return match.group("text")
    quoted = re.findall(r'"([^"]+)"', instruction)
    return quoted[-1] if quoted else instruction
