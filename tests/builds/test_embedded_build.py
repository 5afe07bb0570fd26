"""Embedded-engine builds: the settings file (evalsvc-engine.yaml) of a git commit or a local tree
becomes the engine's defects; jobs accept such sources for the embedded engine when allowed, and
the build they record is the commit (full sha, committer date).

The repositories are made in a temporary directory, with fixed commit dates.
"""

from __future__ import annotations

import os
import subprocess
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from evalsvc import __version__
from evalsvc.builds.build import BuildError
from evalsvc.builds.embedded import SETTINGS_FILE, embedded_build, parse_embedded_source
from evalsvc.engines.base import EngineSpec
from evalsvc.jobs import BuildSpec, JobCreate, JobError, JobService
from evalsvc.jobs.builds import ready_build
from evalsvc.settings import Settings

ENV_VAR = "EVALSVC_ENGINE_DEFECTS"
TZ = timezone(timedelta(hours=2))
DATES = ["2026-01-02T03:04:05+02:00", "2026-01-03T03:04:05+02:00", "2026-01-04T03:04:05+02:00"]


def git(repo: Path, *args: str, date: str | None = None) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    if date:
        env |= {"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def commit(repo: Path, settings: str | None, date: str, message: str = "settings") -> str:
    """Commit the tree with this settings file text (None: without the file); returns the sha."""
    path = repo / SETTINGS_FILE
    if settings is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(settings)
    (repo / "README").write_text(message + "\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", message, date=date)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture(autouse=True)
def builds_dir(tmp_path, monkeypatch) -> Path:
    """The git mirrors go under the test's own builds cache."""
    monkeypatch.setenv("EVALSVC_BUILDS_DIR", str(tmp_path / "builds"))
    return tmp_path / "builds"


@pytest.fixture
def repo(tmp_path) -> tuple[Path, list[str]]:
    """Three commits: snapshot-race at full strength; a list with a strength; no settings file."""
    root = tmp_path / "engine-settings"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    shas = [
        commit(root, "# engine settings\ndefects:\n  snapshot-race: 1.0\n", DATES[0]),
        commit(root, "defects: [host-load-race, deferred-ops-dropped@0.25]\n", DATES[1]),
        commit(root, None, DATES[2], "no settings"),
    ]
    return root, shas


def test_settings_at_two_commits_give_different_defects(repo, builds_dir):
    root, shas = repo
    # a short sha resolves to the full one
    first = embedded_build(f"git:{root}@{shas[0][:8]}", builds_dir=builds_dir)
    assert first.env == {ENV_VAR: "snapshot-race"}
    assert first.defects == {"snapshot-race": 1.0}
    assert (first.repository, first.sha) == (str(root), shas[0])
    assert first.committed_at == datetime(2026, 1, 2, 3, 4, 5, tzinfo=TZ)
    assert first.committed_at.utcoffset() == timedelta(hours=2)
    second = embedded_build(f"git:{root}@{shas[1]}", builds_dir=builds_dir)
    assert second.env == {ENV_VAR: "host-load-race,deferred-ops-dropped@0.25"}
    assert second.committed_at == datetime(2026, 1, 3, 1, 4, 5, tzinfo=UTC)
    assert second.manifest["settings_file"] == SETTINGS_FILE
    assert second.manifest["evalsvc_version"] == __version__


def test_a_branch_name_resolves_to_its_newest_commit(repo, builds_dir):
    root, shas = repo
    head = embedded_build(f"git:{root}@main", builds_dir=builds_dir)
    assert head.sha == shas[2]


def test_a_tree_without_the_settings_file_has_no_defects(repo, builds_dir, tmp_path):
    root, shas = repo
    bare = embedded_build(f"git:{root}@{shas[2]}", builds_dir=builds_dir)
    assert bare.env == {} and bare.defects == {}
    assert bare.manifest["settings_file"] is None
    tree = tmp_path / "tree"
    tree.mkdir()
    assert embedded_build(f"path:{tree}").env == {}


def test_a_local_tree_is_identified_by_its_settings(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / SETTINGS_FILE).write_text(yaml.safe_dump({"defects": {"stale-spec-metadata": 0.5}}))
    one = embedded_build(f"path:{tree}")
    assert one.env == {ENV_VAR: "stale-spec-metadata@0.5"}
    assert one.repository == str(tree.resolve()) and one.sha is None
    assert one.version.startswith(f"{__version__}+tree-")
    assert one.committed_at.tzinfo is not None
    (tree / SETTINGS_FILE).write_text(yaml.safe_dump({"defects": {"stale-spec-metadata": 0.75}}))
    assert embedded_build(f"path:{tree}").version != one.version


def test_defect_patches_add_to_the_settings_at_full_strength(repo, builds_dir):
    root, shas = repo
    build = embedded_build(f"git:{root}@{shas[1]}",
                           ["defect:stale-spec-metadata", "defect:deferred-ops-dropped"],
                           builds_dir=builds_dir)
    assert build.defects == {"host-load-race": 1.0, "deferred-ops-dropped": 1.0,
                             "stale-spec-metadata": 1.0}
    assert build.env == {ENV_VAR: "host-load-race,deferred-ops-dropped,stale-spec-metadata"}
    assert build.patches == ["defect:stale-spec-metadata", "defect:deferred-ops-dropped"]
    assert embedded_build(None, ["defect:host-load-race"]).env == {ENV_VAR: "host-load-race"}
    assert embedded_build(None).env == {}


@pytest.mark.parametrize(("settings", "named"), [
    ("defect:\n  snapshot-race: 1.0\n", ["unknown key 'defect'", "known: defects"]),
    ("defects:\n  snapshot-racer: 1.0\n", ["key defects.snapshot-racer",
                                            "unknown defect 'snapshot-racer'"]),
    ("defects:\n  host-load-race: 1.5\n", ["key defects.host-load-race", "1.5", "(0, 1]"]),
    ("defects:\n  host-load-race: 0\n", ["key defects.host-load-race", "strength 0"]),
    ("defects:\n  host-load-race: lots\n", ["key defects.host-load-race", "'lots'"]),
    ("defects: [snapshot-race, host-load-race@2]\n", ["key defects[1]", "'2'"]),
    ("defects: snapshot-race\n", ["key defects:", "a list of names"]),
    ("defects: [snapshot-race\n", ["not valid YAML"]),
    ("- snapshot-race\n", ["expected a mapping"]),
])
def test_bad_settings_are_refused_naming_file_commit_and_key(repo, builds_dir, settings, named):
    root, _ = repo
    sha = commit(root, settings, DATES[2], "bad settings")
    with pytest.raises(BuildError) as err:
        embedded_build(f"git:{root}@{sha}", builds_dir=builds_dir)
    text = str(err.value)
    assert SETTINGS_FILE in text and sha in text, text
    for part in named:
        assert part in text, text


def test_bad_settings_in_a_local_tree_name_the_file(tmp_path):
    (tmp_path / SETTINGS_FILE).write_text("defects: {bogus: 1}\n")
    with pytest.raises(BuildError, match=r"evalsvc-engine\.yaml.*key defects\.bogus"):
        embedded_build(f"path:{tmp_path}")


def test_missing_commits_repositories_and_other_sources_are_refused(repo, builds_dir, tmp_path):
    root, _ = repo
    with pytest.raises(BuildError, match="unknown commit '0123456789abcdef'"):
        embedded_build(f"git:{root}@0123456789abcdef", builds_dir=builds_dir)
    with pytest.raises(BuildError, match="cannot be cloned"):
        embedded_build(f"git:{tmp_path}/no-such-repo@main", builds_dir=builds_dir)
    with pytest.raises(BuildError, match="git:REPOSITORY@COMMIT or path:DIR"):
        parse_embedded_source("sglang==0.5.23")
    with pytest.raises(BuildError, match="no such directory"):
        parse_embedded_source(f"path:{tmp_path}/nowhere")
    with pytest.raises(BuildError, match="unknown patch 'pr1-fix'"):
        embedded_build(None, ["pr1-fix"])


# ---- jobs ------------------------------------------------------------------------------------------

def service(*allowed: str) -> JobService:
    """Validation and build preparation only: no store, no dispatcher."""
    return JobService(Settings(allowed_sources=list(allowed)), store=None, dispatcher=None)


def test_jobs_accept_git_sources_for_the_embedded_engine_when_allowed(repo):
    root, shas = repo
    source = f"git:{root}@{shas[0]}"
    body = JobCreate(matrix="smoke", builds=[BuildSpec(source=source),
                                             BuildSpec(source=source, patches=["defect:host-load-race"])])
    spec = service(f"git:{root}@*").normalize(body)
    assert spec["engine"] == "embedded"
    assert [b["source"] for b in spec["builds"]] == [source, source]
    with pytest.raises(JobError, match=r"builds\[0\]\.source: .*not an allowed build source"):
        service("sglang==*").normalize(body)
    assert service("sglang==*").normalize(body, trusted=True)["builds"][0]["source"] == source


@pytest.mark.parametrize(("source", "named"), [
    ("git:{root}@0123456789abcdef", "unknown commit"),
    ("git:{root}-missing@main", "cannot be cloned"),
    ("git:{root}", "git:REPOSITORY@COMMIT"),
    ("sglang==0.5.23", "git:REPOSITORY@COMMIT or path:DIR"),
])
def test_jobs_refuse_embedded_sources_that_do_not_exist(repo, source, named):
    root, _ = repo
    body = JobCreate(matrix="smoke", builds=[BuildSpec(source=source.format(root=root))])
    with pytest.raises(JobError, match=r"builds\[0\]\.source: ") as err:
        service("*").normalize(body)
    assert named in str(err.value)


def test_jobs_refuse_a_commit_with_bad_settings(repo):
    root, _ = repo
    sha = commit(root, "defects: {snapshot-race: 2}\n", DATES[2], "too strong")
    body = JobCreate(matrix="smoke", builds=[BuildSpec(), BuildSpec(source=f"git:{root}@{sha}")])
    with pytest.raises(JobError, match=r"builds\[1\]\.source: .*evalsvc-engine\.yaml") as err:
        service("*").normalize(body)
    assert sha in str(err.value) and "defects.snapshot-race" in str(err.value)


def prepared(jobs: JobService, build: dict):
    """A build of a job made ready as the service's ``run_job`` makes it (``ready_build`` in the
    service's builds directory)."""
    return ready_build(EngineSpec(kind="embedded"), build, None,  # made here: no dispatcher
                       jobs.settings.resolved_builds_dir())


def test_prepare_build_gives_the_engine_env_sha_and_commit_date(repo):
    root, shas = repo
    engine, ref, request = prepared(service("*"), {"source": f"git:{root}@{shas[1][:10]}",
                                                   "patches": ["defect:snapshot-race"]})
    assert engine.kind == "embedded" and request is None  # the env is the whole build
    assert engine.env == {ENV_VAR: "host-load-race,deferred-ops-dropped@0.25,snapshot-race"}
    assert (ref.repository, ref.sha, ref.branch) == (str(root), shas[1], None)
    assert ref.committed_at == datetime(2026, 1, 3, 3, 4, 5, tzinfo=TZ)
    assert ref.patches == ["defect:snapshot-race"]
    assert ref.ref == f"{root}@{shas[1]}"
    # no source: the engine as it is, its patches its defects
    engine, ref, _ = prepared(service(), {"source": None, "patches": ["defect:host-load-race"]})
    assert engine.env == {ENV_VAR: "host-load-race"}
    assert (ref.repository, ref.version, ref.sha) == ("evalsvc/embedded", __version__, None)


def test_a_services_builds_go_where_its_own_settings_say(repo, tmp_path, monkeypatch):
    """The git mirrors (and builds) of a service are in its settings' builds directory: its data
    directory's builds/, or EVALSVC_BUILDS_DIR; never one the process read elsewhere."""
    root, shas = repo
    monkeypatch.setenv("EVALSVC_BUILDS_DIR", str(tmp_path / "from-env"))
    assert Settings().resolved_builds_dir() == tmp_path / "from-env"
    mine = Settings(data_dir=tmp_path / "data", builds_dir=None)
    other = Settings(builds_dir=tmp_path / "other")
    assert mine.resolved_builds_dir() == tmp_path / "data" / "builds"
    for settings, where in ((mine, tmp_path / "data" / "builds"), (other, tmp_path / "other")):
        jobs = JobService(settings, store=None, dispatcher=None)
        _, ref, _ = prepared(jobs, {"source": f"git:{root}@{shas[0]}", "patches": []})
        assert ref.sha == shas[0]
        assert len(list((where / "git").iterdir())) == 1  # the repository's mirror
    assert not (tmp_path / "from-env").exists()
