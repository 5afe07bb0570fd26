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

    data_dir: Path = Field(Path("data"), description="where the service keeps its data: the "
                           "SQLite store, results, logs and builds (each unless set otherwise)")
    database_url: str | None = Field(None, description="the store's SQLAlchemy URL, PostgreSQL "
                                     "included; unset: SQLite at data_dir/evalsvc.db")
    host: str = Field("127.0.0.1", description="the address the service binds")
    port: int = Field(8000, description="the port the service listens on")
    api_token: str | None = Field(None, description="the write token: the bearer token every "
                                  "write needs (unset, and no user of role write: the service "
                                  "binds loopback only)")
    read_token: str | None = Field(None, description="the bearer token every read needs: the "
                                   "API, the dashboard's pages, /metrics (unset: reads are open)")
    users: Annotated[list[UserConfig], NoDecode] = Field(
        default_factory=list, description="people, as JSON: [{\"name\": \"alice\", \"role\": "
        "\"write\", \"token_sha256\": \"...\"}, ...]; their tokens sign in to the dashboard and are "
        "bearer tokens of the API (with any user, reads need one)")
    trusted_user_header: str | None = Field(
        None, pattern=r"^[A-Za-z0-9-]{1,100}$",
        description="behind a reverse proxy that authenticates: the header naming the user "
        "(X-Forwarded-User); honoured only when set, and then the service must be reachable "
        "through that proxy alone")
    trusted_user_role: Role = Field("read", description="the role of a user the trusted header "
                                    "names who is not in EVALSVC_USERS (one who is has theirs)")
    session_secret: SecretStr | None = Field(
        None, min_length=16, description="signs the dashboard's session cookie; unset: a random "
        "one per start, so sign-ins end when the service stops")
    session_max_age_s: int = Field(12 * 3600, ge=60, le=90 * 86400,
                                   description="how long a sign-in lasts, in seconds")
    session_https_only: bool = Field(False, description="the session cookie's Secure flag: set "
                                     "it for a dashboard served over HTTPS")
    engine_slots: int = Field(1, description="runs at once (engines on this machine)")
    engine_python: str | None = Field(None, description="python of the SGLang environment builds "
                                      "are laid over (the environment named default)")
    engine_envs: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict, description="SGLang environments jobs may name (engine_env), as "
        "JSON: {\"NAME\": \"/path/to/bin/python\", ...}; EVALSVC_ENGINE_PYTHON is the one named "
        "default (evalsvc/builds/engine_envs.py)")
    discover_engine_envs: bool = Field(
        True, description="also name the environments `make sglang-cpu` and the SGLang env "
        "builder made where they make them (the checkout's .venv-sglang-cpu, "
        "EVALSVC_SGLANG_ENV_DIR or ~/.cache/evalsvc/sglang-envs)")
    models_dir: Path | None = Field(None, description="models jobs may name besides the shipped "
                                    "ones: each subdirectory with a config.json (unset: only the "
                                    "shipped models)")
    ray_address: str | None = Field(
        None, description="runs go to this Ray cluster (what ray.init(address=...) takes: "
        "HOST:6379, ray://HOST:10001 or auto) instead of the engine slots here; needs the ray "
        "extra")
    ray_slot_resource: str = Field("GPU", description="the Ray resource a run requests tp_size "
                                   "of")
    ray_retries: int = Field(1, description="times Ray starts a run again when its worker or node "
                             "died")
    allowed_sources: Annotated[list[str], NoDecode] = Field(
        ["sglang==*", "pypi:*"], description="fnmatch patterns of the build sources jobs may name "
        "(comma-separated)")
    configs_dir: Path | None = Field(
        None, description="a directory of the operator's own matrices "
        "(NAME.yaml), thresholds.yaml and nightly.yaml, looked up before the shipped ones "
        "(evalsvc/configs); a file here overrides the shipped file of the same name, the other "
        "shipped files stay available. Unset or empty: the shipped files alone.")
    nightly_file: Path | None = Field(None, description="the nightly schedules; unset: "
                                      "nightly.yaml of configs_dir, else the shipped one")
    nightly: bool = Field(True, description="run the nightly schedules inside the service")
    alert_webhook: str | None = Field(None, description="Slack-compatible incoming webhook for "
                                      "regression alerts")
    public_url: str | None = Field(None, description="the dashboard's address, for links in "
                                   "alerts")
    # http
    max_body_bytes: int = Field(1024 * 1024, ge=1, description="the largest request body taken, "
                                "in bytes; a larger one is refused with 413 before it is read")
    # limits on what one submitted job may expand to, checked at submission (422 naming them)
    max_configs_per_job: int = Field(256, ge=1, description="limit on one job, checked at "
                                     "submission: configs x builds")
    max_matrix_entries: int = Field(1000, ge=1, description="limit on one job: values of one "
                                    "axis, include + exclude entries, and the axes' cross product "
                                    "before exclusion")
    max_job_prompts: int = Field(20_000, ge=1, description="limit on one job: prompts x configs "
                                 "x builds")
    max_job_tokens: int = Field(2_000_000, ge=1, description="limit on one job: max_new_tokens x "
                                "prompts x configs x builds")
    max_matrix_bytes: int = Field(262_144, ge=1, description="limit on one job: an inline "
                                  "matrix, as JSON")
    datasets_dir: Path | None = Field(None, description="local dataset files API jobs may name "
                                      "lie under this directory (unset: none may)")
    builds_dir: Path | None = Field(None, description="engine builds and git mirrors "
                                    "(evalsvc/builds); unset: data_dir/builds")
    # engines
    run_timeout_s: float = Field(
        1800.0, gt=0, le=7 * 86400, description="a run's deadline in seconds, engine start-up "
        "included, for matrices without run_timeout_s: past it the run is an error and its engine "
        "group is killed")
    # runner
    runner_max_attempts: int = Field(
        3, ge=1, description="a job the runner took up this many times without finishing it (each "
        "time the service died while running it) is failed by the next start-up's recovery "
        "instead of tried again")

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


# ---- the settings table in README.md -------------------------------------------------------------

TABLE_START = "<!-- settings table: generated by `python -m evalsvc.settings --update README.md` -->"
TABLE_END = "<!-- end of settings table -->"


def _default_text(field) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return f"`{','.join(map(str, value))}`" if value else "none"
    if isinstance(value, dict):
        return f"`{json.dumps(value)}`" if value else "none"
    return f"`{value}`"


def markdown_table() -> str:
    """The settings as a Markdown table: environment variable, default, description."""
    rows = ["| Variable | Default | Description |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        if not field.description:
            raise ValueError(f"setting {name} has no description")
        text = field.description.replace("|", "\\|")
        rows.append(f"| `EVALSVC_{name.upper()}` | {_default_text(field)} | {text} |")
    return "\n".join(rows) + "\n"


def with_table(text: str) -> str:
    """``text`` with the table between its markers made anew."""
    head, found, rest = text.partition(TABLE_START + "\n")
    _, found_end, tail = rest.partition(TABLE_END)
    if not found or not found_end:
        raise ValueError(f"the markers {TABLE_START!r} and {TABLE_END!r} are not both there")
    return head + TABLE_START + "\n" + markdown_table() + TABLE_END + tail


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m evalsvc.settings",
                                     description="The EVALSVC_ settings as a Markdown table.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--markdown", action="store_true", help="print the table")
    what.add_argument("--update", type=Path, metavar="FILE",
                      help="rewrite the table between the markers in FILE (README.md)")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table(), end="")
    else:
        args.update.write_text(with_table(args.update.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
