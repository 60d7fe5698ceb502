import pytest
import torch

from cosyserve.models.int8_rows import (
    Int8Rows,
    as_dtype,
    copy_head,
    head,
    held_tensors,
    new_held,
    read_into,
    row_bytes,
    write_held,
)


def _rows(capacity: int = 8) -> Int8Rows:
    return Int8Rows.empty((2, 3, capacity, 16), torch.device("cpu"))


def test_each_row_comes_back_within_half_a_step_of_its_own_scale() -> None:
    rows = _rows()
    new = torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(0))
    new[0, 0, 1] *= 1000  # one loud row costs the others no precision
    written = new.clone()
    rows.write(2, new)
    assert torch.equal(new, written)  # the input is not changed
    got = rows.head(7).dequantized(torch.float32)[:, :, 2:]
    step = new.abs().amax(-1, keepdim=True) / 127
    assert bool(((got - new).abs() <= step / 2 + 1e-6 * step).all())
    assert float((got - new)[0, 0, 0].abs().max()) < 0.02
    assert rows.data.dtype == torch.int8 and int(rows.data[:, :, 2:7].abs().max()) == 127


def test_a_zero_row_comes_back_zero_in_any_dtype() -> None:
    rows = _rows()
    rows.write(0, torch.zeros(2, 3, 1, 16))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = rows.head(1).dequantized(dtype)
        assert got.dtype == dtype and not bool(got.any())


def test_held_helpers_treat_tensors_and_int8_rows_alike() -> None:
    new = torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(1))
    plain = new_held((2, 3, 8, 16), torch.float32, torch.device("cpu"))
    packed = new_held((2, 3, 8, 16), torch.int8, torch.device("cpu"))
    assert isinstance(plain, torch.Tensor) and isinstance(packed, Int8Rows)
    for held in (plain, packed):
        write_held(held, 0, new)
        out = torch.full((2, 3, 6, 16), 7.0)
        read_into(out[:, :, :5], head(held, 5))  # into a view
        assert torch.allclose(out[:, :, :5], new, atol=0.03) and bool((out[:, :, 5] == 7).all())
        grown = new_held((2, 3, 16, 16), torch.int8 if held is packed else torch.float32, torch.device("cpu"))
        copy_head(grown, held, 5)
        assert torch.equal(as_dtype(head(grown, 5), torch.float32), as_dtype(head(held, 5), torch.float32))
    with pytest.raises(TypeError, match="grown buffer"):
        copy_head(plain, packed, 5)


def test_a_clone_and_views_share_nothing_and_everything_as_they_should() -> None:
    rows = _rows()
    rows.write(0, torch.ones(2, 3, 8, 16))
    view, copy = rows.head(4), rows.clone()
    rows.write(0, torch.full((2, 3, 1, 16), -2.0))
    assert float(view.dequantized(torch.float32)[0, 0, 0, 0]) == -2.0
    assert float(copy.dequantized(torch.float32)[0, 0, 0, 0]) == 1.0


def test_memory_is_a_byte_a_value_and_a_float32_scale_a_row() -> None:
    rows = _rows(capacity=10)
    # What the caches count (held_tensors) is what the budgets assume (row_bytes).
    held = sum(t.numel() * t.element_size() for t in held_tensors(rows))
    assert held == 2 * 3 * 10 * row_bytes(16, torch.int8) == 2 * 3 * 10 * (16 + 4)
    assert row_bytes(16, torch.float16) == 32 and row_bytes(16, torch.float32) == 64
