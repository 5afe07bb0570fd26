"""Check command lines and request payloads against one installed SGLang release (stdlib + sglang).

Run by the python of an env that ``evalsvc.builds.sglang_env`` built, never by evalsvc's own
python, and without importing evalsvc::

    <env python> tests/engines/sglang_check.py < job.json > result.json

The job (JSON on stdin)::

    {"model_path": "<local dir with config.json>", "device": "cpu",
     "commands": [{"id": "...", "argv": ["--model-path", "...", ...]}, ...],
     "payloads": [{"id": "...", "payload": {...}}, ...],
     "vocab_size": 1024, "timeout_s": 120, "tree_core": true}

``argv`` is what follows ``-m sglang.launch_server`` (a full command line is cut there). The
checker replaces the value of ``--model-path`` by ``model_path`` and sets ``--device`` to
``device``; what it parsed is reported as ``argv``.

Per command, as ``sglang.launch_server`` would: parse with ``ServerArgs.add_cli_args`` on a plain
``argparse.ArgumentParser`` (an unknown flag or a bad choice makes argparse exit with code 2: caught
and reported, stage ``parse``), build ``ServerArgs.from_cli_args`` (in 0.5.13 and other releases
with dataclass ServerArgs, ``__post_init__`` runs the whole resolution and validation here: stage
``construct``), then ``resolve_once()`` where the release has it (0.5.23: stage
``resolve``), then ``check_server_args()`` (stage ``check``), which the engine runs before it starts.
Each command runs in a forked child, so the environment variables and module state that one
resolution leaves behind cannot change the next. Reported: ``accepted``, on refusal ``error``
(exception type, message, stage), the warnings SGLang logged (where it changed what was asked for,
it says so there), ``resolved`` (the fields evalsvc's matrix is about) and ``resolved_all`` (every
resolved field: ``resolved_dict()`` where the release has it, else the dataclass fields, as
``/server_info`` reports them). ``mamba_scheduler_strategy`` (releases before 0.5.15) is reported
as ``mamba_radix_cache_strategy`` too.

Per payload: ``GenerateReqInput(**payload)`` and ``normalize_batch_and_arguments()``; then, as the
tokenizer manager does, ``SamplingParams(**sampling_params)`` with ``normalize(None)`` and
``verify(vocab_size)``; where the release has ``entrypoints.api_contract`` (the HTTP server's
``/generate`` body check, 0.5.2x), ``generate_contract_error(payload)`` first.

Patched, because this runs on a machine without a GPU (``--device cpu``), and nothing else
(``"host_patches": false`` in the job leaves SGLang as it is, to check a matrix meant for the CPU
against SGLang's own CPU rules); ``patches`` in the result says which of them this release had:

* 0.5.23 (releases with ``arg_groups`` hooks):
  ``sglang.srt.arg_groups.mamba_hook._platform_supports_mamba_cache_extra_buffer``
  returns True. It asks the platform for CUDA/MUSA/NPU/HIP/XPU; on a CPU host every extra_buffer
  command would be refused for the host, not for its arguments. The other extra_buffer rules in
  ``validate_mamba_extra_buffer`` (arch support, track interval vs. draft tokens, page size) run.
* 0.5.23: ``sglang.srt.arg_groups.speculative_hook._disable_overlap_schedule_for_cpu`` does
  nothing. With ``--device cpu`` it turns the overlap scheduler off for every speculative
  config ("Overlap schedule is not implemented for speculative decoding on CPU"), which a GPU
  server does not do; left in, every MTP config would resolve to overlap off.
* Releases with a dataclass ServerArgs (0.5.13): while ``ServerArgs._handle_mamba_radix_cache``
  runs, and only then, ``sglang.srt.server_args.is_cuda`` returns True, for its assertion "Mamba
  extra_buffer is only supported on CUDA and MUSA and NPU devices with FLA backend" (the method
  uses ``is_cuda`` for nothing else; ``is_hip`` and ``is_sm100_supported`` stay real, as on an
  H100/H200).

Limits: resolution runs with ``--device cpu``, so what SGLang derives from the device is the CPU's
(attention backend ``torch_native`` instead of a GPU backend, memory-derived defaults such as the
chunked-prefill size from host RAM). A command that sets a value explicitly is checked as written;
one that leaves it to the device is not checked for the GPU's choice.

With ``"tree_core": true``, ``check_tree_core`` reports the release's radix-tree cores (registered,
default, whether the Rust one imports, the log line of a fallback to Python).

Output (JSON on stdout; SGLang's own prints go to stderr)::

    {"sglang_version": "...", "patches": [...], "commands": [...], "payloads": [...],
     "tree_core": {...} or null}
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import functools
import importlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import signal
import sys
import traceback
from typing import Any

RESOLVED_FIELDS = (
    "mamba_radix_cache_strategy", "disable_radix_cache", "disable_overlap_schedule",
    "chunked_prefill_size", "enable_hierarchical_cache", "hicache_ratio", "hicache_write_policy",
    "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
    "speculative_num_draft_tokens", "max_running_requests", "mamba_track_interval",
)
RENAMED = {"mamba_scheduler_strategy": "mamba_radix_cache_strategy"}  # old name -> newest name
MAX_WARNINGS = 40
MAX_MESSAGE = 4000


# ---- patches ---------------------------------------------------------------------------------

def _true(*_args: Any, **_kwargs: Any) -> bool:
    return True


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


def apply_patches() -> list[dict[str, Any]]:
    """The CPU-host patches (see the module docstring); each reports whether this release had it."""
    patches = []

    def replace(module: str, attr: str, value: Any, why: str) -> None:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            mod = None
        applied = mod is not None and hasattr(mod, attr)
        if applied:
            setattr(mod, attr, value)
        patches.append({"target": f"{module}.{attr}", "applied": applied, "why": why})

    replace("sglang.srt.arg_groups.mamba_hook", "_platform_supports_mamba_cache_extra_buffer", _true,
            "returns True: the platform check refuses extra_buffer on a host without a GPU")
    replace("sglang.srt.arg_groups.speculative_hook", "_disable_overlap_schedule_for_cpu", _nothing,
            "does nothing: --device cpu turns overlap off for speculative decoding, a GPU does not")

    import sglang.srt.server_args as server_args_module

    server_args_cls = server_args_module.ServerArgs
    method = getattr(server_args_cls, "_handle_mamba_radix_cache", None)
    applied = method is not None and hasattr(server_args_module, "is_cuda")
    if applied:
        @functools.wraps(method)
        def handle_mamba_radix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
            saved = server_args_module.is_cuda
            server_args_module.is_cuda = _true
            try:
                return method(self, *args, **kwargs)
            finally:
                server_args_module.is_cuda = saved

        server_args_cls._handle_mamba_radix_cache = handle_mamba_radix_cache
    patches.append({"target": "sglang.srt.server_args.is_cuda (inside "
                              "ServerArgs._handle_mamba_radix_cache only)", "applied": applied,
                    "why": "returns True there: the method asserts a CUDA/MUSA/NPU device for "
                           "extra_buffer"})
    return patches


# ---- helpers ---------------------------------------------------------------------------------

def jsonable(value: Any, depth: int = 0) -> Any:
    """A JSON-safe copy: enums by value, records and unknown objects by fields or repr."""
    if depth > 8:
        return repr(value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else repr(value)
    if isinstance(value, enum.Enum):
        return jsonable(value.value, depth + 1)
    if isinstance(value, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v, depth + 1) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name, None), depth + 1)
                for f in dataclasses.fields(value)}
    return repr(value)


def error_of(exc: BaseException, stage: str) -> dict[str, Any]:
    message = str(exc)
    if isinstance(exc, SystemExit):
        message = f"exit code {exc.code}"
    return {"type": type(exc).__name__, "message": message[:MAX_MESSAGE], "stage": stage,
            "where": _where(exc)}


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if "sglang" in frame.filename:
            return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} ({frame.name})"
    return ""


class _Warnings(logging.Handler):
    """Collects what SGLang logs at WARNING and above during one resolution."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            text = record.getMessage()
            if text not in self.messages and len(self.messages) < MAX_WARNINGS:
                self.messages.append(text[:MAX_MESSAGE])


