"""Where a command's CPU goes, by kind of process: the test suite's, by default.

    .venv/bin/python benchmarks/suite_cpu.py [--out FILE.json] [-- COMMAND ...]   # default: make test

Runs the command and, every half second while it runs, reads ``/proc``: each process descended
from it (found by its parent chain when first seen), its command line and its CPU time (user +
system, all threads). At the end each process is put in a kind by its command line (an embedded
engine, an ``evalsvc serve``, a pytest worker, an SGLang env's installer ...) and the kinds are
summed, beside the machine's busy and idle time from ``/proc/stat`` over the same span. A process
is counted up to its last sample, so one living under half a second counts nothing and each loses
at most half a second: the attributed total is a lower bound, and the gap to the machine's busy
time (which also holds whatever else ran on it) is printed. It also counts the processes that
started embedded engines, by kind, and the engines each kind started (``engine_starters``): a fork
server per such process would save ``benchmarks/engine_start.py``'s saving per engine on each
engine, and cost one ``imports only`` per starter. The sampler costs about 1 % of a core.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")

# first match wins: the more specific patterns come first
KINDS = [
    ("embedded engine", r"-m evalsvc\.engines\.embedded\b"),
    ("real SGLang server", r"sglang\.launch_server|^sglang::"),
    ("SGLang env: installs", r"\buv pip install|-m pip install|pip_compileall|bin/pip install"),
    ("SGLang env: checks and clients", r"sglang-envs/"),
    ("evalsvc serve", r"evalsvc(\.cli)? serve"),
    ("evalsvc CLI, other", r"-m evalsvc\.cli|bin/evalsvc "),
    ("pytest processes", r"import sys;exec\(eval\(sys\.stdin\.readline\(\)\)\)|pytest"),
    ("Ray", r"\bray\b|raylet|gcs_server"),
    ("PostgreSQL", r"^postgres"),
    ("Chromium", r"chrom"),
]


def read_stat(pid: str) -> tuple[str, float, str] | None:
    """(parent pid, CPU seconds, start time) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()
    return rest[1], (int(rest[11]) + int(rest[12])) / TICK, rest[19]


def cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()
    except OSError:
        return ""


def machine_ticks() -> tuple[int, int]:
    """(busy, idle) clock ticks of every core since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle, idle


def kind_of(cmd: str) -> str:
    for name, pattern in KINDS:
        if re.search(pattern, cmd):
            return name
    return "other: " + (cmd.split(" ", 1)[0].rsplit("/", 1)[-1] or "?")


def sample(root: int, seen: dict[str, dict], ours: dict[str, str]) -> None:
    """One pass over /proc: new processes under ``root`` join ``seen`` (with the key of their
    parent); known ones update. ``ours``: pid -> key of the processes under ``root``."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        stat = read_stat(pid)
        if stat is None:
            continue
        ppid, cpu, start = stat
        key = f"{pid}@{start}"
        if key not in seen:
            if pid != str(root) and ppid not in ours:
                continue
            seen[key] = {"pid": int(pid), "cpu": cpu, "cmd": "", "parent": ours.get(ppid)}
            ours[pid] = key
        entry = seen[key]
        entry["cpu"] = max(entry["cpu"], cpu)
        if cmd := cmdline(pid):  # the last one seen: a forked child's comes after its exec
            entry["cmd"] = cmd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/suite_cpu.json")
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("command", nargs="*", default=["make", "test"])
    args = ap.parse_args()

    busy0, idle0 = machine_ticks()
    started = time.monotonic()
    proc = subprocess.Popen(args.command, cwd=ROOT)
    seen: dict[str, dict] = {}
    ours: dict[str, str] = {str(proc.pid): ""}
    try:
        while proc.poll() is None:
            sample(proc.pid, seen, ours)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        proc.wait()
    wall = time.monotonic() - started
    busy1, idle1 = machine_ticks()
    busy, idle = (busy1 - busy0) / TICK, (idle1 - idle0) / TICK

    kinds: dict[str, dict] = {}
    for entry in seen.values():
        k = kinds.setdefault(kind_of(entry["cmd"]), {"cpu_s": 0.0, "processes": 0})
        k["cpu_s"] += entry["cpu"]
        k["processes"] += 1
    attributed = sum(k["cpu_s"] for k in kinds.values())
    engines = sorted(e["cpu"] for e in seen.values() if kind_of(e["cmd"]) == "embedded engine")
    starters: dict[str, dict] = {}  # the processes that started engines, by kind
    by_parent: dict[str, int] = {}
    for entry in seen.values():
        if kind_of(entry["cmd"]) == "embedded engine" and entry["parent"] in seen:
            by_parent[entry["parent"]] = by_parent.get(entry["parent"], 0) + 1
    for parent, count in by_parent.items():
        k = starters.setdefault(kind_of(seen[parent]["cmd"]), {"processes": 0, "engines": 0})
        k["processes"] += 1
        k["engines"] += count
    result = {
        "command": args.command, "exit_code": proc.returncode, "wall_s": round(wall, 1),
        "machine_busy_s": round(busy, 1), "machine_idle_s": round(idle, 1),
        "cores": os.cpu_count(), "attributed_s": round(attributed, 1),
        "kinds": {name: {"cpu_s": round(k["cpu_s"], 1), "processes": k["processes"]}
                  for name, k in sorted(kinds.items(), key=lambda kv: -kv[1]["cpu_s"])},
        "embedded_engine_cpu_s_median": engines[len(engines) // 2] if engines else None,
        # who started the engines: the processes a fork server per starter would have to
        # preload (benchmarks/engine_start.py measures what it costs and saves)
        "engine_starters": dict(sorted(starters.items(), key=lambda kv: -kv[1]["engines"])),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    table = Table(title=f"{' '.join(args.command)}: {wall:.0f} s, exit {proc.returncode}")
    for col in ("kind", "CPU s", "share", "processes"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for name, k in result["kinds"].items():
        if k["cpu_s"] >= 0.5:
            table.add_row(name, f"{k['cpu_s']:,.1f}", f"{k['cpu_s'] / attributed:.1%}",
                          str(k["processes"]))
    table.add_row("attributed", f"{attributed:,.1f}", "", str(len(seen)))
    table.add_row("machine busy / idle", f"{busy:,.1f} / {idle:,.1f}",
                  f"{busy / (busy + idle):.1%} busy", "")
    Console().print(table)
    if starters:
        print("engines started by: " + "; ".join(
            f"{name}: {k['engines']} from {k['processes']} processes"
            for name, k in result["engine_starters"].items()))
    print(f"written to {args.out}")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
