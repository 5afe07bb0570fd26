"""The way one REST job takes through the code: from ``api/routes.py:create_job`` to its stored
verdicts, as a newcomer would follow it (``tests/walk.py`` walks it).

    .venv/bin/python benchmarks/hops.py [--config NAME] [--show]

Reported: the walk's stops (functions), the modules it visits, its returns (how often it comes back
to a module it had left) and its re-entries (call sites where the job's call chain calls back into
a module already on its stack below another; ``tests/test_job_walk.py`` holds them at none).
``--show`` prints the walk and the re-entries.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).parent / "results"


def main() -> None:
    from tests.walk import walk_job

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="mamba2-nb-sync-c64")
    parser.add_argument("--show", action="store_true")
    args = parser.parse_args()
    walk, job = walk_job(args.config)
    if args.show:
        for module, name in walk.stops:
            print(f"{module}:{name}")
        print("re-entries (a call back into a module already on the call stack below another):")
        for (caller, callee), n in sorted(walk.reentries.items()):
            print(f"  {caller} -> {callee} ({n}x)")
    out = {"config": args.config, "status": job["status"],
           "verdicts": [r["verdict"] for r in job["runs"]], **walk.summary()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hops.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