@contextlib.contextmanager
def collect_warnings() -> Any:
    handler = _Warnings()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler.messages
    finally:
        root.removeHandler(handler)


def tracking_imports(fn: Any) -> Any:
    """``fn`` that also reports the modules it imported (``_new_modules``), in import order."""

    @functools.wraps(fn)
    def wrapper(*args: Any) -> dict[str, Any]:
        before = set(sys.modules)
        result = fn(*args)
        result["_new_modules"] = [m for m in list(sys.modules) if m not in before]
        return result

    return wrapper


def warm_imports(names: list[str]) -> None:
    """Import in this (the parent) process what a check imported lazily, so that later forked
    checks start with it imported, as the first one ended (SGLang imports a thousand modules
    while it resolves; this saves seconds per command). Module state only: nothing is resolved
    here, so no check sees another's leftovers."""
    for name in names:
        if name not in sys.modules:
            with contextlib.suppress(BaseException):
                importlib.import_module(name)


def isolated(fn: Any, timeout_s: int, *args: Any) -> dict[str, Any]:
    """``fn(*args)`` in a forked child (fresh module state and environment each time)."""
    if not hasattr(os, "fork"):
        saved = dict(os.environ)
        try:
            return fn(*args)
        finally:
            os.environ.clear()
            os.environ.update(saved)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(read_fd)
            signal.alarm(max(1, int(timeout_s)))
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - reported, whatever it is
                result = {"accepted": False, "error": error_of(exc, "checker")}
            data = json.dumps(result).encode()
            with os.fdopen(write_fd, "wb") as out:
                out.write(data)
        except BaseException:  # noqa: BLE001 - the parent reports the empty pipe
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if data:
        return json.loads(data)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
        why = f"timed out after {timeout_s} s"
    elif os.WIFSIGNALED(status):
        why = f"killed by signal {os.WTERMSIG(status)}"
    else:
        why = f"exit status {os.WEXITSTATUS(status)}"
    return {"accepted": False, "error": {"type": "CheckerCrash", "message": f"the check {why}",
                                         "stage": "checker", "where": ""}}


