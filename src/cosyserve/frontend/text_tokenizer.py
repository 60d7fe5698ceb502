"""The CosyVoice 2 and 3 text tokenizers: Qwen2's byte-level BPE plus CosyVoice's special tokens.

Built with the ``tokenizers`` library alone from ``CosyVoice-BlankEN/`` (``vocab.json``,
``merges.txt``, ``tokenizer_config.json``), reproducing what upstream gets from
``AutoTokenizer.from_pretrained`` followed by ``add_special_tokens`` (spec 3.2): the same
normalizer, pre-tokenizer and decoder, the directory's added tokens at their declared ids,
then the 17 CosyVoice 2 tokens from id 151646 on (``CosyVoice2Tokenizer``), and for
CosyVoice 3 (``CosyVoice3Tokenizer``) 261 more from 151663 on.
"""

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from cosyserve.errors import ModelDirError
from cosyserve.frontend import text_tokens

logger = logging.getLogger(__name__)

# Qwen2's pre-tokenization split (the regex of its tiktoken-derived tokenizer).
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Added by upstream's QwenTokenizer in the order of SPECIAL_TOKENS; the first three already
# exist in CosyVoice-BlankEN, so the rest get 151646 (<|endofprompt|>) ... 151662 ([mn]).
COSYVOICE2_SPECIAL_TOKENS = text_tokens.SPECIAL_TOKENS
# CosyVoice 2's, then <|endofsystem|> (151663) and the CMU and pinyin tokens (to 151923).
COSYVOICE3_SPECIAL_TOKENS = text_tokens.COSYVOICE3_SPECIAL_TOKENS
ENDOFPROMPT_ID = 151646
# The ids of SPECIAL_TOKENS[0] (<|endoftext|>) on: each list's tokens get consecutive ids.
FIRST_SPECIAL_ID = 151643

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def configure_qwen2_pipeline(tokenizer: Tokenizer) -> None:
    """Give ``tokenizer`` Qwen2's normalizer, pre-tokenizer and decoder (shared with training)."""
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()


@dataclass(frozen=True)
class TextTokenizer:
    """Text <-> Qwen2 token ids, with CosyVoice 2's special tokens recognised in the text."""

    tokenizer: Tokenizer

    @classmethod
    def from_dir(
        cls, path: Path, special_tokens: Sequence[str] = COSYVOICE2_SPECIAL_TOKENS
    ) -> "TextTokenizer":
        """Load from a ``CosyVoice-BlankEN`` directory; :class:`ModelDirError` if it does not load.

        ``special_tokens``: :data:`COSYVOICE2_SPECIAL_TOKENS` (CosyVoice 2) or
        :data:`COSYVOICE3_SPECIAL_TOKENS` (CosyVoice 3); they get ids 151643 on."""
        vocab = _read_json(path / VOCAB_FILE)
        config = _read_json(path / TOKENIZER_CONFIG_FILE)
        if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
            raise ModelDirError(f"{path / VOCAB_FILE}: not a JSON object of token -> id")
        merges = _read_merges(path / MERGES_FILE)
        try:
            model = BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False)
        except Exception as exc:  # tokenizers raises plain Exception for inconsistent files
            raise ModelDirError(f"{path}: the BPE vocabulary and merges do not load ({exc})") from None
        tokenizer = Tokenizer(model)
        configure_qwen2_pipeline(tokenizer)
        _add_declared_tokens(tokenizer, config, path)
        tokenizer.add_special_tokens([_special(t) for t in special_tokens])
        if tokenizer.token_to_id(special_tokens[3]) != ENDOFPROMPT_ID:
            raise ModelDirError(
                f"{path}: {special_tokens[3]} would get id "
                f"{tokenizer.token_to_id(special_tokens[3])}, not {ENDOFPROMPT_ID}; "
                "the vocabulary is not CosyVoice-BlankEN's"
            )
        last = FIRST_SPECIAL_ID + len(special_tokens) - 1
        if tokenizer.token_to_id(special_tokens[-1]) != last:
            raise ModelDirError(
                f"{path}: {special_tokens[-1]} would get id {tokenizer.token_to_id(special_tokens[-1])}, "
                f"not {last}; the vocabulary already holds some of CosyVoice's special tokens"
            )
        logger.debug("text tokenizer loaded from %s: %d ids", path, tokenizer.get_vocab_size())
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (151663 for CosyVoice2-0.5B, 151924 for
        Fun-CosyVoice3-0.5B-2512)."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise KeyError(token)
        return int(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS (upstream adds none)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def _special(content: str) -> AddedToken:
    # What transformers' add_special_tokens creates from a plain string.
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)


def _add_declared_tokens(tokenizer: Tokenizer, config: Any, path: Path) -> None:
    """Add tokenizer_config.json's ``added_tokens_decoder`` entries, checking each lands on its id."""
    declared = config.get("added_tokens_decoder", {}) if isinstance(config, dict) else None
    if not isinstance(declared, dict):
        raise ModelDirError(f"{path / TOKENIZER_CONFIG_FILE}: 'added_tokens_decoder' is not an object")
    try:
        entries = sorted((int(k), v) for k, v in declared.items())
        for token_id, spec in entries:
            token = AddedToken(
                spec["content"],
                single_word=bool(spec.get("single_word", False)),
                lstrip=bool(spec.get("lstrip", False)),
                rstrip=bool(spec.get("rstrip", False)),
                normalized=bool(spec.get("normalized", False)),
                special=bool(spec.get("special", False)),
            )
            if token.special:
                tokenizer.add_special_tokens([token])
            else:
                tokenizer.add_tokens([token])
            if tokenizer.token_to_id(spec["content"]) != token_id:
                raise ModelDirError(
                    f"{path / TOKENIZER_CONFIG_FILE}: added token {spec['content']!r} is declared as id "
                    f"{token_id} but lands on {tokenizer.token_to_id(spec['content'])}"
                )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelDirError(
            f"{path / TOKENIZER_CONFIG_FILE}: malformed 'added_tokens_decoder' ({exc!r})"
        ) from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelDirError(f"{path}: tokenizer file not found") from None
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"{path}: not readable JSON ({exc.__class__.__name__})") from None


def _read_merges(path: Path) -> list[tuple[str, str]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ModelDirError(f"{path}: tokenizer file not found") from None
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"{path}: not readable ({exc.__class__.__name__})") from None
    merges: list[tuple[str, str]] = []
    for number, line in enumerate(lines, start=1):
        if not line or line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ModelDirError(f"{path}:{number}: a merge must be two tokens separated by one space")
        merges.append((parts[0], parts[1]))
    return merges
