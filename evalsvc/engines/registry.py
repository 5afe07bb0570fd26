"""The engine kinds, keyed by the name a matrix, a job and ``evalsvc run --engine`` give: what each
kind does differently, in one place. Adding a kind is one entry in ``ENGINES``; the rest of the
package asks the entry (``engine_kind(name)``) for a capability instead of comparing names.

* ``embedded``: the service's own engine (``evalsvc.engines.embedded``), run in the service's
  python; its builds are its own code read where the service runs (``builds.embedded``), and it
  can plant defects on purpose.
* ``sglang``: a real SGLang server, run in an SGLang environment (``builds.engine_envs``), its
  command line spelled for its release; its builds are SGLang made from a source with fix patches
  (``builds.build``), where the runs go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from evalsvc.engines.launch import embedded_command
from evalsvc.engines.sglang_server import (
    TREE_CORE_ENV,
    build_command,
    build_flags,
    engine_flags,
    loopback,
)

# ServerArgs fields a matrix may set in ``extra_args``, per engine: tuning of the caches, the
# scheduler, speculative decoding and memory. Never the model, host, port, remote code, or anything
# naming a file or a network address; never what the axes and the hicache / mtp sections set.
EMBEDDED_FLAGS = frozenset({
    "mamba_track_interval", "mamba_ssm_dtype", "max_mamba_cache_size", "max_running_requests",
    "max_total_tokens", "random_seed", "page_size", "mem_fraction_static", "enable_metrics",
    "skip_server_warmup", "device", "dtype", "context_length", "hicache_size", "log_level",
    "load_format",
})
SGLANG_FLAGS = EMBEDDED_FLAGS | frozenset({
    "attention_backend", "prefill_attention_backend", "decode_attention_backend",
    "sampling_backend", "cuda_graph_max_bs", "disable_cuda_graph", "disable_cuda_graph_padding",
    "enable_torch_compile", "torch_compile_max_bs", "mamba_full_memory_ratio",
    "max_prefill_tokens", "schedule_policy", "schedule_conservativeness", "kv_cache_dtype",
    "quantization", "stream_interval", "enable_mixed_chunk", "disable_custom_all_reduce",
    "max_queued_requests", "num_continuous_decode_steps", "triton_attention_num_kv_splits",
    "speculative_accept_threshold_single", "speculative_accept_threshold_acc",
    "speculative_attention_mode", "watchdog_timeout", "cuda_graph_backend_prefill",
    "mamba_max_states_per_path", "enable_int8_mamba_checkpoint", "int8_mamba_ckpt_size",
    "sleep_on_idle", "swa_full_tokens_ratio",
})
# SGLang's engine variables that take one value each: Triton's interpreter (SGLang's Triton kernels
# with no CPU branch, Inkling's short convolutions, run in it) and the SGLang CPU environment's
# model package (evalsvc.builds.sglang_cpu: model classes of this project's under Inkling's names)
SGLANG_ENV_VALUES = {"TRITON_INTERPRET": ("1",),
                     "SGLANG_EXTERNAL_MODEL_PACKAGE": ("evalsvc_sglang_models",)}
EMBEDDED_MODEL_TYPE = "evalsvc_hybrid"  # what the embedded engine's config.json says


class CommandBuilder(Protocol):
    """The argument list that starts a server: ``(args, port=, python=, version=, host=)``, with
    ``args`` a config's ServerArgs fields (plus model_path)."""

    def __call__(self, args: dict[str, Any], *, port: int, python: str, version: str | None,
                 host: str) -> list[str]: ...


def _embedded_command(args: dict[str, Any], *, port: int, python: str, version: str | None,
                      host: str) -> list[str]:
    return embedded_command(port, ["--model-path", str(args["model_path"]),
                                   "--host", loopback(host), *build_flags(engine_flags(args))],
                            python=python)


def _sglang_command(args: dict[str, Any], *, port: int, python: str, version: str | None,
                    host: str) -> list[str]:
    return build_command(args, port=port, python=python, version=version, host=host)


