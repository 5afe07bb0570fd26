"""The embedded engine's recurrent scan (``RecurrentMixer.scan``, every float32 prefill and every
decode step) against the per-token loop it replaced, on the same inputs, bit for bit.

    .venv/bin/python benchmarks/scan.py [--repeats 5] [--against REV] [--out benchmarks/results/scan.json]

Shapes as an extend has them: a batch of ``B`` segments of up to ``L`` tokens (ragged: the others
a third shorter), both families (Mamba2 and gated deltanet) at the shipped models' sizes, float32.
Timed in turn within each repeat, so that the machine's load falls on both alike:

* ``scan``: ``evalsvc.engines.embedded.model.RecurrentMixer.scan``: each input split into its
  per-token views once, shaped to broadcast, a ragged mask per token made once and applied only
  past the shortest segment, Mamba2's skip term ``D x`` added once after the loop;
* ``loop``: ``reference_scan`` (``tests/oracles/scan.py``), the loop before it (each input
  sliced at each token, the ragged mask made at each token), kept as the oracle
  ``tests/engines/embedded/test_scan.py`` pins ``scan`` against;
* with ``--against REV``, ``scan`` of the engine's model at git revision ``REV`` too (its
  ``evalsvc/engines/embedded/model.py``, the same weights), and the ratio ``scan / against``.

Results go to ``benchmarks/results/scan.json``; BENCHMARKS.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.oracles.scan import FAMILIES, make_case, reference_scan  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def model_at(rev: str) -> types.ModuleType:
    """The engine's model module (``evalsvc/engines/embedded/model.py``) as it was at ``rev``."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:evalsvc/engines/embedded/model.py"],
                            capture_output=True, text=True, check=True).stdout
    module = types.ModuleType(f"model_at_{rev}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, f"{rev}:evalsvc/engines/embedded/model.py", "exec"), module.__dict__)
    return module


def mixer_at(module: types.ModuleType, mixer):
    """``mixer``'s weights in ``module``'s class of the same name."""
    other = getattr(module, type(mixer).__name__)(module.HybridConfig(family=mixer.family))
    other.load_state_dict(mixer.state_dict())
    return other


def seconds(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--against", metavar="REV", help="also time the scan at this git revision")
    ap.add_argument("--out", type=Path, default=RESULTS / "scan.json")
    args = ap.parse_args()
    against = model_at(args.against) if args.against else None
    torch.set_num_threads(1)  # as the engine runs (EVALSVC_ENGINE_THREADS)
    rows = []
    for family in FAMILIES:
        for b, big_l in ((1, 1), (4, 1), (4, 64), (4, 256)):
            lengths = [big_l] + [max(1, big_l - big_l // 3)] * (b - 1)
            mixer, case = make_case(family, lengths)
            calls = max(3, 2000 // big_l)
            with torch.inference_mode():
                got, want = mixer.scan(*case), reference_scan(mixer, *case)
                assert torch.equal(got.out, want[0]) and torch.equal(got.ssm, want[2])
                runs = {"scan": [], "loop": [], "against": []}
                if against is not None:
                    other = mixer_at(against, mixer)
                    assert torch.equal(other.scan(*case).out, got.out)
                for _ in range(args.repeats):
                    runs["scan"].append(seconds(lambda m=mixer, c=case: m.scan(*c), calls))
                    runs["loop"].append(seconds(lambda m=mixer, c=case: reference_scan(m, *c),
                                                calls))
                    if against is not None:
                        runs["against"].append(seconds(lambda m=other, c=case: m.scan(*c), calls))
            ratios = [lp / sc for sc, lp in zip(runs["scan"], runs["loop"], strict=True)]
            row = {"family": family, "batch": b, "tokens": big_l,
                   "scan_ms": round(statistics.median(runs["scan"]) * 1e3, 3),
                   "loop_ms": round(statistics.median(runs["loop"]) * 1e3, 3),
                   "speedup_min": round(min(ratios), 2),
                   "speedup_median": round(statistics.median(ratios), 2),
                   "speedup_max": round(max(ratios), 2)}
            if against is not None:
                times = [sc / ag for sc, ag in zip(runs["scan"], runs["against"], strict=True)]
                row |= {"against_ms": round(statistics.median(runs["against"]) * 1e3, 3),
                        "scan_over_against_min": round(min(times), 2),
                        "scan_over_against_median": round(statistics.median(times), 2),
                        "scan_over_against_max": round(max(times), 2)}
            rows.append(row)
            print(json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"repeats": args.repeats, "against": args.against, "rows": rows},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
