"""docker/ without a Docker engine: hadolint on both Dockerfiles, the compose file against the Compose
Specification's JSON schema (the copy check-jsonschema vendors), and the checks that matter for this
deployment: pinned images, health checks, Ray token settings, secrets only from docker/.env, and a
build context that keeps local state out. Both linters are in the dev extra; a missing one fails."""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile.service", DOCKER / "Dockerfile.worker"]
COMPOSE = DOCKER / "compose.yaml"
ENV_EXAMPLE = DOCKER / "env.example"
RAY_SERVICES = ("ray-head", "ray-worker", "service")


def tool(name: str) -> str:
    local = Path(sysconfig.get_path("scripts")) / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: it comes with the dev extra (pip install -e '.[dev]')")
    return found


def hadolint(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    # every level counts, style included (hadolint's default threshold lets style findings pass)
    return subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "style", *args],
                          input=stdin, capture_output=True, text=True, timeout=60, cwd=ROOT)


def check_compose_schema(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT)


def interpolate(value: str) -> str:
    """Compose's interpolation with nothing set: ${VAR:-default} gives the default, others a value."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*)|:?\?[^}]*)?\}",
                  lambda m: m.group(2) if m.group(2) is not None else "set", value)


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def from_images(dockerfile: Path) -> list[str]:
    """The base images of a Dockerfile's FROM lines, ARG defaults filled in; stage names skipped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    args: dict[str, str] = {}
    stages: set[str] = set()
    images = []
    for line in text.splitlines():
        if m := re.match(r"\s*ARG\s+(\w+)=(\S*)", line):
            args.setdefault(m.group(1), m.group(2).strip("\"'"))
        elif m := re.match(r"\s*FROM\s+(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", line, re.I):
            image = re.sub(r"\$\{?(\w+)\}?", lambda a: args.get(a.group(1), ""), m.group(1))
            if image not in stages:
                images.append(image)
            if m.group(2):
                stages.add(m.group(2))
    return images


def assert_pinned(image: str, where: str) -> None:
    if "@sha256:" in image:
        return
    name, _, tag = image.rpartition(":")
    assert name and "/" not in tag, f"{where}: image {image!r} has no tag"
    assert tag != "latest" and not tag.startswith("latest-"), f"{where}: image {image!r} is latest"


# --- Dockerfiles -------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    res = hadolint(str(dockerfile))
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def test_hadolint_fails_on_a_finding():
    res = hadolint("-", stdin="FROM python:latest\nRUN cd /tmp && pip install requests\n")
    assert res.returncode != 0
    assert "DL3007" in res.stdout and "DL3003" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_suppressed_finding_says_why(dockerfile):
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if m := re.match(r"\s*#\s*hadolint\s+ignore=([\w,]+)", line):
            comments = []
            for prev in reversed(lines[:i]):
                if not prev.lstrip().startswith("#"):
                    break
                comments.append(prev)
            for code in m.group(1).split(","):
                assert any(code in c for c in comments), \
                    f"{dockerfile.name}:{i + 1}: ignore={code} without a comment above saying why"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned(dockerfile):
    images = from_images(dockerfile)
    assert images
    for image in images:
        assert_pinned(image, dockerfile.name)


def test_worker_python_is_the_service_python():
    """Ray refuses a node or driver whose Python differs from the head's (patch level by default):
    the worker's own Python must be the service image's (which also runs the head)."""
    service_image = from_images(DOCKER / "Dockerfile.service")[0]
    worker = (DOCKER / "Dockerfile.worker").read_text()
    m = re.search(r"ARG PYTHON_VERSION=(\S+)", worker)
    assert m and re.match(rf"python:{re.escape(m.group(1))}-", service_image), \
        f"worker PYTHON_VERSION {m and m.group(1)} vs service base {service_image}"
    assert from_images(DOCKER / "Dockerfile.worker")[-1].startswith("lmsysorg/sglang:v")


def test_dockerignore_admits_only_what_the_images_copy():
    rules = [r.strip() for r in (ROOT / ".dockerignore").read_text().splitlines()
             if r.strip() and not r.startswith("#")]
    assert rules[0] == "*", "the build context starts from nothing"
    admitted = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    assert not admitted & {".venv", "data", "out", ".git", "docker", "tests"}
    for dockerfile in DOCKERFILES:
        for m in re.finditer(r"^COPY[ \t]+(?!--from)((?:\S+[ \t]+)+)\S+[ \t]*$", dockerfile.read_text(),
                             re.M):
            for src in m.group(1).split():
                assert src.rstrip("/") in admitted, f"{dockerfile.name} copies {src}: not admitted"


# --- compose ------------------------------------------------------------------------------------

