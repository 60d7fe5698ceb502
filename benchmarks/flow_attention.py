"""The flow's bf16 attention on CPU: torch's fused kernel against the split one
(``cosyserve.models.flow.attention``), in time and in error against float32.

    python benchmarks/flow_attention.py /tmp/cv2-full-bench --sharpen 1,4

For each ``--sharpen`` factor the estimator's query weights are multiplied by it (sharper
attention than the random model's, as a trained model may have), a float32 mel is made
as the reference, and the same flow in bf16 runs non-streaming over a 3 s prompt + 6 s of
tokens with each kernel, ``--repeats`` times (the fastest is kept). Prints one line per
run: kernel, seconds, mel max / mean |error| against float32, and the scores' std.
"""

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_args import add_workload_args  # benchmarks/, the script's own directory
from flow_streaming import load_flow  # benchmarks/, the script's own directory
from torch import Tensor

from cosyserve.models.flow import Flow, attention, blocks, conformer
from cosyserve.models.flow.blocks import SelfAttention

Kernel = Callable[..., Tensor]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--sharpen", default="1,4", help="comma-separated query-weight factors")
    add_workload_args(parser)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}, torch {torch.__version__}")
    for factor in (float(f) for f in args.sharpen.split(",")):
        flow = load_flow(args.model_dir, "full", 0)  # the flow alone, from flow.pt
        with torch.no_grad():
            for module in flow.modules():
                if isinstance(module, SelfAttention):
                    module.q.weight.mul_(factor)
        inputs = _inputs(flow, args.prompt, args.tokens)
        stds: list[float] = []
        _use(_probing(stds))
        reference = _mel(flow, inputs)
        _use(attention.attention)
        low = flow.to(torch.bfloat16)
        for name, kernel in (("fused", _fused), ("split", attention.split_attention)):
            _use(kernel)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                mel = _mel(low, inputs)
                times.append(time.perf_counter() - start)
            error = (mel - reference).abs()
            print(
                f"sharpen {factor:g}: {name} {min(times):.2f} s, mel max {error.max():.4f} "
                f"mean {error.mean():.5f} (fp32 mel std {reference.std():.3f}; "
                f"estimator scores' std, median {statistics.median(stds):.2f})",
                flush=True,
            )
    _use(attention.attention)


def _inputs(flow: Flow, prompt: int, tokens: int) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(7)
    vocab = flow.cfg.vocab_size
    return (
        torch.randint(0, vocab, (1, tokens), generator=gen),
        torch.randint(0, vocab, (1, prompt), generator=gen),
        torch.randn(1, 2 * prompt, 80, generator=gen) * 2.0 - 6.0,
        torch.randn(1, flow.cfg.spk_embed_dim, generator=gen),
    )


def _mel(flow: Flow, inputs: tuple[Tensor, ...]) -> Tensor:
    with torch.inference_mode():
        token, prompt, prompt_feat, embedding = inputs
        return flow.inference(token, prompt, prompt_feat, embedding, streaming=False, finalize=True).float()


def _use(kernel: Kernel) -> None:
    # The layers call the name their modules imported: replace it there.
    for module in (blocks, conformer):
        module.__dict__["attention"] = kernel


def _fused(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, scale: float | None = None) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def _probing(stds: list[float]) -> Kernel:
    """The fused kernel, noting the std of the estimator's long score matrices."""

    def kernel(
        q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, scale: float | None = None
    ) -> Tensor:
        if scale is None and q.shape[-2] > 100:
            scores = q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
            stds.append(scores.std().item())
        return _fused(q, k, v, bias, scale)

    return kernel


if __name__ == "__main__":
    main()
