"""Command line of the embedded engine: SGLang's flag names, resolved and validated as SGLang does.

Resolution follows SGLang 0.5.23's order: the Mamba radix-cache strategy first (``auto`` becomes
``extra_buffer`` when the overlap scheduler is on or ``--page-size`` is above 1, otherwise
``no_buffer`` with overlap off), then
speculative decoding (``NEXTN`` becomes ``EAGLE`` with 3 steps, top-k 1 and 4 draft tokens; on CPU
it turns the overlap scheduler off), then HiCache and memory sizes. An unknown flag, a bad value or
a combination SGLang refuses stops the engine at start with a message naming it (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from evalsvc.engines.sglang_server import TREE_CORE_ENV
from evalsvc.paths import DEFAULT_MODEL, shipped_models

from .defects import ENV_VAR, Defect, parse_defect_strengths

log = logging.getLogger("evalsvc.engine")

MAMBA_CHUNK_SIZE = 64
NUMA_NODES = Path("/sys/devices/system/node")  # SGLang's CPU memory capacity reads these
MEMINFO = Path("/proc/meminfo")
OMP_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
STRATEGIES = ["auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"]
WRITE_POLICIES = ["write_back", "write_through", "write_through_selective"]


class ArgError(ValueError):
    """An invalid flag value or combination; the message names it."""


def resolve_model_path(value: str | None) -> Path:
    """A directory, or the name of a shipped model; the default is the Mamba2-family model."""
    models = shipped_models()
    if value is None:
        return models[DEFAULT_MODEL]
    if value in models:
        return models[value]
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ArgError(f"--model-path {value}: no such directory and no shipped model of that "
                       f"name (shipped: {', '.join(models)})")
    if not (path / "config.json").is_file():
        raise ArgError(f"--model-path {value}: the directory has no config.json")
    return path.resolve()


@dataclass
class EngineArgs:
    model_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    mamba_radix_cache_strategy: str = "auto"
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    chunked_prefill_size: int | None = None
    enable_hierarchical_cache: bool = False
    hicache_ratio: float | None = None
    hicache_size: int = 0
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "kernel"
    hicache_mem_layout: str = "layer_first"
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    max_mamba_cache_size: int | None = None
    mamba_track_interval: int = 256
    mamba_ssm_dtype: str = "float32"
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    random_seed: int | None = None
    enable_deterministic_inference: bool = False
    page_size: int | None = None
    enable_mixed_chunk: bool = False
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    enable_metrics: bool = False
    log_level: str = "info"
    served_model_name: str | None = None
    stream_interval: int = 1
    incremental_streaming_output: bool = False
    stream_response_default_include_usage: bool = False
    enable_cache_report: bool = False
    skip_server_warmup: bool = False
    device: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    load_format: str = "auto"
    context_length: int | None = None
    defects: list[Defect] = field(default_factory=list)  # switched on, at any strength
    defect_strengths: dict[Defect, float] = field(default_factory=dict)  # each in (0, 1]
    warnings: list[str] = field(default_factory=list)
    # SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=rust: why the Python core runs instead (logged as
    # SGLang logs it; like SGLang's, /server_info does not show it)
    tree_core_fallback: str | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        del data["tree_core_fallback"]
        data["defects"] = [str(d) for d in self.defects]
        data["defect_strengths"] = {str(d): s for d, s in self.defect_strengths.items()}
        return data

    def host_pool_sizes(self, bytes_per_token: int, bytes_per_slot: int) -> tuple[int, int]:
        """Host-tier capacity (tokens, state slots): --hicache-size GB if set, else the ratio."""
        if self.hicache_size > 0:
            total = self.hicache_size * (1 << 30)
            device = self.max_total_tokens * bytes_per_token + self.max_mamba_cache_size * bytes_per_slot
            frac = self.max_total_tokens * bytes_per_token / device
            return (int(total * frac // bytes_per_token),
                    int(total * (1 - frac) // bytes_per_slot))
        return (int(self.max_total_tokens * self.hicache_ratio),
                int(self.max_mamba_cache_size * self.hicache_ratio))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="evalsvc engine",
        description="The embedded CPU engine: SGLang's native HTTP API over a small hybrid model.")
    a = p.add_argument
    a("--model-path", help="model directory, or a shipped model's name "
                           f"(default: {DEFAULT_MODEL})")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--mamba-radix-cache-strategy", choices=STRATEGIES, default=None)
    a("--mamba-scheduler-strategy", choices=STRATEGIES, default=None,
      help="deprecated alias of --mamba-radix-cache-strategy")
    a("--disable-radix-cache", action="store_true")
    a("--disable-overlap-schedule", action="store_true")
    a("--chunked-prefill-size", type=int, default=None, help="-1 disables (default 4096)")
    a("--enable-hierarchical-cache", action="store_true")
    a("--hicache-ratio", type=float, default=None)
    a("--hicache-size", type=int, default=0, help="host tier size in GB; overrides the ratio")
    a("--hicache-write-policy", choices=WRITE_POLICIES, default="write_through")
    a("--hicache-io-backend", choices=["direct", "kernel"], default="kernel")
    a("--hicache-mem-layout", choices=["layer_first", "page_first", "page_first_direct"],
      default="layer_first")
    a("--speculative-algorithm", type=str.upper, default=None,
      choices=["NEXTN", "EAGLE", "EAGLE3", "STANDALONE", "NGRAM"])
    a("--speculative-num-steps", type=int, default=None)
    a("--speculative-eagle-topk", type=int, default=None)
    a("--speculative-num-draft-tokens", type=int, default=None)
    a("--max-mamba-cache-size", type=int, default=None)
    a("--mamba-track-interval", type=int, default=256)
    a("--mamba-ssm-dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    a("--max-running-requests", type=int, default=None)
    a("--max-total-tokens", type=int, default=None)
    a("--random-seed", type=int, default=None)
    a("--enable-deterministic-inference", action="store_true")
    a("--page-size", type=int, default=None, help="tokens per KV page (default 1); above 1 the "
      "prefix cache matches whole pages and needs extra_buffer")
    a("--enable-mixed-chunk", action="store_true",
      help="run a prefill chunk and the running decode requests in one batch (needs chunked "
           "prefill; not when a request asks for logprobs)")
    a("--tp-size", "--tp", type=int, default=1)
    a("--dp-size", "--dp", type=int, default=1)
    a("--mem-fraction-static", type=float, default=None, help="accepted; the engine sizes pools "
                                                              "from --max-total-tokens")
    a("--enable-metrics", action="store_true")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a("--served-model-name", default=None, help="the model's name in the OpenAI-compatible API "
                                                "(default: the model path)")
    a("--stream-interval", type=int, default=1, help="tokens per streamed chunk")
    a("--incremental-streaming-output", action="store_true",
      help="streamed /generate chunks carry what is new, not everything so far")
    a("--stream-response-default-include-usage", action="store_true",
      help="OpenAI-compatible streams end with a usage chunk unless stream_options says otherwise")
    a("--enable-cache-report", action="store_true",
      help="OpenAI-compatible usage reports prompt_tokens_details.cached_tokens")
    a("--skip-server-warmup", action="store_true")
    a("--device", default=None, choices=["cpu"])
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
      help="auto: the model's (float32); bfloat16 computes as a GPU engine does (chunked prefill, "
           "recurrent decode, split-KV decode attention)")
    a("--trust-remote-code", action="store_true")
    a("--load-format", default="auto", choices=["auto", "safetensors"])
    a("--context-length", type=int, default=None)
    a("--inject-defect", action="append", default=[], metavar="NAME[@STRENGTH]",
      help=f"switch on a known defect (repeatable; also {ENV_VAR}); STRENGTH in (0, 1] is the "
           "fraction of requests it affects (default 1): " + ", ".join(d.value for d in Defect))
    return p


def parse_args(argv: list[str], env: dict[str, str] | None = None) -> EngineArgs:
    """Parse and resolve; exits with code 2 and a message naming the problem."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return resolve(ns, env)
    except ArgError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def resolve(ns: argparse.Namespace, env: dict[str, str] | None = None) -> EngineArgs:
    warnings: list[str] = []
    strategy = ns.mamba_radix_cache_strategy
    if ns.mamba_scheduler_strategy is not None:
        warnings.append("--mamba-scheduler-strategy is deprecated; use "
                        "--mamba-radix-cache-strategy")
        if strategy is not None and strategy != ns.mamba_scheduler_strategy:
            raise ArgError(f"--mamba-scheduler-strategy {ns.mamba_scheduler_strategy} conflicts "
                           f"with --mamba-radix-cache-strategy {strategy}")
        strategy = ns.mamba_scheduler_strategy
    fields = {k: v for k, v in vars(ns).items()
              if k in EngineArgs.__dataclass_fields__ and k != "mamba_radix_cache_strategy"}
    args = EngineArgs(**fields, mamba_radix_cache_strategy=strategy or "auto")
    args.warnings = warnings
    model = resolve_model_path(ns.model_path)
    args.model_path = str(model)
    try:
        config = json.loads((model / "config.json").read_text())
    except ValueError as exc:  # a broken model directory: say which file, as a flag error
        raise ArgError(f"--model-path {ns.model_path}: {model / 'config.json'} is not valid "
                       f"JSON ({exc})") from None
    try:
        args.defect_strengths = parse_defect_strengths(ns.inject_defect, env)
        args.defects = list(args.defect_strengths)
    except ValueError as exc:
        raise ArgError(str(exc)) from None

    args.tree_core_fallback = _tree_core(os.environ if env is None else env)
    _check_platform(args)
    _resolve_mamba(args, config)
    _resolve_speculative(args, config)
    _resolve_hicache(args)
    _resolve_sizes(args, config, os.environ if env is None else env)
    if args.random_seed is None:
        args.random_seed = random.randint(0, 1 << 30)
    return args