@dataclass(frozen=True)
class EngineKind:
    """One engine kind: how its servers start, and what it takes."""

    name: str
    command: CommandBuilder
    # what a server of this kind has in its command line (``/proc/PID/cmdline``): how a restarted
    # service tells an engine it left running from another process with the same pid
    process_marker: str
    flags: frozenset[str]  # ServerArgs fields a matrix may set in ``extra_args``
    env: frozenset[str]  # environment variables a matrix may give it (``engine_env``)
    hardware: str  # the hardware class its configs' fingerprints name
    # runs in an SGLang environment of its own (``builds.engine_envs``: EVALSVC_ENGINE_PYTHON, a
    # job's ``engine_env``, ``--engine-python``); otherwise in the service's own python
    uses_engine_envs: bool = False
    # its command line is spelled for a release (``EngineSpec.version``), and a matrix's
    # ``sglang_version`` excludes apply to it
    versioned: bool = False
    # its builds are its own code, read where the service runs (``builds.embedded``: a source
    # git:REPO@COMMIT or path:DIR, patches ``defect:NAME``); otherwise an SGLang build made from a
    # source with fix patches (``builds.build``) where the runs go
    local_builds: bool = False
    injects_defects: bool = False  # plants defects on purpose (``--inject-defect``, defect:NAME)
    # takes a shipped model (``evalsvc/assets/models``) by its name, as the engine finds it
    shipped_models: bool = False
    # a model named like a shipped SGLang checkpoint (``evalsvc/assets/sglang-models/NAME``) is
    # that directory
    shipped_checkpoints: bool = False
    hub_models: bool = False  # takes a hub model id (NAME or NAMESPACE/NAME) and downloads it
    rust_tree_core: bool = False  # may run SGLang's Rust radix-tree core (else Python only)
    # on a CPU (``extra_args.device: cpu``) serves its gated-deltanet layers with the ops a
    # matrix's ``cpu_ops`` picks (real SGLang's CPU engine)
    cpu_ops: bool = False
    # serves MTP through SGLang's multi-layer EAGLE worker (a matrix's ``mtp.multi_layer``)
    multi_layer_mtp: bool = False
    # the ``model_type`` values (config.json) of the models it serves; None: every other
    model_types: frozenset[str] | None = None


ENGINES: dict[str, EngineKind] = {e.name: e for e in (
    EngineKind("embedded", _embedded_command, process_marker="evalsvc.engines.embedded",
               flags=EMBEDDED_FLAGS, env=frozenset({"EVALSVC_ENGINE_THREADS", TREE_CORE_ENV}),
               hardware="cpu", local_builds=True, injects_defects=True, shipped_models=True,
               model_types=frozenset({EMBEDDED_MODEL_TYPE})),
    EngineKind("sglang", _sglang_command, process_marker="sglang", flags=SGLANG_FLAGS,
               env=frozenset({"SGLANG_USE_CPU_ENGINE", TREE_CORE_ENV, *SGLANG_ENV_VALUES}),
               hardware="gpu",
               uses_engine_envs=True, versioned=True, shipped_checkpoints=True, hub_models=True,
               rust_tree_core=True, cpu_ops=True, multi_layer_mtp=True),
)}
DEFAULT_ENGINE = "embedded"  # a matrix's engine when it names none
# the engine names as a type (pydantic fields: a matrix's ``engine``, a job's, an EngineSpec's)
EngineName = Literal[tuple(ENGINES)]  # type: ignore[valid-type]


def engine_kind(name: str) -> EngineKind:
    """The kind named ``name`` (KeyError naming the known ones)."""
    try:
        return ENGINES[name]
    except KeyError:
        raise KeyError(f"unknown engine {name!r} (known: {known_engines()})") from None


def known_engines(joiner: str = " or ") -> str:
    """The kinds' names as a message lists them: 'embedded or sglang'."""
    return joiner.join(ENGINES)


def kinds_with(capability: str, has: bool = True) -> list[str]:
    """The names of the kinds that have ``capability`` (an ``EngineKind`` flag); with ``has``
    false, those that lack it."""
    return [name for name, e in ENGINES.items() if bool(getattr(e, capability)) is has]


def serving_engine(model_type: Any) -> str:
    """The kind that serves a model whose config.json says ``model_type``."""
    for name, e in ENGINES.items():
        if e.model_types is not None and model_type in e.model_types:
            return name
    return next(name for name, e in ENGINES.items() if e.model_types is None)


def is_engine_process(cmdline: str) -> bool:
    """Whether a process's command line is that of an engine of some kind."""
    return any(e.process_marker in cmdline for e in ENGINES.values())