# ---- commands --------------------------------------------------------------------------------

def prepare_argv(argv: list[str], model_path: str, device: str | None) -> list[str]:
    argv = [str(a) for a in argv]
    if "sglang.launch_server" in argv:
        argv = argv[argv.index("sglang.launch_server") + 1:]
    argv = set_option(argv, "--model-path", model_path)
    if device:
        argv = set_option(argv, "--device", device)
    return argv


def set_option(argv: list[str], flag: str, value: str) -> list[str]:
    out: list[str] = []
    found = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag:
            out += [flag, value]
            found = True
            i += 2
            continue
        if arg.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(arg)
        i += 1
    return out if found else [*out, flag, value]


def check_command(argv: list[str]) -> dict[str, Any]:
    from sglang.srt.server_args import ServerArgs

    result: dict[str, Any] = {"argv": argv, "accepted": False, "error": None, "warnings": [],
                              "resolved": None, "resolved_all": None}
    with collect_warnings() as warned:
        stage = "parse"
        try:
            parser = argparse.ArgumentParser(prog="sglang.launch_server")
            ServerArgs.add_cli_args(parser)
            stderr = io.StringIO()
            try:
                with contextlib.redirect_stderr(stderr):
                    namespace = parser.parse_args(argv)
            except SystemExit as exc:
                lines = [ln for ln in stderr.getvalue().splitlines() if ln.strip()]
                message = next((ln for ln in reversed(lines) if ": error:" in ln),
                               lines[-1] if lines else f"exit code {exc.code}")
                result["error"] = {"type": "SystemExit", "exit_code": exc.code,
                                   "message": message[:MAX_MESSAGE], "stage": "parse", "where": ""}
                return result
            stage = "construct"
            server_args = ServerArgs.from_cli_args(namespace)
            if hasattr(server_args, "resolve_once"):
                stage = "resolve"
                server_args.resolve_once()
            stage = "check"
            server_args.check_server_args()
            stage = "report"
            resolved = resolved_fields(server_args)
        except BaseException as exc:  # noqa: BLE001 - a refusal may be any exception, even SystemExit
            result["error"] = error_of(exc, stage)
            return result
        finally:
            result["warnings"] = list(warned)
    result["accepted"] = True
    result["resolved_all"] = resolved
    result["resolved"] = {k: resolved.get(k) for k in RESOLVED_FIELDS}
    return result


def resolved_fields(server_args: Any) -> dict[str, Any]:
    if hasattr(server_args, "resolved_dict"):
        raw = server_args.resolved_dict()
    else:
        raw = {f.name: getattr(server_args, f.name) for f in dataclasses.fields(server_args)}
    out = jsonable(raw)
    for old, new in RENAMED.items():
        if old in out and new not in out:
            out[new] = out[old]
    return out


# ---- payloads --------------------------------------------------------------------------------

