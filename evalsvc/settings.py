"""Service settings: one pydantic-settings class, environment variables with the EVALSVC_ prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EVALSVC_", extra="ignore")

    data_dir: Path = Path("data")
    database_url: str | None = None  # default: SQLite in data_dir
    host: str = "127.0.0.1"
    port: int = 8000
    api_token: str | None = None  # bearer token for mutating endpoints
    read_token: str | None = None  # bearer token for reads (open when unset)
    engine_slots: int = 1  # runs at once (engines on this machine)
    engine_python: str | None = None  # python of the SGLang environment builds are laid over
    # runs go to this Ray cluster (what ray.init(address=...) takes: HOST:6379, ray://HOST:10001
    # or auto) instead of the engine slots here; needs the ray extra
    ray_address: str | None = None
    ray_slot_resource: str = "GPU"  # the Ray resource a run requests tp_size of
    ray_retries: int = 1  # times Ray starts a run again when its worker or node died
    # fnmatch patterns of the build sources jobs may name (comma-separated in the environment)
    allowed_sources: Annotated[list[str], NoDecode] = ["sglang==*", "pypi:*"]
    nightly_file: Path | None = None  # default: configs/nightly.yaml
    nightly: bool = True  # run the nightly schedules inside the service
    alert_webhook: str | None = None  # Slack-compatible incoming webhook for regression alerts
    public_url: str | None = None  # the dashboard's address, for links in alerts
    # runner
    # a job the runner took up this many times without finishing it (each time the service died
    # while running it) is failed by the next start-up's recovery instead of tried again
    runner_max_attempts: int = Field(3, ge=1)
    # engines
    # a run's deadline in seconds, engine start-up included, for matrices without run_timeout_s:
    # past it the run is an error and its engine is killed (the smoke matrix's runs take minutes)
    run_timeout_s: float = Field(1800.0, gt=0, le=7 * 86400)

    @field_validator("allowed_sources", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'evalsvc.db').resolve()}"

    def results_dir(self) -> Path:
        return self.data_dir / "results"
