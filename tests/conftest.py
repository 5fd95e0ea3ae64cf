"""Shared pytest fixtures: every test starts from the same RNG state."""

import pytest
import torch

# Test tensors are tiny: one intra-op thread is faster than two fighting over the cores, and keeps
# timing stable when several pytest or gloo worker processes share the machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seed() -> int:
    """Seed torch's global RNG before each test (module init and random inputs are then reproducible)."""
    torch.manual_seed(0)
    return 0
