"""``harness.score`` against the per-sample implementation it replaced
(``tests/oracles/scoring.py: straightforward_score``), on random scenarios and edge cases: the same
metrics and rows bit for bit, and the same errors."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest

import evalsvc.metrics.kl as kl_mod
import evalsvc.metrics.stats as stats_mod
import tests.oracles.scoring as reference
from evalsvc import judging
from evalsvc.harness import score
from evalsvc.matrix import Config, MatrixFile
from evalsvc.metrics import summarize_kl, token_kl, token_kl_by_sample
from evalsvc.scenarios import Sample
from evalsvc.types import Completion, RunResult, ScenarioResult, SpecCounters, TopLogprobs
from tests.oracles.scoring import make_samples, scenario_config, straightforward_score


def same(a: Any, b: Any, where: str = "") -> None:
    """Equal, floats bit for bit (NaN equal to NaN, 0.0 unequal to -0.0), types alike."""
    if isinstance(a, float) or isinstance(b, float):
        assert type(a) is type(b), (where, a, b)
        assert np.float64(a).tobytes() == np.float64(b).tobytes(), (where, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a.keys() ^ b.keys()))
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def judged(scen: ScenarioResult, config: Config, matrix: MatrixFile) -> ScenarioResult:
    """A scenario ``score`` measured, judged as its run is (``judging.judge_run``, no history)."""
    assert (scen.verdict, scen.reason) == ("measured", "")
    run = RunResult(config.name, config.fingerprint, config.model, dict(config.settings),
                    dict(config.args), verdict="measured", scenarios=[scen])
    judging.judge_run(run, {scen.scenario: judging.scenario_limits(config, matrix, scen.scenario)})
    return scen


def check(samples: list[Sample], name: str = "prefill_hit") -> None:
    config, matrix = scenario_config()
    want = straightforward_score(name, samples, config, matrix, {})
    got = judged(score(name, samples, config, matrix, {}), config, matrix)
    assert (got.scenario, got.verdict, got.reason) == (want.scenario, want.verdict, want.reason)
    same(got.metrics, want.metrics, "metrics")
    same(got.samples, want.samples, "rows")


def ragged(rng: np.random.Generator, n_samples: int, top: bool) -> list[Sample]:
    """Samples of random lengths (some empty, some of one token), extends of random lengths,
    logprobs with exact ties, zeros and wide differences; top lists of varying k."""
    out = []
    for s in range(n_samples):
        n = int(rng.choice([0, 1, 2, 7, 8, 9, 33, 128, 129, 300]))
        dec = np.log(rng.uniform(1e-6, 1.0, n))
        ref = dec + rng.choice([0.0, 1e-9, -3e-5, 2e-4, -2.0], n) * rng.random(n)
        ref = np.minimum(ref, 0.0)
        dec[rng.random(n) < 0.1] = 0.0
        e = int(rng.choice([0, 0, 1, 5, 64]))
        ext = np.log(rng.uniform(1e-3, 1.0, e))
        ext_ref = np.minimum(ext + rng.normal(0, 1e-3, e), 0.0)
        completion = Completion(token_ids=rng.integers(0, 300, n).tolist(), logprobs=dec.tolist(),
                                prompt_tokens=40, cached_tokens=int(rng.integers(0, 40)),
                                host_cached_tokens=int(rng.integers(0, 2)))
        ref_top = None
        if top:
            def lists(lps: np.ndarray) -> TopLogprobs:
                positions = []
                for lp in lps:
                    k = int(rng.choice([0, 1, 3, 5, 5, 5]))
                    ids = rng.choice(400, size=k, replace=False).tolist()
                    vals = sorted((lp - rng.exponential(1.0, k)).tolist(), reverse=True)
                    if k and rng.random() < 0.1:
                        vals[-1] = -math.inf
                    positions.append(list(zip(ids, vals, strict=True)))
                return TopLogprobs(positions)

            completion.top = lists(dec)
            ref_top = lists(ref)
        if rng.random() < 0.3:
            completion.spec = SpecCounters(verify_ct=max(1, n // 3), completion_tokens=n,
                                           correct_drafts=n // 2, proposed_drafts=n,
                                           draft_tokens=4)
        out.append(Sample("prefill_hit", f"prefill_hit-{s}", f"p{s}", list(range(40)), completion,
                          hit=bool(rng.random() < 0.8), reference=ref.tolist(),
                          reference_top=ref_top, extend=ext.tolist(),
                          extend_reference=ext_ref.tolist()))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_ragged_scenarios_score_as_before(seed: int) -> None:
    rng = np.random.default_rng(seed)
    check(ragged(rng, int(rng.integers(1, 60)), top=seed % 2 == 0))


def test_many_blocks_and_large_bootstraps_score_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples spread over many blocks (a few tokens a block), and bootstrap draws in chunks."""
    rng = np.random.default_rng(7)
    samples = ragged(rng, 80, top=False)
    check(samples)
    monkeypatch.setattr(kl_mod, "_BLOCK_TOKENS", 5)
    monkeypatch.setattr(stats_mod, "_MAX_RESAMPLE_ELEMENTS", 300)
    monkeypatch.setattr(reference, "_MAX_RESAMPLE_ELEMENTS", 300)
    check(samples)


