"""A long prompt is prefilled in chunks and never holds up the others' decode."""

from cosyserve.bench.engine_runs import RequestResult, collect, drain, make_engine, run_alone
from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import Phase
from tests.engine.helpers import assert_same


def test_long_prefill_runs_in_chunks_while_others_decode(tiny_model: LoadedModel) -> None:
    hp = tiny_model.hparams
    chunk = 16
    short = synthetic_spec(
        "short", synthetic_voice(hp, 0.4, seed=1), synthetic_text_ids(hp, 40, seed=1), tokens=40, seed=7
    )
    long_voice = synthetic_voice(hp, 14.0, seed=2)  # 350 prompt speech tokens + 56 text ids
    long = synthetic_spec("long", long_voice, synthetic_text_ids(hp, 10, seed=2), tokens=10, seed=8)
    engine = make_engine(tiny_model, max_active=2, prefill_chunk=chunk, max_len=1024)
    results: dict[str, RequestResult] = {}
    engine.add(short)
    while not [r for r in engine.scheduler.running if r.phase is Phase.DECODE]:
        collect(engine.step(), results)
    engine.add(long)
    collect(engine.step(), results)  # admits it and feeds its first chunk
    decoding = next(r for r in engine.scheduler.running if r.id == "short")
    prefilling = next(r for r in engine.scheduler.running if r.id == "long")
    assert prefilling.prefill_input is not None
    total = prefilling.prefill_input.shape[0]
    prefill_steps = 0
    while prefilling.phase is Phase.PREFILL:
        tokens, fed = len(decoding.lm_state.tokens), prefilling.prefill_pos
        prefill_tokens = engine.stats.prefill_tokens
        collect(engine.step(), results)
        prefill_steps += 1
        assert len(decoding.lm_state.tokens) == tokens + 1, "the decoding request missed a step"
        assert engine.stats.prefill_tokens - prefill_tokens <= chunk
        assert (
            prefilling.prefill_pos - fed == min(chunk, total - fed) or prefilling.phase is not Phase.PREFILL
        )
    assert prefill_steps >= total // chunk - 1 >= 20
    assert prefilling.lm_state.tokens  # its first token came with its last chunk
    engine.abort("long")  # spare the flow its long prompt
    drain(engine, results)
    alone = run_alone(tiny_model, [short])
    assert results["short"].error is None
    assert results["short"].tokens == alone["short"].tokens


def test_with_nothing_decoding_prompts_go_in_whole_and_start_decoding_together(
    tiny_model: LoadedModel,
) -> None:
    hp = tiny_model.hparams
    voice = synthetic_voice(hp, 3.0, seed=3)  # 75 prompt speech tokens: several chunks of 16
    specs = [
        synthetic_spec(f"r{i}", voice, synthetic_text_ids(hp, 20, seed=i), tokens=20, seed=i)
        for i in range(3)
    ]
    engine = make_engine(tiny_model, max_active=3, prefill_chunk=16)
    for spec in specs:
        engine.add(spec)
    results: dict[str, RequestResult] = {}
    collect(engine.step(), results)
    assert [r.phase for r in engine.scheduler.running] == [Phase.DECODE] * 3
    assert engine.stats.prefill_tokens > 3 * 75
    drain(engine, results)
    assert_same(results, run_alone(tiny_model, specs), [s.request_id for s in specs])
