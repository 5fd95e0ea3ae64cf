"""Shared pytest fixtures: every test starts from the same RNG state."""

import pytest
import torch


@pytest.fixture(autouse=True)
def seed() -> int:
    """Seed torch's global RNG before each test (module init and random inputs are then reproducible)."""
    torch.manual_seed(0)
    return 0
