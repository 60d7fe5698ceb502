"""Command-line arguments that benchmark scripts share."""

import argparse
from pathlib import Path


def model_parser(doc: str | None) -> argparse.ArgumentParser:
    """The parser of a script described by ``doc`` that loads a model directory as the
    server does: ``--model-dir``, ``--dtype`` (bf16) and ``--quantize`` (int8)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--quantize", default="int8")
    return parser
