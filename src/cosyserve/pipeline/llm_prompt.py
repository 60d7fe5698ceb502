"""What the LM reads before the text to speak, per model family.

CosyVoice 3's LM was trained with a prompt that ends in ``<|endofprompt|>`` ahead of the
text, and upstream refuses input without the marker ("You are a helpful assistant.
<|endofprompt|>" opens every example). A caller should not need to know that: the server
adds upstream's system prompt where the caller gave no marker. A caller who writes their
own prompt keeps it: the text up to and including the first marker becomes the head of
every sentence (upstream only accepts such text as a single unsplit sentence).
CosyVoice 2 keeps its rules: only instruct2 uses the marker, to end the instruction.
"""

from dataclasses import dataclass

END_OF_PROMPT = "<|endofprompt|>"
SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class TextPrompt:
    """``head``: the caller's own prompt, up to and including the marker (``""``: none);
    ``body``: the text to speak."""

    head: str
    body: str


def split_text_prompt(text: str) -> TextPrompt:
    """Split a CosyVoice 3 request text at its first ``<|endofprompt|>``."""
    index = text.find(END_OF_PROMPT)
    if index < 0:
        return TextPrompt("", text)
    end = index + len(END_OF_PROMPT)
    return TextPrompt(text[:end], text[end:])


def instruction(instruct: str, cosyvoice3: bool) -> str:
    """The instruct2 prompt: the instruction ending in the marker; CosyVoice 3's also
    opens with the system prompt, as in upstream's examples, unless the caller wrote the
    marker (then it is used as given)."""
    if instruct.endswith(END_OF_PROMPT) or (cosyvoice3 and END_OF_PROMPT in instruct):
        return instruct
    if cosyvoice3:
        return f"{SYSTEM_PROMPT} {instruct}{END_OF_PROMPT}"
    return instruct + END_OF_PROMPT


def system_prompt() -> str:
    """CosyVoice 3's default prompt, for input that carries no marker."""
    return SYSTEM_PROMPT + END_OF_PROMPT
