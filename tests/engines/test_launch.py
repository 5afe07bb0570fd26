"""The environment an engine gets: a real embedded engine started the way the harness starts one
(``evalsvc.engines.base.launch``) inherits none of the service's secrets, and keeps the rest."""

from __future__ import annotations

from pathlib import Path

from evalsvc.engines.base import EngineSpec, launch
from evalsvc.engines.launch import PORT_HEADROOM, free_port
from evalsvc.paths import MODELS_DIR

SECRETS = {
    "EVALSVC_API_TOKEN": "write-secret",
    "EVALSVC_READ_TOKEN": "read-secret",
    "EVALSVC_DATABASE_URL": "postgresql+psycopg://evalsvc:pw@db/evalsvc",
    "EVALSVC_ALERT_WEBHOOK": "https://hooks.example.com/services/T0/B0/key",
    "EVALSVC_TEST_POSTGRES_URL": "postgresql+psycopg://postgres:pw@127.0.0.1/postgres",
    "RAY_AUTH_TOKEN": "ray-secret",
    "PGPASSWORD": "pg-secret",
    "POSTGRES_PASSWORD": "pg-secret",
}
KEPT = {"HF_TOKEN": "hf-read-token", "EVALSVC_ENGINE_THREADS": "1", "EVALSVC_TEST_KEPT": "yes"}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if item)


def test_an_engine_inherits_none_of_the_service_secrets(monkeypatch, tmp_path):
    for name, value in {**SECRETS, **KEPT}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("EVALSVC_ENGINE_DEFECTS", raising=False)
    port = free_port()
    model = sorted(p for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())[0]
    proc = launch(EngineSpec(kind="embedded", env={"EXTRA": "1"}),
                  {"model_path": str(model), "random_seed": 0}, port, tmp_path / "engine.log")
    try:
        env = environ(proc.proc.pid)
    finally:
        proc.stop()
    leaked = sorted(name for name in SECRETS if name in env)
    assert not leaked, f"the engine inherited {leaked}"
    assert not [v for v in env.values() if any(s in v for s in SECRETS.values())]
    for name, value in {**KEPT, "EXTRA": "1"}.items():
        assert env.get(name) == value, name


def test_free_ports_leave_room_for_the_ports_sglang_derives_from_them():
    """SGLang 0.5.12 starts its gRPC port at the server's port + 10000 and refuses one past
    65535; the ephemeral range reaches 60999."""
    assert all(free_port() + PORT_HEADROOM <= 65535 for _ in range(50))
