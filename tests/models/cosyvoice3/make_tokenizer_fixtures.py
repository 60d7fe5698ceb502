"""Make the CosyVoice 3 text tokenizer fixture from upstream FunAudioLLM/CosyVoice at commit ace7c47.

Command (from the repository root)::

    COSYVOICE3_UPSTREAM=/tmp/upstream COSYVOICE3_SITE=/tmp/upv3-site \\
        .venv/bin/python -m tests.models.cosyvoice3.make_tokenizer_fixtures

Writes the ``CosyVoice-BlankEN`` tokenizer files exactly as ``cosyserve model init`` does
(:func:`~cosyserve.modeldir.qwen_files.write_tokenizer_files`, deterministic), loads them
with upstream's ``get_qwen_tokenizer(..., version='cosyvoice3')`` (``CosyVoice3Tokenizer``:
``AutoTokenizer.from_pretrained`` + its special-token list) and saves, for each text of
:data:`TEXTS`, upstream's ids and its decoding of them (special tokens skipped), plus the
vocabulary size and the id of every added token, to ``fixtures/tokenizer.json``.
"""

import json
import tempfile
import unicodedata
from pathlib import Path

from cosyserve.modeldir.qwen_files import write_tokenizer_files
from tests.upstream3 import UPSTREAM_COMMIT, upstream3

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer.json"

TEXTS = [
    "希望你以后能够做的比我还好呦。",
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant.<|endofprompt|>希望你以后能够做的比我还好呦。",
    "You are a helpful assistant. 请用广东话表达。<|endofprompt|>",
    "高管也通过电话、短信、微信等方式对报道[j][ǐ]予好评。",
    "你[h][ǎo]，今天[t][iān]气很好。",
    "[h][ǎo][ni][h][ǎo]",
    "[zh][uāng][ch][uáng][sh][ì][r][én][x][iǎng][l][ǜ][n][ǚ][vè]",
    "Say [HH][AH0][L][OW1] to the world.",
    "The word [R][EH1][K][ER0][D] has stress[AA2][ZH][NG].",
    "[AA][AA0][AA1][AA2] [a][ai][an][ang] [i][ian][in][ing]",
    "[breath]因为他们那一辈人[breath]在乡里面住的要习惯一点，[breath]邻居都很活络。",
    "You are a helpful assistant.<|endofprompt|>[breath]Hello[laughter] there[noise]!",
    "<|im_start|>system<|endofsystem|><|im_end|><|endoftext|>",
    "Mixed 中文 and English with [HH][AH0] and [h][ǎo] and <strong>重点</strong>.",
    # Decomposed (NFD) tone marks are not the added token's text: they reach the BPE.
    unicodedata.normalize("NFD", "[h][ǎo]"),
    "[unknown] [AA3] [Aa] [ ǎo] [ǎo ]",
    "",
]


def main() -> None:
    module = upstream3("cosyvoice.tokenizer.tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer_files(Path(tmp))
        theirs = module.get_qwen_tokenizer(tmp, skip_special_tokens=True, version="cosyvoice3")
        added = theirs.special_tokens["additional_special_tokens"]
        cases = []
        for text in TEXTS:
            ids = theirs.encode(text)
            cases.append({"text": text, "ids": ids, "decoded": theirs.decode(ids)})
        fixture = {
            "upstream_commit": UPSTREAM_COMMIT,
            "vocab_size": len(theirs.tokenizer),
            "added_token_ids": {t: theirs.tokenizer.convert_tokens_to_ids(t) for t in added},
            "cases": cases,
        }
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size / 1e3:.1f} kB)")


if __name__ == "__main__":
    main()
