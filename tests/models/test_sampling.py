"""Repetition-aware sampling: token-for-token parity with upstream and the length rules."""

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from cosyserve.errors import InvalidRequestError
from cosyserve.modeldir.hparams import LMConfig, SamplingConfig
from cosyserve.models.sampling import (
    UNIFORMS_PER_STEP,
    LengthLimits,
    draw_uniforms,
    inverse_cdf,
    ras_draw,
    running_sums,
    sample_token,
    sample_tokens,
    stable_top_k,
)
from tests.upstream import upstream

V = 6564
CFG = SamplingConfig()
LM = LMConfig()
EOS = 6561
U_MAX = 1.0 - 2.0**-53  # the largest uniform torch.rand can return in float64


@dataclass
class ScriptedMultinomial:
    """Stands in for ``Tensor.multinomial`` in upstream: an inverse-CDF draw on scripted
    uniforms (written independently of :func:`inverse_cdf`), recording each call."""

    uniforms: list[float] = field(default_factory=list)
    calls: list[tuple[int, int]] = field(default_factory=list)  # (len(weights), index drawn)

    def __call__(self, weights: torch.Tensor, num_samples: int, replacement: bool = False) -> torch.Tensor:
        u = self.uniforms.pop(0)
        cum = weights.double().cumsum(0)
        index = int((cum <= u * cum[-1]).sum())
        index = min(index, int(torch.nonzero(weights > 0).max()))
        self.calls.append((weights.numel(), index))
        return torch.tensor([index])


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> ScriptedMultinomial:
    fake = ScriptedMultinomial()
    # A plain function (an instance would not bind to the tensor as ``self``).
    monkeypatch.setattr(torch.Tensor, "multinomial", lambda t, n, replacement=False: fake(t, n, replacement))
    return fake


def upstream_ras(cfg: SamplingConfig) -> Callable[[torch.Tensor, list[int]], int]:
    common = upstream("cosyvoice.utils.common")

    def run(log_probs: torch.Tensor, history: list[int]) -> int:
        top = common.ras_sampling(
            log_probs.clone(), history, 25, cfg.top_p, cfg.top_k, cfg.win_size, cfg.tau_r
        )
        return int(top)

    return run


def _windows(histories: list[list[int]], win: int) -> torch.Tensor:
    return torch.tensor([h[-win:] + [-1] * (win - len(h[-win:])) for h in histories])


@dataclass
class Case:
    log_probs: torch.Tensor  # (V,)
    history: list[int]
    uniforms: tuple[float, float]
    cfg: SamplingConfig = CFG


def _random_cases(n: int, gen: torch.Generator) -> list[Case]:
    """Peaked and flat distributions, quantised logits (ties), histories that often
    repeat a likely token (fallback), and extreme uniforms (first / last kept token)."""
    cases = []
    for i in range(n):
        scale = [0.5, 2.0, 4.0, 8.0][i % 4]
        logits = torch.randn(V, generator=gen) * scale
        if i % 3 == 0:
            logits = torch.round(logits * 2) / 2  # many exact ties
        log_probs = logits.log_softmax(-1)
        length = int(torch.randint(0, 15, (1,), generator=gen))
        history = torch.randint(0, 6561, (length,), generator=gen).tolist()
        if i % 2 == 0:
            # Recent likely tokens: the nucleus draw often repeats one of them.
            history += log_probs.topk(3).indices.tolist()
        u = torch.rand(2, generator=gen, dtype=torch.float64).tolist()
        if i % 5 == 0:
            u[0] = U_MAX
        elif i % 5 == 1:
            u[0] = 0.0
        cases.append(Case(log_probs, history, (u[0], u[1])))
    return cases


def _exact_boundary_cases() -> list[Case]:
    """m equally likely tokens (exact powers of two) and a top_p that the running sum hits
    exactly: the token after the sum reaches top_p must not be kept."""
    cases = []
    for m, top_p in [(4, 0.75), (8, 0.5), (16, 0.25), (32, 0.625), (4, 0.8)]:
        ids = torch.linspace(3, V - 1, m).long()
        log_probs = torch.full((V,), float("-inf"))
        log_probs[ids] = 0.0
        cfg = SamplingConfig(top_p=top_p, top_k=25)
        cases += [Case(log_probs, [], (u, 0.5), cfg) for u in (0.0, 0.37, U_MAX)]
    return cases


def _run_both(case: Case, scripted: ScriptedMultinomial) -> tuple[int, int]:
    scripted.uniforms = list(case.uniforms)
    scripted.calls.clear()
    theirs = upstream_ras(case.cfg)(case.log_probs, case.history)
    ours = ras_draw(
        case.log_probs[None],
        _windows([case.history], case.cfg.win_size),
        torch.tensor([case.uniforms], dtype=torch.float64),
        case.cfg,
    )
    return int(ours[0]), theirs


