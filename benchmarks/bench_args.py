"""Command-line arguments that benchmark scripts share."""

import argparse
from pathlib import Path


def model_parser(doc: str | None) -> argparse.ArgumentParser:
    """The parser of a script described by ``doc`` that loads a model directory as the
    server does: ``--model-dir``, ``--dtype`` (bf16) and ``--quantize`` (int8); and
    ``--json``, a file the script also writes its report to."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--json", type=Path)
    return parser


def add_workload_args(parser: argparse.ArgumentParser, *, first_hop: bool = False) -> None:
    """The workload of docs/benchmarks.md: ``--prompt`` speech tokens (75: 3 s) and
    ``--tokens`` speech tokens (150: 6 s of audio); with ``first_hop``, a stream's
    ``--first-hop`` tokens before its first chunk (5)."""
    parser.add_argument("--prompt", type=int, default=75, help="prompt speech tokens (3 s)")
    parser.add_argument("--tokens", type=int, default=150, help="speech tokens (6 s of audio)")
    if first_hop:
        parser.add_argument("--first-hop", type=int, default=5)