def test_scenario_shaped_input_scores_as_before() -> None:
    """Equal lengths (every sample generates the same number of tokens), with extends and
    top-5 lists, as the benchmark makes them."""
    check(make_samples(300, 64, extend=20))
    check(make_samples(40, 16, extend=3, top_k=5))


def test_an_extend_wrong_at_its_first_position_fails_with_that_position_named() -> None:
    """A state the cache got wrong, as SGLang's CPU conv kernel does (it ignores the conv state
    for the first positions of an extend): the scenario's reason names the position, and each
    row keeps the extend's token ids."""
    samples = make_samples(8, 4, extend=32)
    for s in samples:
        s.reference = list(s.completion.logprobs)
        s.extend_reference = list(s.extend)
        s.extend_reference[0] = s.extend[0] - 6.0
        s.extend_ids = s.prompt_ids[-32:]
    check(samples)
    config, matrix = scenario_config()
    got = judged(score("prefill_hit", samples, config, matrix, {}), config, matrix)
    assert got.verdict == "fail"
    assert got.reason.endswith("(k3 5 at extend position 0 of 32; positions 1+ at 0)")
    assert got.samples[0]["extend_ids"] == list(range(200, 232))


@pytest.mark.parametrize("case", ["empty scenario", "no tokens", "single tokens", "all equal",
                                  "one sample", "no extend", "only extends", "missing top"])
def test_edge_cases_score_as_before(case: str) -> None:
    rng = np.random.default_rng(1)
    samples = ragged(rng, 12, top=True)
    if case == "empty scenario":
        samples = []
    for s in samples:
        n = {"no tokens": 0, "single tokens": 1, "only extends": 0}.get(case)
        if n is not None:
            s.completion.logprobs, s.reference = s.completion.logprobs[:n], s.reference[:n]
            s.completion.token_ids = s.completion.token_ids[:n]
            s.completion.top.positions = s.completion.top.positions[:n]
            s.reference_top.positions = s.reference_top.positions[:n]
        if case == "all equal":
            s.reference = list(s.completion.logprobs)
            s.extend_reference = list(s.extend)
        if case in ("no extend", "no tokens"):
            s.extend, s.extend_reference = [], []
        if case == "missing top":  # a None logprob where no top-k KL is computed, None positions
            pos = next((p for p in s.completion.top.positions if p), None)
            if pos is not None:
                pos[0] = (pos[0][0], None)
            s.reference_top = None
            if s.completion.top.positions:
                s.completion.top.positions[-1] = None
    if case == "one sample":
        samples = samples[:1]
    if case == "empty scenario":  # numpy warns of the mean of no cached_tokens, and it is NaN
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            check(samples)
        return
    check(samples)


