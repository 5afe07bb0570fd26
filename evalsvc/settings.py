"""Service settings: one pydantic-settings class, environment variables with the EVALSVC_ prefix."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EVALSVC_", extra="ignore")

    data_dir: Path = Path("data")
    database_url: str | None = None  # default: SQLite in data_dir

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'evalsvc.db').resolve()}"

    def results_dir(self) -> Path:
        return self.data_dir / "results"