@pytest.mark.parity
def test_ras_draw_matches_upstream_token_for_token(scripted: ScriptedMultinomial) -> None:
    gen = torch.Generator().manual_seed(1234)
    fallbacks = crossing_drawn = tied_kept = 0
    for case in _random_cases(240, gen):
        ours, theirs = _run_both(case, scripted)
        assert ours == theirs, case
        kept, index = scripted.calls[0]
        fallbacks += len(scripted.calls) == 2
        crossing_drawn += kept < case.cfg.top_k and index == kept - 1
        top = case.log_probs.sort(descending=True).values[:kept]
        tied_kept += bool((top[1:] == top[:-1]).any())
    # The cases must actually exercise the branches that can go wrong.
    assert fallbacks >= 30
    assert crossing_drawn >= 20
    assert tied_kept >= 30


@pytest.mark.parity
def test_ras_draw_matches_upstream_at_exact_top_p_boundaries(scripted: ScriptedMultinomial) -> None:
    for case in _exact_boundary_cases():
        ours, theirs = _run_both(case, scripted)
        assert ours == theirs, case
        kept = scripted.calls[0][0]
        if case.cfg.top_p != 0.8:
            m = int(torch.isfinite(case.log_probs).sum())
            assert kept == round(case.cfg.top_p * m)  # the sum reaches top_p on the last kept token


@pytest.mark.parity
def test_masked_eos_matches_upstream_on_masked_scores(scripted: ScriptedMultinomial) -> None:
    """Below the minimum length we forbid eos by masking it, as current upstream's
    ``sampling_ids`` does before calling ``ras_sampling``."""
    gen = torch.Generator().manual_seed(7)
    limits = LengthLimits.for_text(5, LM)
    eos_would_win = 0
    for _ in range(60):
        logits = torch.randn(V, generator=gen) * 3
        logits[EOS] = logits.max() + float(torch.rand(1, generator=gen)) * 3
        log_probs = logits.log_softmax(-1)
        masked = log_probs.clone()
        masked[EOS] = float("-inf")
        seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        u = torch.rand(UNIFORMS_PER_STEP, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        scripted.uniforms = u.tolist()
        theirs = upstream_ras(CFG)(masked, [])
        ours = sample_token(log_probs, [], torch.Generator().manual_seed(seed), limits, CFG)
        assert ours == theirs != EOS
        scripted.uniforms = u.tolist()
        eos_would_win += upstream_ras(CFG)(log_probs, []) == EOS
    assert eos_would_win >= 10


def test_batched_sampling_equals_per_row_sampling() -> None:
    gen = torch.Generator().manual_seed(3)
    b = 6
    scales = torch.tensor([0.5, 1, 2, 4, 8, 16])[:, None]
    log_probs = (torch.randn(b, V, generator=gen) * scales).log_softmax(-1)
    histories = [torch.randint(0, 40, (n,), generator=gen).tolist() for n in (0, 3, 10, 12, 1, 20)]
    limits = [LengthLimits.for_text(3, LM), LengthLimits.forced(4, 9, LM)] * 3
    seeds = list(range(100, 100 + b))
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    batched = sample_tokens(log_probs, histories, generators, limits, CFG)
    single = [
        sample_token(log_probs[i], histories[i], torch.Generator().manual_seed(seeds[i]), limits[i], CFG)
        for i in range(b)
    ]
    assert batched.tolist() == single


def test_randomness_comes_only_from_the_request_generator() -> None:
    log_probs = torch.randn(V).log_softmax(-1)
    limits = LengthLimits.for_text(10, LM)
    global_state = torch.random.get_rng_state()
    first = [sample_token(log_probs, [], torch.Generator().manual_seed(5), limits, CFG) for _ in range(3)]
    assert torch.equal(torch.random.get_rng_state(), global_state)
    assert len(set(first)) == 1
    gen = torch.Generator().manual_seed(5)
    sample_token(log_probs, [], gen, limits, CFG)
    expected = torch.Generator().manual_seed(5)
    torch.rand(UNIFORMS_PER_STEP, generator=expected, dtype=torch.float64)
    assert torch.equal(gen.get_state(), expected.get_state())  # exactly two uniforms per step


def test_draw_uniforms_reads_each_generator_in_turn() -> None:
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    u = draw_uniforms(gens, torch.device("cpu"))
    assert u.shape == (2, UNIFORMS_PER_STEP) and u.dtype == torch.float64
    assert torch.equal(u[1], torch.rand(2, generator=torch.Generator().manual_seed(2), dtype=torch.float64))


def test_inverse_cdf_edges() -> None:
    weights = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.0]] * 4)
    uniforms = torch.tensor([0.0, 0.39, 0.41, U_MAX], dtype=torch.float64)
    assert inverse_cdf(weights, uniforms).tolist() == [1, 1, 3, 3]