def _tree_core(env: Mapping[str, str]) -> str | None:
    """SGLang's radix-tree core switch: ``python`` runs as asked; ``rust`` falls back to Python (the
    reason, which the scheduler logs as SGLang does); anything else is refused, as SGLang's
    ``create_tree_core`` refuses a backend it has not registered."""
    name = env.get(TREE_CORE_ENV, "python")
    if name == "rust":
        return "the embedded engine has no Rust TreeCore"
    if name != "python":
        raise ArgError(f"{TREE_CORE_ENV}={name!r} is not registered. Registered backends: "
                       "['python', 'rust'].")
    return None


def _check_platform(args: EngineArgs) -> None:
    if args.page_size is not None and args.page_size < 1:
        raise ArgError(f"--page-size {args.page_size} must be at least 1")
    if args.tp_size != 1 or args.dp_size != 1:
        raise ArgError("--tp-size/--dp-size: the embedded engine runs on one CPU device (1)")
    if args.stream_interval < 1:
        raise ArgError(f"--stream-interval {args.stream_interval} must be at least 1")
    if args.mamba_track_interval <= 0:
        raise ArgError(f"--mamba-track-interval {args.mamba_track_interval} must be positive")
    # each request's default sampling seed derives from it; numpy's seeds are 32-bit, as SGLang's
    if args.random_seed is not None and not 0 <= args.random_seed < 2**32:
        raise ArgError(f"--random-seed {args.random_seed}: must be between 0 and {2**32 - 1}")


