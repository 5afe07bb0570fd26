"""In-process embedded engines for fast cache-path tests: the scheduler without HTTP."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest

from evalsvc.engines.embedded.args import parse_args
from evalsvc.engines.embedded.model import Numerics, load_model
from evalsvc.engines.embedded.scheduler import GenerateInput, Req, SamplingParams, Scheduler
from evalsvc.engines.embedded.tokenizer import TextTokenizer

FAMILIES = ["hybrid-mamba2-tiny", "hybrid-gdn-tiny"]
_models: dict = {}


class LocalEngine:
    """A scheduler on its own thread, driven directly (no HTTP)."""

    def __init__(self, flags: list[str]) -> None:
        self.args = parse_args(flags, env={})
        path, numerics = self.args.model_path, Numerics.from_args(self.args.dtype,
                                                                  self.args.mamba_ssm_dtype)
        if (path, numerics) not in _models:
            _models[(path, numerics)] = (load_model(path, numerics), TextTokenizer(path))
        self.model, self.tok = _models[(path, numerics)]
        self.sched = Scheduler(self.args, self.model, self.tok)
        self.sched.start()

    def generate(self, inputs: list[GenerateInput], timeout: float = 120) -> list[Req]:
        done, out, lock = threading.Event(), [], threading.Lock()

        def finish(req: Req) -> None:
            with lock:
                out.append(req)
                if len(out) == len(inputs):
                    done.set()

        for inp in inputs:
            self.sched.submit(inp, finish)
        assert done.wait(timeout), "engine did not answer in time"
        order = {inp.rid: i for i, inp in enumerate(inputs)}
        reqs = sorted(out, key=lambda r: order[r.rid])
        for r in reqs:
            assert r.error is None, r.error
        return reqs

    def one(self, ids: list[int], rid: str = "r", **kw) -> Req:
        return self.generate([request(rid, ids, **kw)])[0]

    def flush(self) -> None:
        assert self.sched.flush_cache()

    def close(self) -> None:
        self.sched.stop()


def request(rid: str, ids: list[int], *, max_new_tokens: int = 0, temperature: float = 0.0,
            logprob_start_len: int | None = None, seed: int | None = None) -> GenerateInput:
    return GenerateInput(
        rid=rid, input_ids=list(ids),
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                ignore_eos=True, sampling_seed=seed),
        return_logprob=logprob_start_len is not None,
        logprob_start_len=-1 if logprob_start_len is None else logprob_start_len)


@pytest.fixture
def engine_factory():
    engines: list[LocalEngine] = []

    def make(flags: list[str]) -> LocalEngine:
        eng = LocalEngine(flags)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


@dataclass
class Probe:
    """One comparison of a cache hit with a cold recompute of the same request."""

    name: str
    length: int  # prompt tokens of the request that hit
    seed_len: int  # prompt tokens of the earlier request whose prefill seeded this prefix
    cached: int
    host_cached: int
    hit: list[float]
    cold: list[float]
    hit_out: list[int]
    cold_out: list[int]

    @property
    def max_diff(self) -> float:
        a, b = np.array(self.hit), np.array(self.cold)
        assert a.shape == b.shape and a.size > 0, (self.name, a.shape, b.shape)
        return float(np.abs(a - b).max())


def token_prompts(tok: TextTokenizer, prompts: list[str]) -> list[list[int]]:
    return [tok.encode(p) for p in prompts]
