"""What ``cosyserve synth`` reports about one synthesis: where the time went.

Seconds are wall-clock. ``wall`` runs from the first frontend call to the last sample
(the model load is reported apart); LM, flow and HiFT seconds come from the engine's own
counters, taken as the difference of two :class:`EngineStats` snapshots around the run.
"""

from dataclasses import dataclass
from typing import Any

from cosyserve.engine.stats import EngineStats


@dataclass(frozen=True)
class StageCounters:
    """What the engine did between two stats snapshots."""

    prefill_s: float
    prefill_positions: int
    decode_s: float
    decode_steps: int
    flow_s: float
    flow_calls: int
    hift_s: float
    hift_calls: int

    @classmethod
    def between(cls, before: EngineStats, after: EngineStats) -> "StageCounters":
        return cls(
            prefill_s=after.prefill_s - before.prefill_s,
            prefill_positions=after.prefill_tokens - before.prefill_tokens,
            decode_s=after.decode_s - before.decode_s,
            decode_steps=after.decoded_tokens - before.decoded_tokens,
            flow_s=after.flow_s - before.flow_s,
            flow_calls=after.flow_calls - before.flow_calls,
            hift_s=after.hift_s - before.hift_s,
            hift_calls=after.hift_calls - before.hift_calls,
        )


@dataclass(frozen=True)
class SynthReport:
    """One run of ``cosyserve synth``.

    ``first_chunk_s``: from the start of the frontend to the first audio a caller gets
    (for a non-streaming request, the whole audio: equal to ``wall_s``).
    ``prompt_features_s``: prompt/source audio decoding, speech tokens, speaker embedding
    and prompt mel (and the prompt transcript's normalisation).
    ``text_frontend_s``: normalising and splitting the text to speak.
    ``peak_rss_mib``: the process's peak resident memory, model load included.
    ``precision``: how the model was loaded (``Precision.describe()``); ``plan``: the whole
    speed plan (``Plan.describe()``); ``kv_cache_dtype``: the dtype of the engine's KV cache
    tensors (e.g. ``bfloat16``).
    """

    output: str
    mode: str
    stream: bool
    seed: int
    sample_rate: int
    audio_s: float
    chunks: int
    first_chunk_audio_s: float
    wall_s: float
    first_chunk_s: float
    model_load_s: float
    prompt_features_s: float
    text_frontend_s: float
    engine: StageCounters
    peak_rss_mib: float
    precision: str
    plan: str
    kv_cache_dtype: str

    @property
    def rtf(self) -> float | None:
        """Real-time factor: wall seconds per second of audio (None without audio)."""
        return self.wall_s / self.audio_s if self.audio_s > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        e = self.engine
        return e.decode_steps / e.decode_s if e.decode_s > 0 else None

    @property
    def frontend_s(self) -> float:
        return self.prompt_features_s + self.text_frontend_s

    @property
    def other_s(self) -> float:
        """Wall time outside the measured stages (scheduling, chunk bookkeeping, ...)."""
        e = self.engine
        return self.wall_s - self.frontend_s - e.prefill_s - e.decode_s - e.flow_s - e.hift_s

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``cosyserve synth --json``)."""
        e = self.engine
        return {
            "output": self.output,
            "mode": self.mode,
            "stream": self.stream,
            "seed": self.seed,
            "sample_rate": self.sample_rate,
            "audio_s": self.audio_s,
            "chunks": self.chunks,
            "first_chunk_audio_s": self.first_chunk_audio_s,
            "wall_s": self.wall_s,
            "rtf": self.rtf,
            "first_chunk_s": self.first_chunk_s,
            "stages": {
                "model_load_s": self.model_load_s,
                "frontend_s": self.frontend_s,
                "prompt_features_s": self.prompt_features_s,
                "text_frontend_s": self.text_frontend_s,
                "lm_prefill_s": e.prefill_s,
                "lm_decode_s": e.decode_s,
                "flow_s": e.flow_s,
                "hift_s": e.hift_s,
                "other_s": self.other_s,
            },
            "counters": {
                "prefill_positions": e.prefill_positions,
                "decode_steps": e.decode_steps,
                "decode_tokens_per_s": self.decode_tokens_per_s,
                "flow_calls": e.flow_calls,
                "hift_calls": e.hift_calls,
            },
            "peak_rss_mib": self.peak_rss_mib,
            "precision": self.precision,
            "plan": self.plan,
            "kv_cache_dtype": self.kv_cache_dtype,
        }

    def lines(self) -> list[str]:
        """The human-readable form."""
        e = self.engine
        how = f"stream, {_count(self.chunks, 'chunk')}" if self.stream else "non-stream"
        rtf = f"{self.rtf:.3f}" if self.rtf is not None else "n/a"
        tps = f", {self.decode_tokens_per_s:.2f} tok/s" if self.decode_tokens_per_s is not None else ""
        first = f"first chunk {self.first_chunk_s:.3f} s"
        if self.stream:
            first += f" ({self.first_chunk_audio_s:.2f} s of audio)"
        return [
            f"wrote {self.output}: {self.audio_s:.2f} s of audio at {self.sample_rate} Hz "
            f"({self.mode}, {how}, seed {self.seed})",
            f"wall {self.wall_s:.3f} s  RTF {rtf}  {first}",
            f"  model load  {self.model_load_s:9.3f} s  (not in wall; {self.precision}, "
            f"KV cache {self.kv_cache_dtype})",
            f"  plan        {self.plan}",
            f"  frontend    {self.frontend_s:9.3f} s  "
            f"(prompt features {self.prompt_features_s:.3f} s, text {self.text_frontend_s:.3f} s)",
            f"  LM prefill  {e.prefill_s:9.3f} s  ({e.prefill_positions} positions)",
            f"  LM decode   {e.decode_s:9.3f} s  ({_count(e.decode_steps, 'step')}{tps})",
            f"  flow        {e.flow_s:9.3f} s  ({_count(e.flow_calls, 'call')})",
            f"  HiFT        {e.hift_s:9.3f} s  ({_count(e.hift_calls, 'call')})",
            f"  other       {self.other_s:9.3f} s",
            f"peak RSS {self.peak_rss_mib:.0f} MiB",
        ]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
