"""Sentence-boundary buffering of text that arrives in pieces (an LLM's token stream).

Speech for a sentence can start as soon as the sentence is complete, long before the
whole reply is known. :class:`SentenceBuffer` collects pieces and hands out complete
sentences in order.

Where it cuts:

* after Chinese/full-width ``。！？；`` (and ``…``) and after ASCII ``. ! ? ;``, with any
  run of further terminators and closing quotes/brackets kept on the sentence;
* at a newline.

An ASCII terminator only ends a sentence when whitespace (or a CJK character) follows it,
so ``3.5``, ``example.com`` and ``U.S.A`` are never cut; ``Dr.``/``e.g.`` and single
initials (``J. K.``) are not sentence ends either. Because the character after a
terminator decides, a terminator at the very end of the buffer waits for the next piece
(or :meth:`SentenceBuffer.flush`). A sentence that grows past ``max_chars`` without an
end is cut at its last comma or space (else hard at ``max_chars``), so a reply with no
punctuation still streams and no segment exceeds what one request accepts.
"""

_CJK_TERMINATORS = frozenset("。！？；…")
_ASCII_TERMINATORS = frozenset(".!?;")
_CLOSERS = frozenset("\"')]}”’»」』）】》")
_SOFT_BREAKS = frozenset("，、,：:　 \t")
# Words that end in a period without ending the sentence (compared lower-case).
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "e.g", "i.e"})
# From here on characters are CJK (punctuation, kana, ideographs, full-width forms).
_CJK_START = 0x3000


class SentenceBuffer:
    """Collects text pieces; :meth:`push` returns the sentences completed so far."""

    def __init__(self, max_chars: int = 300) -> None:
        if max_chars < 2:
            raise ValueError("max_chars must be at least 2")
        self.max_chars = max_chars
        self._text = ""

    @property
    def pending(self) -> str:
        """Text received but not yet handed out."""
        return self._text

    def push(self, piece: str) -> list[str]:
        """Add ``piece``; return the sentences it completed (stripped, in order)."""
        self._text += piece
        sentences, self._text = _cut(self._text, final=False, max_chars=self.max_chars)
        return sentences

    def flush(self) -> list[str]:
        """Hand out everything buffered, the unfinished tail included."""
        sentences, rest = _cut(self._text, final=True, max_chars=self.max_chars)
        self._text = ""
        return [*sentences, *_keep(rest)]

    def clear(self) -> None:
        """Drop everything buffered (a cancelled utterance)."""
        self._text = ""


def _cut(text: str, *, final: bool, max_chars: int) -> tuple[list[str], str]:
    """Split ``text`` into complete sentences and the unfinished rest."""
    sentences: list[str] = []
    start = 0
    while (end := _next_boundary(text, start, final)) is not None:
        parts, last = _split_long(text[start:end], max_chars)
        sentences += [*parts, *_keep(last)]
        start = end
    parts, rest = _split_long(text[start:], max_chars)
    return sentences + parts, rest


def _split_long(text: str, max_chars: int) -> tuple[list[str], str]:
    """Cut ``max_chars`` parts off ``text`` while it is longer; returns them and the tail."""
    parts: list[str] = []
    while len(text) > max_chars:
        cut = _soft_cut(text, max_chars)
        parts.extend(_keep(text[:cut]))
        text = text[cut:]
    return parts, text


def _next_boundary(text: str, start: int, final: bool) -> int | None:
    """The end (exclusive) of the first complete sentence at or after ``start``."""
    i = start
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\n":
            return i + 1
        if ch in _CJK_TERMINATORS or ch in _ASCII_TERMINATORS:
            j = i + 1
            while j < n and (
                text[j] in _CJK_TERMINATORS or text[j] in _ASCII_TERMINATORS or text[j] in _CLOSERS
            ):
                j += 1
            if j == n:
                # What follows decides (a closing quote, a digit of 3.5): wait for it.
                return j if final else None
            if ch in _CJK_TERMINATORS or _ends_sentence(text, i, j):
                return j
            i = j
            continue
        i += 1
    return None


def _ends_sentence(text: str, i: int, j: int) -> bool:
    """Whether the ASCII terminator run ``text[i:j]`` ends a sentence (``j < len(text)``)."""
    after = text[j]
    if not (after.isspace() or ord(after) >= _CJK_START):
        return False  # 3.5, example.com, U.S.A
    if text[i:j] != ".":
        return True
    word = text[:i].rsplit(None, 1)[-1] if text[:i].strip() else ""
    if len(word) == 1 and word.isalpha() and word.isupper():
        return False  # an initial: J. K. Rowling
    return word.lower() not in _ABBREVIATIONS


def _soft_cut(text: str, max_chars: int) -> int:
    """Where to cut an over-long unfinished sentence: after its last soft break."""
    for k in range(max_chars - 1, 0, -1):
        if text[k] in _SOFT_BREAKS:
            return k + 1
    return max_chars


def _keep(sentence: str) -> list[str]:
    """``[sentence.strip()]``, or nothing if it has nothing to speak (only punctuation)."""
    stripped = sentence.strip()
    return [stripped] if any(c.isalnum() for c in stripped) else []
