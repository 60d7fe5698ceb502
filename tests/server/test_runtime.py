"""``ServerRuntime``: the plan (profile and explicit choices) and the engine settings reach
the model, the engine's KV cache and its configuration."""

import asyncio
import os
from pathlib import Path

import pytest
import torch

from cosyserve.server.runtime import Phase, ServerRuntime
from cosyserve.server.settings import Settings


def test_bf16_setting_loads_a_bf16_model_with_a_bf16_kv_cache(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("COSYSERVE_")]:
        monkeypatch.delenv(name)
    settings = Settings.load(
        model_dir=tiny_model_dir,
        grpc_port=0,
        voices_db=tmp_path / "voices.sqlite3",
        profile="exact",
        dtype="bf16",
        flow_prompt_cache_mb=7,
        max_active=3,
        max_queued=5,
    )
    runtime = ServerRuntime(settings)

    async def start_and_stop() -> None:
        await runtime.start()
        try:
            assert runtime.phase is Phase.READY  # the warm-up synthesis ran in bf16
            service = runtime.require_service()
            # It took a streamed chunk and a final one through the flow and the vocoder.
            stats = service.engine.engine.stats
            assert (stats.flow_rows, stats.hift_rows) == (2, 2)
            assert next(service.model.flow.parameters()).dtype == torch.bfloat16
            cache = service.engine.engine.lm_runner.cache
            assert cache.k.dtype == cache.v.dtype == torch.bfloat16
            config = service.engine.engine.config
            # The exact profile's flow cache and schedule, the operator's budget and limits.
            assert (config.flow_cache, config.hop_growth, config.flow_prompt_cache_mb) == ("cached", True, 7)
            assert (config.max_active, config.max_waiting, service.engine.admission.capacity) == (3, 5, 8)
            assert runtime.plan is not None and runtime.plan.precision.dtype == "bf16"
        finally:
            await runtime.stop()

    asyncio.run(start_and_stop())