def test_compose_matches_the_compose_specification():
    res = check_compose_schema(COMPOSE)
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_schema_check_fails_on_a_bad_file(tmp_path):
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  web:\n    image: nginx:1.27\n    helthcheck:\n      test: [CMD, 'true']\n")
    res = check_compose_schema(bad)
    assert res.returncode != 0 and "helthcheck" in res.stdout + res.stderr, res.stdout


def test_compose_services_are_built_or_pinned_and_health_checked():
    services = compose()["services"]
    assert set(services) == {"postgres", "service", "ray-head", "ray-worker"}
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, f"{name}: neither image nor build"
        if "image" in svc:
            assert_pinned(interpolate(svc["image"]), f"compose {name}")
        if "build" in svc:
            context = (DOCKER / svc["build"]["context"]).resolve()
            assert (context / svc["build"]["dockerfile"]).is_file(), f"{name}: no such Dockerfile"
        check = svc.get("healthcheck", {})
        assert check.get("test") and not check.get("disable"), f"{name}: no health check"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), f"{name}: {check['test']}"


def test_compose_ray_cluster_uses_token_auth():
    services = compose()["services"]
    for name in RAY_SERVICES:
        env = environment(services[name])
        assert env.get("RAY_AUTH_MODE") == "token", f"{name}: RAY_AUTH_MODE"
        assert re.fullmatch(r"\$\{RAY_AUTH_TOKEN:\?[^}]+\}", env.get("RAY_AUTH_TOKEN", "")), \
            f"{name}: RAY_AUTH_TOKEN must come from docker/.env and be required"
    head = services["ray-head"]["command"]
    assert "--head" in head and "--block" in head and "--num-gpus=0" in head
    worker = services["ray-worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    assert environment(worker)["RAY_HEAD_ADDRESS"].startswith("ray-head:")


def test_compose_service_settings():
    services = compose()["services"]
    svc = services["service"]
    env = environment(svc)
    # EVALSVC_HOST is 0.0.0.0 in the image: evalsvc serve refuses that without a token
    assert re.fullmatch(r"\$\{EVALSVC_API_TOKEN:\?[^}]+\}", env["EVALSVC_API_TOKEN"])
    assert env["EVALSVC_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert "@postgres:5432/" in env["EVALSVC_DATABASE_URL"]
    assert env["EVALSVC_RAY_ADDRESS"].startswith("ray://ray-head:")
    assert "EVALSVC_RAY_SLOT_RESOURCE" in env
    assert any(p.split(":")[-1] == "8000" for p in map(interpolate, svc["ports"]))
    for dep in ("postgres", "ray-head"):
        assert svc["depends_on"][dep]["condition"] == "service_healthy"
    assert services["ray-worker"]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    # nothing shared but through Ray: the worker makes its builds in a /data of its own, over its
    # own SGLang (the image's EVALSVC_ENGINE_PYTHON), and the service has no SGLang at all
    data = {v for v in svc["volumes"] if v.endswith(":/data")}
    worker_data = {v for v in services["ray-worker"]["volumes"] if v.endswith(":/data")}
    assert data and worker_data and not data & worker_data
    assert "EVALSVC_ENGINE_PYTHON" not in env
    assert re.search(r"^\s*EVALSVC_ENGINE_PYTHON=\$\{SGLANG_PYTHON\}",
                     (DOCKER / "Dockerfile.worker").read_text(), re.M)
    assert any(v.startswith("pgdata:") for v in services["postgres"]["volumes"])
    assert services["service"]["image"] == services["ray-head"]["image"]


def test_compose_secrets_come_from_the_env_file_and_are_documented():
    text = COMPOSE.read_text()
    example = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            example[key] = value
    used = set(re.findall(r"\$\{(\w+)", text))
    assert used - set(example) == set(), "variables of compose.yaml missing from docker/env.example"
    required = set(re.findall(r"\$\{(\w+):\?", text))
    assert required == {"EVALSVC_API_TOKEN", "RAY_AUTH_TOKEN", "POSTGRES_PASSWORD"}
    for key in required | {k for k in example if re.search(r"TOKEN|PASSWORD|WEBHOOK", k)}:
        assert example[key] == "", f"docker/env.example holds a value for {key}"
    for name, svc in compose()["services"].items():
        for key, value in environment(svc).items():
            if re.search(r"PASSWORD|TOKEN|WEBHOOK", key) and key != "RAY_AUTH_MODE":
                assert value.startswith("${"), f"compose.yaml {name}: literal {key}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_the_wheel_not_an_editable_checkout(dockerfile):
    """The images install the evalsvc wheel (its matrices, thresholds and dashboard templates are
    package data): no editable install, and no copy of the old top-level configs/ or dashboards/."""
    text = dockerfile.read_text()
    assert not re.search(r"pip install[^\n]*(\s-e\s|--editable)", text), dockerfile.name
    assert "pip wheel" in text and "COPY --from=wheel" in text, dockerfile.name
    assert not re.search(r"^COPY[ \t]+(configs|dashboards)\b", text, re.M), dockerfile.name
