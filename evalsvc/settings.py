"""Service settings: one pydantic-settings class, environment variables with the EVALSVC_ prefix."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from evalsvc.paths import check_configs_dir

Role = Literal["read", "write"]
USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}")
ENGINE_ENV_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# the names the single tokens and an open service act under (evalsvc/web/auth.py)
RESERVED_USER_NAMES = ("api-token", "read-token", "anonymous")


class UserConfig(BaseModel):
    """One user of ``EVALSVC_USERS``: a name, a role, and a token or the SHA-256 of one (64 hex
    digits: ``printf %s TOKEN | sha256sum``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="letters, digits, '.', '_', '@', '+', '-'; at most 64")
    role: Role = "read"
    token: SecretStr | None = Field(None, min_length=16)
    token_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not USER_NAME.fullmatch(name):
            raise ValueError(f"{name[:80]!r} is not a user name (letters, digits, '.', '_', '@', "
                             "'+', '-', at most 64)")
        if name in RESERVED_USER_NAMES:
            raise ValueError(f"{name!r} is reserved (the names of the single tokens and of an "
                             "open service)")
        return name

    @model_validator(mode="after")
    def _one_token(self) -> UserConfig:
        if (self.token is None) == (self.token_sha256 is None):
            raise ValueError(f"user {self.name}: give token or token_sha256 (one of them)")
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EVALSVC_", extra="ignore")

    data_dir: Path = Path("data")
    database_url: str | None = None  # default: SQLite in data_dir
    host: str = "127.0.0.1"
    port: int = 8000
    api_token: str | None = None  # bearer token for mutating endpoints
    read_token: str | None = None  # bearer token for reads (open when unset)
    # people: JSON, [{"name": "alice", "role": "write", "token_sha256": "..."}, ...]; their tokens
    # sign in to the dashboard and are bearer tokens of the API (with any user, reads need one)
    users: Annotated[list[UserConfig], NoDecode] = Field(default_factory=list)
    # behind a reverse proxy that authenticates: the header naming the user (X-Forwarded-User);
    # honoured only when set, and then the service must be reachable through that proxy alone
    trusted_user_header: str | None = Field(None, pattern=r"^[A-Za-z0-9-]{1,100}$")
    # the role of a user the header names who is not in EVALSVC_USERS (one who is has theirs)
    trusted_user_role: Role = "read"
    # signs the dashboard's session cookie; unset: a random one per start (sign-ins end with it)
    session_secret: SecretStr | None = Field(None, min_length=16)
    session_max_age_s: int = Field(12 * 3600, ge=60, le=90 * 86400)  # a sign-in lasts this long
    session_https_only: bool = False  # the cookie's Secure flag: set it when served over HTTPS
    engine_slots: int = 1  # runs at once (engines on this machine)
    engine_python: str | None = None  # python of the SGLang environment builds are laid over
    # SGLang environments jobs may name (engine_env), JSON: {"NAME": "/path/to/bin/python", ...};
    # EVALSVC_ENGINE_PYTHON is the one named "default" (evalsvc/builds/engine_envs.py)
    engine_envs: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    # also name the environments `make sglang-cpu` and the SGLang env builder made where they make
    # them (the checkout's .venv-sglang-cpu, EVALSVC_SGLANG_ENV_DIR or ~/.cache/evalsvc/sglang-envs)
    discover_engine_envs: bool = True
    # models jobs may name besides the shipped ones: each subdirectory with a config.json
    models_dir: Path | None = None
    # runs go to this Ray cluster (what ray.init(address=...) takes: HOST:6379, ray://HOST:10001
    # or auto) instead of the engine slots here; needs the ray extra
    ray_address: str | None = None
    ray_slot_resource: str = "GPU"  # the Ray resource a run requests tp_size of
    ray_retries: int = 1  # times Ray starts a run again when its worker or node died
    # fnmatch patterns of the build sources jobs may name (comma-separated in the environment)
    allowed_sources: Annotated[list[str], NoDecode] = ["sglang==*", "pypi:*"]
    # the operator's own matrices (and thresholds.yaml, nightly.yaml), looked up before the shipped
    # ones in evalsvc/configs: a file here overrides the shipped file of the same name
    configs_dir: Path | None = Field(
        None, description="EVALSVC_CONFIGS_DIR: a directory of the operator's own matrices "
        "(NAME.yaml), thresholds.yaml and nightly.yaml, looked up before the shipped ones "
        "(evalsvc/configs); a file here overrides the shipped file of the same name, the other "
        "shipped files stay available. Unset or empty: the shipped files alone.")
    nightly_file: Path | None = None  # default: nightly.yaml of configs_dir, else the shipped one
    nightly: bool = True  # run the nightly schedules inside the service
    alert_webhook: str | None = None  # Slack-compatible incoming webhook for regression alerts
    public_url: str | None = None  # the dashboard's address, for links in alerts
    # http
    # the largest request body taken, in bytes; a larger one is refused with 413 before it is read
    max_body_bytes: int = Field(1024 * 1024, ge=1)
    # limits on what one submitted job may expand to, checked at submission (422 naming them)
    max_configs_per_job: int = Field(256, ge=1)  # configs x builds
    # values of one axis, include + exclude entries, and the axes' cross product before exclusion
    max_matrix_entries: int = Field(1000, ge=1)
    max_job_prompts: int = Field(20_000, ge=1)  # prompts x configs x builds
    max_job_tokens: int = Field(2_000_000, ge=1)  # max_new_tokens x prompts x configs x builds
    max_matrix_bytes: int = Field(262_144, ge=1)  # an inline matrix, as JSON
    # local dataset files API jobs may name lie under this directory (None: none may)
    datasets_dir: Path | None = None
    # engine builds and git mirrors (evalsvc/builds); default: data_dir/builds
    builds_dir: Path | None = None
    # engines
    # a run's deadline in seconds, engine start-up included, for matrices without run_timeout_s:
    # past it the run is an error and its engine is killed (the smoke matrix's runs take minutes)
    run_timeout_s: float = Field(1800.0, gt=0, le=7 * 86400)
    # runner
    # a job the runner took up this many times without finishing it (each time the service died
    # while running it) is failed by the next start-up's recovery instead of tried again
    runner_max_attempts: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _distinct_users(self) -> Settings:
        names = [u.name for u in self.users]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"users: {', '.join(twice)} named more than once")
        return self

    @field_validator("users", mode="before")
    @classmethod
    def _users_json(cls, value):
        """JSON in the environment; empty (compose's ``${EVALSVC_USERS:-}``): none."""
        if not isinstance(value, str):
            return value
        if not value.strip():
            return []
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not valid JSON ({exc}): a list of {{\"name\", \"role\", "
                             "\"token\" or \"token_sha256\"} objects") from None

    @field_validator("engine_envs", mode="before")
    @classmethod
    def _engine_envs_json(cls, value):
        """JSON in the environment; empty: none."""
        if not isinstance(value, str):
            return value
        if not value.strip():
            return {}
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not valid JSON ({exc}): an object of environment names and the "
                             "paths of their pythons, {\"NAME\": \"/path/bin/python\"}") from None

    @field_validator("engine_envs")
    @classmethod
    def _engine_env_names(cls, envs: dict[str, str]) -> dict[str, str]:
        for name, python in envs.items():
            if not ENGINE_ENV_NAME.fullmatch(name):
                raise ValueError(f"{name[:80]!r} is not an environment name (letters, digits, "
                                 "'.', '_', '-', at most 64)")
            if not python.strip():
                raise ValueError(f"{name}: an empty python path")
        return envs

    @model_validator(mode="after")
    def _one_default_env(self) -> Settings:
        if self.engine_python and "default" in self.engine_envs:
            raise ValueError("engine_envs: 'default' is EVALSVC_ENGINE_PYTHON's name; give the "
                             "default environment one way")
        return self

    @field_validator("trusted_user_header", "session_secret", "engine_python", "models_dir",
                     mode="before")
    @classmethod
    def _empty_is_unset(cls, value):
        """An empty variable (compose's ``${EVALSVC_SESSION_SECRET:-}``) sets nothing."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("configs_dir", mode="before")
    @classmethod
    def _configs_dir(cls, value):
        """An existing directory (evalsvc.paths reads the same variable with the same check)."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        return check_configs_dir(value)

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

    def resolved_builds_dir(self) -> Path:
        """Where engine builds and git mirrors are cached (``EVALSVC_BUILDS_DIR``, else
        ``data_dir/builds``), absolute."""
        return (self.builds_dir or self.data_dir / "builds").resolve()