def _resolve_mamba(args: EngineArgs, config: dict) -> None:
    s = args.mamba_radix_cache_strategy
    if s == "extra_buffer_lazy":
        raise ArgError("--mamba-radix-cache-strategy extra_buffer_lazy: not supported by the "
                       "embedded engine; use extra_buffer")
    if args.disable_radix_cache:  # SGLang resolves nothing: no Mamba radix cache at all
        return
    page = args.page_size  # None: not given (SGLang's validators skip their page checks then)
    if s == "auto":
        if not args.disable_overlap_schedule or (page is not None and page > 1):
            args.mamba_radix_cache_strategy = "extra_buffer"
        else:
            args.mamba_radix_cache_strategy = "no_buffer"
            args.disable_overlap_schedule = True
    s = args.mamba_radix_cache_strategy
    if s == "no_buffer" and page not in (None, 1):
        raise ArgError(f"--page-size {page}: no_buffer only supports page_size=1.")
    if s == "no_buffer" and not args.disable_overlap_schedule:
        raise ArgError("--mamba-radix-cache-strategy no_buffer does not support the overlap "
                       "schedule; add --disable-overlap-schedule")
    if s == "extra_buffer" and page is not None:
        if args.mamba_track_interval % page:
            raise ArgError(f"--mamba-track-interval {args.mamba_track_interval} must be a "
                           f"multiple of --page-size {page}")
        if max(MAMBA_CHUNK_SIZE, page) % min(MAMBA_CHUNK_SIZE, page):
            raise ArgError(f"--page-size {page}: For SSM models, either chunk_size or page_size "
                           f"must be divisible by the other, got chunk_size={MAMBA_CHUNK_SIZE}, "
                           f"page_size={page}")
    if s == "extra_buffer":
        if (args.speculative_num_draft_tokens is not None
                and args.mamba_track_interval < args.speculative_num_draft_tokens):
            raise ArgError(f"--mamba-track-interval {args.mamba_track_interval} must be greater "
                           "than or equal to --speculative-num-draft-tokens "
                           f"{args.speculative_num_draft_tokens}")
        if config.get("family") == "mamba2" and args.mamba_track_interval < MAMBA_CHUNK_SIZE:
            raise ArgError(f"--mamba-track-interval {args.mamba_track_interval} must be >= "
                           f"mamba_chunk_size ({MAMBA_CHUNK_SIZE}) for Mamba2 layers")
        csize, cache_chunk = args.chunked_prefill_size, mamba_cache_chunk_size(page or 1)
        if csize is not None and 0 < csize < cache_chunk:
            args.warnings.append(f"extra_buffer with --chunked-prefill-size {csize} smaller than "
                                 f"the mamba cache chunk size {cache_chunk}: prefill chunks "
                                 "take no snapshots")


