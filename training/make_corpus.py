"""Build the training corpus and the demo prompts from the Python standard library's sources.

Run once; its outputs are committed (training/corpus.txt.gz, evalsvc/assets/prompts/demo.jsonl),
so training never depends on the Python that runs it. The sources are under the PSF license
(training/CORPUS_LICENSE.txt).

    python training/make_corpus.py
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = ["bisect.py", "fractions.py", "heapq.py", "queue.py", "sched.py", "shlex.py",
            "statistics.py", "textwrap.py"]
CORPUS_BYTES = 2_500_000
SEPARATOR = "\n<|endoftext|>\n"


def main() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.name not in HELD_OUT)
    parts, total = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if total + len(text) > CORPUS_BYTES:
            continue
        parts.append(f"# file: {path.name}\n{text}")
        total += len(text)
    out = ROOT / "training" / "corpus.txt.gz"
    with gzip.GzipFile(out, "wb", mtime=0) as fh:
        fh.write(SEPARATOR.join(parts).encode("utf-8"))
    shutil.copyfile(stdlib / "LICENSE.txt", ROOT / "training" / "CORPUS_LICENSE.txt")

    prompts = []
    for name in HELD_OUT:
        text = (stdlib / name).read_text(encoding="utf-8")
        for match in re.finditer(r"^(def|class) \w+.*:\n", text, flags=re.M):
            start = match.start()
            snippet = text[start: start + 480]
            snippet = snippet[: snippet.rfind("\n") + 1]
            if len(snippet) >= 240:
                prompts.append({"id": f"{name[:-3]}-{len(prompts):03d}", "text": snippet})
                break
        for match in list(re.finditer(r"^    def \w+.*:\n", text, flags=re.M))[1:3]:
            snippet = text[match.start(): match.start() + 400]
            snippet = snippet[: snippet.rfind("\n") + 1]
            if len(snippet) >= 200:
                prompts.append({"id": f"{name[:-3]}-{len(prompts):03d}", "text": snippet})
    dest = ROOT / "evalsvc" / "assets" / "prompts" / "demo.jsonl"
    dest.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    heldout = heldout_prompts(stdlib)
    (dest.parent / "heldout.jsonl").write_text("".join(json.dumps(p) + "\n" for p in heldout))
    print(f"corpus: {len(parts)} files, {total} chars from Python {sys.version.split()[0]}; "
          f"{len(prompts)} demo prompts, {len(heldout)} held-out prompts")


def heldout_prompts(stdlib: Path) -> list[dict]:
    """Every function or class of the held-out files as a prompt of 240 to 480 characters, file by
    file (``builtin:heldout``: enough prompts for SGLang's 48 per scenario)."""
    out = []
    for name in HELD_OUT:
        text = (stdlib / name).read_text(encoding="utf-8")
        for match in re.finditer(r"^(    )?(def|class) \w+.*:\n", text, flags=re.M):
            snippet = text[match.start(): match.start() + 480]
            snippet = snippet[: snippet.rfind("\n") + 1]
            if len(snippet) >= 240:
                out.append({"id": f"{name[:-3]}-h{len(out):03d}", "text": snippet})
    return out


if __name__ == "__main__":
    main()
