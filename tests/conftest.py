"""Shared fixtures: the packaged profiles as parsed TOML documents and as Profile objects."""

from __future__ import annotations

import copy
import tomllib

import pytest

from meshheal_jax import topology


@pytest.fixture(scope="session")
def packaged_docs() -> dict[str, dict]:
    """dataset -> the packaged profile file, parsed by tomllib (never mutated: copy first)."""
    return {
        ds: tomllib.loads((topology.PROFILE_DIR / f"{ds}.toml").read_text()) for ds in topology.DATASETS
    }


@pytest.fixture
def bbh_doc(packaged_docs) -> dict:
    """A private deep copy of the BBH profile document, free to mutate."""
    return copy.deepcopy(packaged_docs["bbh"])


@pytest.fixture(scope="session")
def bbh_profile() -> topology.Profile:
    return topology.load_profile("bbh")
