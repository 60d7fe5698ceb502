"""The tests' check on requests run alone and together (the runs: cosyserve.bench.engine_runs)."""

import numpy as np

from cosyserve.bench.engine_runs import Results


def assert_same(results: Results, reference: Results, ids: list[str]) -> None:
    for request_id in ids:
        got, want = results[request_id], reference[request_id]
        assert got.error is None and want.error is None, (request_id, got.error, want.error)
        assert got.finished and want.finished
        assert got.tokens is not None and len(got.tokens) > 0
        assert got.tokens == want.tokens, request_id
        assert got.audio.shape == want.audio.shape, request_id
        assert float(np.abs(got.audio - want.audio).max()) <= 1e-4, request_id