def _resolve_speculative(args: EngineArgs, config: dict) -> None:
    alg = args.speculative_algorithm
    if alg is None:
        if any(v is not None for v in (args.speculative_num_steps, args.speculative_eagle_topk,
                                       args.speculative_num_draft_tokens)):
            raise ArgError("--speculative-num-steps/--speculative-eagle-topk/"
                           "--speculative-num-draft-tokens need --speculative-algorithm")
        if args.max_running_requests is None:
            args.max_running_requests = 64
        return
    if args.enable_mixed_chunk:
        raise ArgError(f"--enable-mixed-chunk with --speculative-algorithm {alg}: the embedded "
                       "engine mixes prefill chunks into plain decode batches only (SGLang mixes "
                       "them into EAGLE's verify steps)")
    if alg not in ("NEXTN", "EAGLE"):
        raise ArgError(f"--speculative-algorithm {alg}: the embedded engine drafts with the "
                       "model's MTP head; use NEXTN (or EAGLE)")
    if not config.get("num_nextn_predict_layers"):
        raise ArgError(f"--speculative-algorithm {alg}: the model at {args.model_path} has no MTP "
                       "head (num_nextn_predict_layers is 0)")
    args.speculative_algorithm = "EAGLE"
    if args.speculative_num_steps is None:
        if args.speculative_eagle_topk is not None or args.speculative_num_draft_tokens is not None:
            raise ArgError("--speculative-eagle-topk/--speculative-num-draft-tokens need "
                           "--speculative-num-steps as well")
        args.speculative_num_steps, args.speculative_eagle_topk = 3, 1
        args.speculative_num_draft_tokens = 4
    if args.speculative_num_steps < 1:
        raise ArgError(f"--speculative-num-steps {args.speculative_num_steps} must be at least 1")
    if args.speculative_eagle_topk is None:
        args.speculative_eagle_topk = 1
    if args.speculative_eagle_topk != 1:
        raise ArgError(f"--speculative-eagle-topk {args.speculative_eagle_topk}: the embedded "
                       "engine drafts a chain (top-k 1) only")
    if args.speculative_num_draft_tokens is None:
        args.speculative_num_draft_tokens = args.speculative_num_steps + 1
    if args.speculative_num_draft_tokens != args.speculative_num_steps + 1:
        args.warnings.append("speculative_num_draft_tokens is adjusted to speculative_num_steps + "
                             "1 when speculative_eagle_topk == 1")
        args.speculative_num_draft_tokens = args.speculative_num_steps + 1
    if args.max_running_requests is None:
        args.max_running_requests = 48
        args.warnings.append("Max running requests is reset to 48 for speculative decoding")
    if not args.disable_overlap_schedule:
        args.disable_overlap_schedule = True
        args.warnings.append("Overlap schedule is not implemented for speculative decoding on "
                             "CPU.")
    if (not args.disable_radix_cache and args.mamba_radix_cache_strategy == "extra_buffer"
            and args.mamba_track_interval < args.speculative_num_draft_tokens):
        raise ArgError(f"--mamba-track-interval {args.mamba_track_interval} must be greater than "
                       f"or equal to --speculative-num-draft-tokens "
                       f"{args.speculative_num_draft_tokens}")


def mamba_cache_chunk_size(page_size: int) -> int:
    """SGLang's caching grid of prefill snapshots: the larger of the mixers' chunk size and the
    page size (one divides the other)."""
    return max(MAMBA_CHUNK_SIZE, page_size)