def check_payload(payload: Any, vocab_size: int) -> dict[str, Any]:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    result: dict[str, Any] = {"accepted": False, "error": None, "normalized": None, "checks": []}
    stage = "contract"
    try:
        if importlib.util.find_spec("sglang.srt.entrypoints.api_contract") is not None:
            from sglang.srt.entrypoints.api_contract import generate_contract_error

            result["checks"].append(stage)
            problem = generate_contract_error(payload)
            if problem is not None:
                result["error"] = {"type": "ContractError", "message": str(problem)[:MAX_MESSAGE],
                                   "stage": stage, "where": ""}
                return result
        stage = "GenerateReqInput"
        result["checks"].append(stage)
        if not isinstance(payload, dict):
            raise TypeError(f"a /generate body is a JSON object, got {type(payload).__name__}")
        obj = GenerateReqInput(**payload)
        stage = "normalize_batch_and_arguments"
        result["checks"].append(stage)
        obj.normalize_batch_and_arguments()
        stage = "SamplingParams"
        result["checks"].append(stage)
        params = obj.sampling_params
        for sampling in params if isinstance(params, list) else [params]:
            sp = SamplingParams(**(sampling or {}))
            sp.normalize(None)
            sp.verify(vocab_size)
    except BaseException as exc:  # noqa: BLE001 - a refusal may be any exception
        result["error"] = error_of(exc, stage)
        return result
    result["accepted"] = True
    result["normalized"] = jsonable({k: getattr(obj, k, None) for k in (
        "is_single", "batch_size", "return_logprob", "logprob_start_len", "top_logprobs_num",
        "sampling_params")})
    return result


# ---- the radix-tree core ---------------------------------------------------------------------

TREE_CORE_REGISTRY = "sglang.srt.mem_cache.unified_cache.tree_core_registry"
RUST_TREE_CORE = "sglang.srt.mem_cache.rust_tree_core.mem_cache"


def check_tree_core() -> dict[str, Any]:
    """The release's radix-tree cores: those it registers, its default
    (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` unset), whether its Rust core imports here, and
    the line its log shows when it falls back to Python (the release's own logger setup and
    ``resolve_tree_core_backend``, asked for ``rust`` by a session-aware cache, which the Rust
    core does not support). Releases without a registry register nothing."""
    out: dict[str, Any] = {"registered": [], "default": None, "rust_imports": None,
                           "rust_error": None, "fallback_line": None}
    try:
        registry = importlib.import_module(TREE_CORE_REGISTRY)
    except ModuleNotFoundError as exc:
        if exc.name is None or not TREE_CORE_REGISTRY.startswith(exc.name):
            raise
        return out
    from sglang.srt.environ import envs

    os.environ.pop("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", None)
    out["registered"] = list(registry.registered_tree_core_backends())
    out["default"] = envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.get()
    if "rust" in out["registered"]:
        try:
            importlib.import_module(RUST_TREE_CORE)
            out["rust_imports"] = True
        except Exception as exc:  # noqa: BLE001 - reported
            out["rust_imports"], out["rust_error"] = False, f"{type(exc).__name__}: {exc}"
    if hasattr(registry, "resolve_tree_core_backend"):
        from sglang.srt.utils import configure_logger

        configure_logger(type("Args", (), {"log_level": "info"})(), prefix=" TP0")
        captured = io.StringIO()
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(captured)
        params = type("Params", (), {"enable_session_radix_cache": True})()
        out["fallback_core"] = registry.resolve_tree_core_backend("rust", params)
        out["fallback_line"] = next((ln for ln in captured.getvalue().splitlines()
                                     if "TreeCore" in ln), None)
    return out


# ---- main ------------------------------------------------------------------------------------

def run(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import sglang  # noqa: F401  (import errors are the env's, and fatal)

    # "host_patches": false checks a matrix for the CPU itself (a CPU matrix, SGLang's CPU rules)
    patches = apply_patches() if job.get("host_patches", True) else []
    timeout_s = int(job.get("timeout_s", 120))
    model_path = str(job["model_path"])
    device = job.get("device", "cpu")
    warmed: set[Any] = set()

    def check(fn: Any, *args: Any) -> dict[str, Any]:
        res = isolated(fn if fn in warmed else tracking_imports(fn), timeout_s, *args)
        if fn not in warmed:
            warm_imports(res.pop("_new_modules", None) or [])
            warmed.add(fn)
        return res

    commands = []
    for i, cmd in enumerate(job.get("commands", [])):
        argv = prepare_argv(list(cmd["argv"]), model_path, device)
        commands.append({"id": cmd.get("id", str(i)), **check(check_command, argv)})
    payloads = []
    vocab_size = int(job.get("vocab_size", 1024))
    for i, item in enumerate(job.get("payloads", [])):
        res = check(check_payload, item.get("payload"), vocab_size)
        payloads.append({"id": item.get("id", str(i)), **res})
    tree_core = check(check_tree_core) if job.get("tree_core") else None
    return {"sglang_version": importlib.metadata.version("sglang"), "python": sys.version.split()[0],
            "device": device, "patches": patches, "commands": commands, "payloads": payloads,
            "tree_core": tree_core}


def main() -> int:
    job = json.load(sys.stdin)
    out = os.fdopen(os.dup(1), "w")  # the result; everything else SGLang prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    result = run(job)
    json.dump(result, out)
    out.write("\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
