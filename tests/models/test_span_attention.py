"""span_attention: torch's attention, with each row's result the same bits whatever the
span, batch, prefill chunk or number of threads it is computed in."""

import pytest
import torch
import torch.nn.functional as F

from cosyserve.models.span_attention import KEY_BLOCK, attention_bias, padded_span, span_attention

# (heads, key heads, head size): the released LM's, and the tiny test model's.
GEOMETRIES = {"full": (14, 2, 64), "tiny": (4, 2, 32)}
ENDS = (50, 300, 700, 129, 1000)  # each row's length after the step
LONGEST = 1024


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, heads: int, where: object) -> None:
    """The same bits for the released model's geometry. The tiny test model's head size (32)
    gets them on the AMX Xeon but not on a Zen 4, where torch's kernels sum its products in
    another order for other prefill chunks (last bits only; 2026-12-06): there, as close
    as float32 rounding allows."""
    if heads == GEOMETRIES["full"][0]:
        assert torch.equal(got, want), where
    else:
        torch.testing.assert_close(
            got, want, rtol=0, atol=1e-6 if got.dtype == torch.float32 else 1e-2, msg=str(where)
        )


def _mask(ends: list[int] | tuple[int, ...], queries: int, span: int) -> torch.Tensor:
    """(B, 1, T, span): the T queries at the last positions of each row see their past."""
    positions = torch.tensor(ends)[:, None] - queries + torch.arange(queries)  # (B, T)
    return (torch.arange(span)[None, None, :] <= positions[:, :, None])[:, None]


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ends: list[int] | tuple[int, ...],
    span: int,
    in_order: bool = False,
) -> torch.Tensor:
    """Attention over the first ``span`` keys, read as the KV cache hands them out: views."""
    bias = attention_bias(_mask(ends, q.shape[2], span), torch.float32)
    return span_attention(q, keys[:, :, :span], values[:, :, :span], bias, in_order)


@pytest.fixture(params=list(GEOMETRIES.values()), ids=list(GEOMETRIES))
def qkv(request: pytest.FixtureRequest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, kv_heads, size = request.param
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(ENDS), heads, 40, size, generator=gen)
    keys = torch.randn(len(ENDS), kv_heads, LONGEST, size, generator=gen)
    return q, keys, torch.randn(keys.shape, generator=gen)


@pytest.mark.parametrize("queries", [1, 7, 40])
def test_it_is_torchs_attention(qkv: tuple[torch.Tensor, ...], queries: int) -> None:
    q, keys, values = qkv
    q = q[:, :, :queries]
    span = max(ENDS)
    want = F.scaled_dot_product_attention(
        q, keys[:, :, :span], values[:, :, :span], attn_mask=_mask(ENDS, queries, span), enable_gqa=True
    )
    got = _attend(q, keys, values, ENDS, span)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("in_order", [False, True], ids=["tree", "in-order"])
@pytest.mark.parametrize("queries", [1, 3])
def test_a_rows_result_is_the_same_alone_and_over_any_span(
    qkv: tuple[torch.Tensor, ...], queries: int, in_order: bool
) -> None:
    q, keys, values = qkv
    q = q[:, :, :queries]
    batched = _attend(q, keys, values, ENDS, max(ENDS), in_order)
    for row, end in enumerate(ENDS):
        alone = slice(row, row + 1)
        for span in (end, end + 1, min(padded_span(end) + KEY_BLOCK, LONGEST), LONGEST):
            got = _attend(q[alone], keys[alone], values[alone], [end], span, in_order)
            assert torch.equal(got, batched[alone]), (row, span)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_row_gets_the_same_bits_alone_and_in_a_batch_on_any_threads(
    qkv: tuple[torch.Tensor, ...], threads: int
) -> None:
    # What decode steps rely on: one query per row, blocks summed in order, alone or in a
    # batch, on one thread or two. torch's kernel fails this: on 2 Zen 4 cores a float32
    # row alone got other bits than in a batch at the same span.
    q, keys, values = qkv
    q = q[:, :, :1]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = _attend(q, keys, values, ENDS, max(ENDS), in_order=True)
        for row, end in enumerate(ENDS):
            alone = slice(row, row + 1)
            for span in (end, max(ENDS)):
                got = _attend(q[alone], keys[alone], values[alone], [end], span, in_order=True)
                assert torch.equal(got, batched[alone]), (row, span)
    finally:
        torch.set_num_threads(before)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning")