def mamba_track_grid(page_size: int, track_interval: int) -> int:
    """SGLang's grid of decode snapshots: on the cache chunk grid and on the track interval."""
    return math.lcm(mamba_cache_chunk_size(page_size), page_size, track_interval)


def _resolve_hicache(args: EngineArgs) -> None:
    if not args.enable_hierarchical_cache:
        return
    if args.disable_radix_cache:
        raise ArgError("The arguments enable-hierarchical-cache and disable-radix-cache are "
                       "mutually exclusive and cannot be used at the same time. Please use only "
                       "one of them.")
    if args.hicache_ratio is None:
        args.hicache_ratio = 2.0
    if args.hicache_ratio <= 0:
        raise ArgError(f"--hicache-ratio {args.hicache_ratio} must be positive")
    if args.hicache_size < 0:
        raise ArgError(f"--hicache-size {args.hicache_size} must not be negative")
    if args.hicache_size == 0 and args.hicache_ratio < 1:
        args.warnings.append("HiCache host pool is smaller than the device pool "
                             f"(--hicache-ratio {args.hicache_ratio})")


def cpu_memory_mib(env: Mapping[str, str]) -> float | None:
    """SGLang's device memory capacity on ``--device cpu`` (0.5.17
    ``srt/utils/common.py:get_cpu_memory_capacity``): the smallest NUMA node's ``MemTotal`` in
    MiB, or the machine's where no node is listed; None (unknown) when
    ``SGLANG_CPU_OMP_THREADS_BIND`` binds threads by hand."""
    if env.get(OMP_BIND_ENV, ""):
        return None
    nodes = []
    for meminfo in sorted(NUMA_NODES.glob("node[0-9]*/meminfo")):
        parts = meminfo.read_text().split("\n", 1)[0].split()  # "Node 0 MemTotal: N kB"
        if len(parts) >= 4 and parts[2] == "MemTotal:":
            nodes.append(int(parts[3]))
    if nodes:
        return float(min(nodes) // 1024)
    for line in MEMINFO.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return float(int(line.split()[1]) // 1024)
    return None


def default_chunked_prefill_size(device_mib: float | None) -> int:
    """SGLang's chunked-prefill size when none is given, from the device's memory (0.5.17
    ``ServerArgs._handle_gpu_memory_settings``): 2048 below 35 GiB, 4096 below 60, 8192 below
    160, 16384 above; 4096 when the memory is unknown."""
    if device_mib is None:
        return 4096
    for below, size in ((35 * 1024, 2048), (60 * 1024, 4096), (160 * 1024, 8192)):
        if device_mib < below:
            return size
    return 16384


def _resolve_sizes(args: EngineArgs, config: dict, env: Mapping[str, str]) -> None:
    if args.chunked_prefill_size is None:
        # the device is the host's CPU with --device cpu; the embedded engine stands for a GPU
        # server otherwise, whose memory it does not know (SGLang's fallback then)
        args.chunked_prefill_size = default_chunked_prefill_size(
            cpu_memory_mib(env) if args.device == "cpu" else None)
    elif args.chunked_prefill_size <= 0:
        args.chunked_prefill_size = -1
    if args.page_size is None:
        args.page_size = 1
    if args.chunked_prefill_size > 0 and args.chunked_prefill_size % args.page_size:
        raise ArgError(f"--chunked-prefill-size {args.chunked_prefill_size}: "
                       f"chunked_prefill_size must be divisible by page_size ({args.page_size})")
    if args.max_total_tokens is None:
        args.max_total_tokens = 65536
    if args.max_mamba_cache_size is None:
        args.max_mamba_cache_size = 512
    for name in ("max_total_tokens", "max_mamba_cache_size", "max_running_requests"):
        if getattr(args, name) < 1:
            raise ArgError(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    per_req = 2 + (0 if args.disable_radix_cache or args.mamba_radix_cache_strategy != "extra_buffer"
                   else (1 if args.disable_overlap_schedule else 2))
    if args.max_mamba_cache_size < per_req:
        raise ArgError(f"--max-mamba-cache-size {args.max_mamba_cache_size} is too small: one "
                       f"request needs {per_req} state slots with this configuration")
    fit = args.max_mamba_cache_size // per_req
    if fit < args.max_running_requests:
        args.warnings.append(f"max_running_requests reduced from {args.max_running_requests} to "
                             f"{fit} to fit --max-mamba-cache-size {args.max_mamba_cache_size}")
        args.max_running_requests = fit
    limit = config.get("max_position_embeddings", 8192)
    if args.context_length is None:
        args.context_length = limit
