"""Fixtures for the kvmesh serve end-to-end tests. The server is started by
tests/e2e/run.sh, which exports KVMESH_E2E_BASE_URL."""

from __future__ import annotations

import os

import httpx
import openai
import pytest


def pytest_configure(config):
    if not os.environ.get("KVMESH_E2E_BASE_URL"):
        raise pytest.UsageError("KVMESH_E2E_BASE_URL is not set: run the e2e tests through tests/e2e/run.sh")


@pytest.fixture(scope="session")
def base_url() -> str:
    return os.environ["KVMESH_E2E_BASE_URL"].rstrip("/")


@pytest.fixture(scope="session")
def model_name() -> str:
    return os.environ.get("KVMESH_E2E_MODEL_NAME", "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def model_path() -> str:
    return os.environ.get(
        "KVMESH_MODEL", os.path.expanduser("~/.cache/kvmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    )


@pytest.fixture(scope="session")
def client(base_url) -> openai.OpenAI:
    c = openai.OpenAI(base_url=base_url + "/v1", api_key="e2e", max_retries=0, timeout=120.0)
    yield c
    c.close()


@pytest.fixture(scope="session")
def http(base_url) -> httpx.Client:
    with httpx.Client(base_url=base_url, timeout=60.0) as c:
        yield c