def bad(samples: list[Sample], where: str, index: int, value: float) -> list[Sample]:
    s = samples[index]
    target = {"decode": s.completion.logprobs, "reference": s.reference, "extend": s.extend,
              "extend_reference": s.extend_reference}[where]
    target[len(target) // 2] = value
    return samples


@pytest.mark.parametrize(("where", "index", "value"), [
    ("decode", 3, math.nan), ("reference", 0, math.inf), ("decode", 5, -math.inf),
    ("reference", 4, 0.5), ("extend", 2, math.nan), ("extend_reference", 1, 0.01)])
def test_bad_logprobs_raise_as_before(where: str, index: int, value: float) -> None:
    config, matrix = scenario_config()
    samples = make_samples(6, 12, extend=4)
    bad(samples, where, index, value)
    if where != "decode":  # another problem in a later sample: the first one is named
        bad(samples, "decode", 5, math.nan)
    with pytest.raises(ValueError) as want:
        straightforward_score("prefill_hit", samples, config, matrix, {})
    with pytest.raises(ValueError) as got:
        score("prefill_hit", samples, config, matrix, {})
    assert str(got.value) == str(want.value)


def test_other_bad_input_raises_as_before() -> None:
    config, matrix = scenario_config()
    short = make_samples(4, 10, extend=2)
    short[2].reference = short[2].reference[:-1]
    dup = make_samples(4, 10, top_k=5)
    dup[1].completion.top.positions[3][1] = dup[1].completion.top.positions[3][0]
    # an extend error in the first sample comes before a top-k error in it
    both = make_samples(3, 10, extend=2, top_k=5)
    both[0].extend[0] = math.nan
    both[0].completion.top.positions[0][1] = both[0].completion.top.positions[0][0]
    huge = make_samples(3, 10)  # a token 800 nats likelier in the reference: k3 is inf
    huge[1].completion.logprobs[0], huge[1].reference[0] = -800.0, 0.0
    missing = make_samples(3, 10, top_k=5)  # a None logprob in a list the top-k KL reads
    missing[2].reference_top.positions[4][2] = (7, None)
    for samples in (short, dup, both, huge, missing):
        with pytest.raises(ValueError) as want:
            straightforward_score("prefill_hit", samples, config, matrix, {})
        with pytest.raises(ValueError) as got:
            score("prefill_hit", samples, config, matrix, {})
        assert str(got.value) == str(want.value)


def test_token_kl_by_sample_equals_token_kl_of_each() -> None:
    rng = np.random.default_rng(3)
    decode, ref = [], []
    for n in [0, 1, 5, 5, 5, 0, 200, 3, 1]:
        d = np.log(rng.uniform(0.01, 1.0, n))
        decode.append(d.tolist() if n % 2 else d)  # lists and arrays alike
        ref.append(np.minimum(d + rng.normal(0, 1e-3, n), 0.0))
    got = token_kl_by_sample(decode, ref, tol=1e-3)
    for s, (d, r) in enumerate(zip(decode, ref, strict=True)):
        want = token_kl(d, r)
        n = len(want["k3"])
        assert got.lengths[s] == n
        for key, values in (("k1", got.k1_mean), ("k2", got.k2_mean), ("k3", got.k3_mean)):
            expected = want[key].mean() if n else np.nan
            assert np.float64(values[s]).tobytes() == np.float64(expected).tobytes(), (s, key)
        assert (got.k3_max[s] == want["k3"].max()) if n else np.isnan(got.k3_max[s])
        over = np.flatnonzero(np.abs(np.asarray(d) - r) > 1e-3)
        assert got.first_above[s] == (over[0] if len(over) else -1)
    assert np.array_equal(got.k3, np.concatenate([token_kl(d, r)["k3"] for d, r in
                                                  zip(decode, ref, strict=True)]))
    with pytest.raises(ValueError, match="number of samples"):
        token_kl_by_sample([[0.0]], [])
    with pytest.raises(ValueError, match="1-D"):
        token_kl_by_sample([[-1.0], [[-1.0]]], [[-1.0], [[-1.0]]])


@pytest.mark.parametrize("n", [1, 2, 3, 8, 9, 100, 1001])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_bootstrap_draws_in_chunks_as_before(monkeypatch: pytest.MonkeyPatch, n: int,
                                             rows: int) -> None:
    """The bootstrap's means as each chunk of draws is made equal those of the whole draw matrix
    (one row, and several rows sharing the draws)."""
    x = np.random.default_rng(n).lognormal(size=(rows, n))
    for limit, gather in ((4_000_000, 640_000), (5_000, 640_000), (5_000, 7 * n), (50, 1)):
        monkeypatch.setattr(stats_mod, "_MAX_RESAMPLE_ELEMENTS", limit)
        monkeypatch.setattr(stats_mod, "_GATHER_ELEMENTS", gather)
        monkeypatch.setattr(reference, "_MAX_RESAMPLE_ELEMENTS", limit)
        for n_boot in (1, 7, 2000):
            want = reference._bootstrap_quantiles(x, 0.95, n_boot, 11)
            got = stats_mod._bootstrap_quantiles(x, 0.95, n_boot, 11)
            assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), limit


def test_summarize_kl_is_unchanged() -> None:
    rng = np.random.default_rng(5)
    per_sample = [rng.exponential(1e-4, int(n)) for n in rng.integers(0, 50, 30)]
    same(summarize_kl(per_sample, seed=3), reference._summarize_kl(per_sample, seed=3))
    with pytest.raises(ValueError, match="NaN or inf"):
        summarize_kl([[0.1, math.inf]])
