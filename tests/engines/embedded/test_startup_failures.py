"""An embedded engine that cannot start exits at once with a non-zero code and a message naming
the cause, as SGLang's launcher does, instead of serving 503 until its launcher gives up."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest

from evalsvc.engines.launch import EngineProcess, EngineStartError, clean_env, free_port
from evalsvc.paths import MODELS_DIR

# the engine's entry point in a python where the named modules cannot be imported (as when the
# engine extra is not installed)
WITHOUT = ("import sys\nfor name in {names!r}: sys.modules[name] = None\n"
           "from evalsvc.engines.embedded.app import main\nsys.exit(main(sys.argv[1:]))\n")


def start(argv: list[str], port: int, tmp_path: Path) -> tuple[str, float]:
    """Starts an engine that must fail; returns the start-up error and the seconds it took."""
    proc = EngineProcess(argv, port, env=clean_env(), log_path=tmp_path / "engine.log",
                         startup_timeout=60.0)
    t0 = time.monotonic()
    with pytest.raises(EngineStartError) as exc, proc:
        pass
    return str(exc.value), time.monotonic() - t0


@pytest.mark.slow
def test_missing_weights_exit_at_once_naming_the_file(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(MODELS_DIR / "hybrid-mamba2-tiny", model,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    port = free_port()
    message, seconds = start([sys.executable, "-m", "evalsvc.engines.embedded", "--port",
                              str(port), "--model-path", str(model)], port, tmp_path)
    assert seconds < 20
    assert message.startswith("engine exited with code 1 during start-up")
    assert f"engine failed to start: FileNotFoundError: {model / 'model.safetensors'}: no such file" \
        in message


@pytest.mark.slow
@pytest.mark.parametrize("missing", [("torch",), ("safetensors", "safetensors.torch")])
def test_missing_engine_dependency_is_named_with_its_extra(tmp_path, missing):
    port = free_port()
    message, seconds = start([sys.executable, "-c", WITHOUT.format(names=missing), "--port",
                              str(port)], port, tmp_path)
    assert seconds < 20
    assert message.startswith("engine exited with code 1 during start-up")
    assert (f"{missing[0]} is not installed: the embedded engine needs the engine extra "
            "(pip install 'evalsvc[engine]')") in message


@pytest.mark.parametrize("seed", [str(2**70), "-1", str(2**32)])
def test_random_seed_out_of_range_is_refused_naming_the_flag(seed, capsys):
    """Every request's default sampling seed derives from it: one torch refuses would fail them
    all."""
    from evalsvc.engines.embedded.args import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--random-seed", seed], env={})
    assert exc.value.code == 2
    assert f"--random-seed {seed}: must be between 0 and 4294967295" in capsys.readouterr().err


def test_unreadable_model_config_is_refused_naming_the_file(tmp_path, capsys):
    from evalsvc.engines.embedded.args import parse_args

    model = tmp_path / "model"
    shutil.copytree(MODELS_DIR / "hybrid-mamba2-tiny", model)
    (model / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-path", str(model)], env={})
    assert exc.value.code == 2
    assert f"--model-path {model}: {model / 'config.json'} is not valid JSON" in \
        capsys.readouterr().err