def test_text_limits_follow_upstream_ratios_and_mask_only_eos() -> None:
    limits = LengthLimits.for_text(7, LM)
    assert (limits.min_tokens, limits.max_tokens) == (14, 140)
    assert limits.stop_ids == (6561, 6562, 6563)
    assert limits.masked_ids(13) == (6561,)
    assert limits.masked_ids(14) == ()


def test_forced_limits_mask_every_stop_id() -> None:
    limits = LengthLimits.forced(3, 3, LM)
    assert limits.masked_ids(2) == (6561, 6562, 6563)
    assert limits.masked_ids(3) == ()
    # A model that only wants to stop still cannot before min_tokens.
    log_probs = torch.full((V,), -30.0)
    log_probs[6561:] = 0.0
    gen = torch.Generator().manual_seed(0)
    assert all(sample_token(log_probs, [], gen, limits, CFG) < 6561 for _ in range(20))


@pytest.mark.parametrize(("lo", "hi"), [(-1, 3), (4, 3)])
def test_invalid_limits_are_request_errors(lo: int, hi: int) -> None:
    with pytest.raises(InvalidRequestError, match="token limits"):
        LengthLimits.forced(lo, hi, LM)


@pytest.mark.parametrize(
    "cfg", [SamplingConfig(top_k=0), SamplingConfig(top_p=0.0), SamplingConfig(win_size=0)]
)
def test_invalid_sampling_options_are_request_errors(cfg: SamplingConfig) -> None:
    with pytest.raises(InvalidRequestError, match="invalid sampling options"):
        sample_token(torch.zeros(V), [], torch.Generator(), LengthLimits.for_text(1, LM), cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stable_top_k_is_the_stable_sorts_head(dtype: torch.dtype) -> None:
    """Ties (coarse logits), zeros (masked ids) and a row of one value keep id order."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, V, generator=gen, dtype=dtype)
    logits[1] = torch.round(logits[1] * 2) / 2  # many equal probabilities
    logits[2, ::3] = float("-inf")  # zeros
    logits[3] = 0.0  # every probability equal
    logits[4, :30] = 5.0  # the top k all tied, more of them than k
    probs = logits.softmax(-1)
    want_values, want_ids = probs.sort(dim=-1, descending=True, stable=True)
    for k in (1, 25, 40):
        values, ids = stable_top_k(probs, k)
        assert torch.equal(ids, want_ids[:, :k]) and torch.equal(values, want_values[:, :k])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_running_sums_add_one_value_at_a_time_in_their_dtype(dtype: torch.dtype) -> None:
    """As upstream's loop adds: the last row's sums differ where the additions are rounded
    one by one (1 + e + e stays 1 in float32) from a sum kept in float64 and rounded once."""
    gen = torch.Generator().manual_seed(8)
    tiny = 2.0**-24 if dtype == torch.float32 else 2.0**-53
    spread = torch.rand(4, 25, generator=gen, dtype=dtype) / 25
    rows = torch.cat([spread, torch.full((1, 25), tiny, dtype=dtype)])
    rows[-1, 0] = 1.0
    loop = [rows[:, 0]]
    for i in range(1, rows.shape[1]):
        loop.append(loop[-1] + rows[:, i])
    got = running_sums(rows)
    assert got.dtype == dtype and torch.equal(got, torch.stack(loop, dim=-1))
    assert got[-1, -1] == 1.0
    if dtype == torch.float32:
        assert rows[-1].double().cumsum(-1).float()[-1] > 1.0  # what rounding once gives


def test_running_sums_refuse_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float32 or float64"):
        running_sums(torch.ones(1, 3, dtype=torch.bfloat16))


def test_ban_repeat_redraws_from_the_rest_as_upstream_ace7c47() -> None:
    """CosyVoice 3's reference sets the repeated token's score to -inf before the redraw
    (``weighted_scores[top_ids] = -inf``, then a softmax draw): the same uniform must then
    pick what a draw over the masked distribution picks, and never the repeated token."""
    gen = torch.Generator().manual_seed(7)
    fallbacks = 0
    for case in _random_cases(240, gen):
        uniforms = torch.tensor([case.uniforms], dtype=torch.float64)
        windows = _windows([case.history], case.cfg.win_size)
        plain = int(ras_draw(case.log_probs[None], windows, uniforms, case.cfg)[0])
        banned = int(ras_draw(case.log_probs[None], windows, uniforms, case.cfg, ban_repeat=True)[0])
        first = int(ras_draw(case.log_probs[None], _windows([[]], case.cfg.win_size), uniforms, case.cfg)[0])
        repeats = case.history[-case.cfg.win_size :].count(first)
        if repeats < case.cfg.win_size * case.cfg.tau_r:
            assert banned == plain == first
            continue
        fallbacks += 1
        masked = case.log_probs.clone()
        masked[first] = float("-inf")
        expected = int(inverse_cdf(masked.softmax(-1)[None], uniforms[:, 1])[0])
        assert banned == expected != first
    assert fallbacks >= 30