def test_a_trace_over_one_block_replays_any_span() -> None:
    # The engine's traced decode steps are recorded over one block of keys.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 14, 1, 64, generator=gen)
    keys, values = (torch.randn(2, 2, 512, 64, generator=gen) for _ in range(2))
    ends = [40, 30]

    def inputs(span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return keys[:, :, :span], values[:, :, :span], attention_bias(_mask(ends, 1, span), torch.float32)

    def call(keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return span_attention(q, keys, values, bias, in_order=True)

    traced = torch.jit.trace(call, inputs(KEY_BLOCK), check_trace=False)
    for span in (KEY_BLOCK, 3 * KEY_BLOCK, 512):
        assert torch.equal(traced(*inputs(span)), call(*inputs(span))), span


def test_a_query_gets_the_same_bits_in_any_prefill_chunk(qkv: tuple[torch.Tensor, ...]) -> None:
    q, keys, values = qkv
    whole = _attend(q, keys, values, ENDS, LONGEST)  # 40 queries a row: run in tiles
    for start, stop in ((0, 17), (17, 39), (39, 40)):
        ends = [end - 40 + stop for end in ENDS]
        chunk = _attend(q[:, :, start:stop], keys, values, ends, max(ends))
        _assert_same_bits(chunk, whole[:, :, start:stop], q.shape[1], (start, stop))


@pytest.mark.parametrize("geometry", list(GEOMETRIES.values()), ids=list(GEOMETRIES))
def test_a_long_causal_chunk_gives_each_query_the_bits_of_a_short_one(geometry: tuple[int, int, int]) -> None:
    # 300 queries from position 0: run in tiles, the early ones reading fewer key blocks.
    heads, kv_heads, size = geometry
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, heads, 300, size, generator=gen)
    keys, values = (torch.randn(1, kv_heads, 300, size, generator=gen) for _ in range(2))
    whole = _attend(q, keys, values, [300], 300)
    for start, stop in ((0, 1), (1, 70), (70, 300)):
        chunk = _attend(q[:, :, start:stop], keys, values, [stop], stop)
        assert torch.equal(chunk, whole[:, :, start:stop]), (start, stop)


def test_bfloat16_inputs_are_attended_in_float32() -> None:
    gen = torch.Generator().manual_seed(1)
    q, keys, values = (torch.randn(1, 14, 1, 64, generator=gen) for _ in range(3))
    keys, values = keys.view(1, 2, 7, 64), values.view(1, 2, 7, 64)
    bias = attention_bias(torch.ones(1, 1, 1, 7, dtype=torch.bool), torch.float32)
    got = span_attention(q.bfloat16(), keys.bfloat16(), values.bfloat16(), bias)
    assert got.dtype == torch.bfloat16
    want = span_attention(q.bfloat16().float(), keys.bfloat16().float(), values.bfloat16().float(), bias)
    assert torch.equal(got, want.bfloat16())


def test_the_bias_hides_the_padding_to_whole_blocks() -> None:
    mask = torch.tensor([[True, False, True]])[None, None]  # (1, 1, 1, 3)
    bias = attention_bias(mask, torch.float32)
    assert bias.shape == (1, 1, 1, KEY_BLOCK)
    assert bias[0, 0, 0, :3].tolist() == [0.0, float("-inf"), 0.0]
    assert bool((bias[..., 3:] == float("-inf")).all())


def test_refuses_a_bias_that_does_not_pad_the_keys_to_whole_blocks() -> None:
    q, keys = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 70, 8)
    with pytest.raises(ValueError, match="whole blocks"):
        span_attention(q, keys, keys, torch.zeros(1, 1, 1, KEY_BLOCK))
