"""Shared test helpers."""

from __future__ import annotations

import json
from importlib import resources

import pytest


@pytest.fixture(scope="session")
def demo_prompts() -> list[str]:
    text = resources.files("evalsvc").joinpath("assets/prompts/demo.jsonl").read_text()
    return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
