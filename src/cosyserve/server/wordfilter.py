"""Sensitive-word matching: an Aho-Corasick automaton over all words at once.

One pass over the text finds every occurrence of every word (time linear in the text plus
the matches, whatever the number of words), so a list of thousands of words costs a
request no more than a list of ten. Matching is by substring and case-insensitive per
character (no word boundaries: Chinese text has none).
"""

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


def _fold(char: str) -> str:
    """Lower-case one character, keeping it one character long (so that match positions
    in the folded text are positions in the original)."""
    lower = char.lower()
    return lower if len(lower) == 1 else char


@dataclass(frozen=True)
class Match:
    """One occurrence: ``text[start:end]`` is a listed word."""

    start: int
    end: int


class WordFilter:
    """An immutable automaton of ``words`` (empty and blank entries are ignored)."""

    def __init__(self, words: Iterable[str]) -> None:
        # State 0 is the root; goto[s] maps a character to the next state.
        self._goto: list[dict[str, int]] = [{}]
        self._fail: list[int] = [0]
        # For each state, the lengths of the words that end there (own and via fail links).
        self._out: list[tuple[int, ...]] = [()]
        count = 0
        for word in words:
            folded = "".join(_fold(c) for c in word.strip())
            if folded:
                self._add(folded)
                count += 1
        self.size = count
        self._link()

    def _add(self, word: str) -> None:
        state = 0
        for char in word:
            nxt = self._goto[state].get(char)
            if nxt is None:
                nxt = len(self._goto)
                self._goto.append({})
                self._fail.append(0)
                self._out.append(())
                self._goto[state][char] = nxt
            state = nxt
        if len(word) not in self._out[state]:
            self._out[state] = (*self._out[state], len(word))

    def _link(self) -> None:
        """Breadth-first: each state's fail link is the longest proper suffix in the trie."""
        queue = deque(self._goto[0].values())
        while queue:
            state = queue.popleft()
            for char, nxt in self._goto[state].items():
                queue.append(nxt)
                fail = self._fail[state]
                while fail and char not in self._goto[fail]:
                    fail = self._fail[fail]
                target = self._goto[fail].get(char, 0)
                self._fail[nxt] = target if target != nxt else 0
                self._out[nxt] = self._out[nxt] + self._out[self._fail[nxt]]

    def find(self, text: str) -> list[Match]:
        """Every occurrence in ``text``, overlapping ones included, by end position."""
        matches: list[Match] = []
        state = 0
        for index, raw in enumerate(text):
            char = _fold(raw)
            while state and char not in self._goto[state]:
                state = self._fail[state]
            state = self._goto[state].get(char, 0)
            for length in self._out[state]:
                matches.append(Match(index + 1 - length, index + 1))
        return matches

    def contains(self, text: str) -> bool:
        return bool(self.find(text)) if self.size else False

    def mask(self, text: str, char: str = "*") -> str:
        """``text`` with every character inside a match replaced by ``char``."""
        matches = self.find(text) if self.size else []
        if not matches:
            return text
        hidden = [False] * len(text)
        for match in matches:
            hidden[match.start : match.end] = [True] * (match.end - match.start)
        return "".join(char if h else c for c, h in zip(text, hidden, strict=True))


def read_word_list(text: str) -> list[str]:
    """One word or phrase a line; blank lines and lines starting with ``#`` are skipped."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
