"""``parallelize`` shards the expert banks over dp by one of two FSDP2 calls, chosen once by what the installed
torch offers (``mode.parallel.apply.SPMD_MESH_DIMS``): ``fully_shard(..., dp_mesh_dims=)`` on the whole
``(dp, ep)`` mesh (torch >= 2.13) or ``fully_shard(mesh=mesh["dp"])`` on ep DTensors (older torch: 2.11). The
multi-process tests run only the path of the torch they run under; this one runs both where both exist, on a
4-rank ``(2, 2)`` mesh of torch's in-process "fake" process group (no communication: shapes and placements
only), in a child process so this one never holds a process group."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import mode.parallel.apply as apply

_CHILD = r"""
import json, sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
import mode.parallel.apply as apply
from mode import MoEConfig, MoELayer

rank, out = int(sys.argv[1]), {}
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
for spmd in json.loads(sys.argv[2]):
    apply.SPMD_MESH_DIMS = spmd
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([MoELayer.from_config(MoEConfig(d_model=16, d_hidden=32, num_experts=6))]))
    apply.parallelize(model, mesh)
    out[f"{spmd}/{rank}"] = {
        name: {"type": type(p).__name__, "mesh": list(p.device_mesh.mesh_dim_names),
               "ranks": p.device_mesh.mesh.tolist(), "placements": str(p.placements),
               "global": list(p.shape), "local": list(p.to_local().shape)}
        for name, p in model[0][0].experts.named_parameters()}
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def banks() -> dict:
    """``"<spmd>/<rank>"`` -> the bank's weights as that rank sees them; one child per rank (a process group
    is initialised once per process), all four at once."""
    paths = json.dumps([True, False] if apply.SPMD_MESH_DIMS else [False])
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(rank), paths], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for rank in range(4)
    ]
    out = {}
    try:
        for rank, child in enumerate(children):
            stdout, stderr = child.communicate(timeout=300)
            assert child.returncode == 0, f"rank {rank}: {stderr[-3000:]}"
            out.update(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return out


def test_the_path_is_chosen_by_what_fully_shard_takes():
    import inspect

    import torch.distributed.fsdp as fsdp

    takes = "dp_mesh_dims" in inspect.signature(fsdp.fully_shard).parameters
    assert apply.SPMD_MESH_DIMS == (takes and hasattr(fsdp, "DataParallelMeshDims"))


@pytest.mark.parametrize("spmd", [False, True], ids=["ep-mesh-path", "dp_mesh_dims-path"])
def test_expert_banks_on_a_2x2_mesh_are_sharded_alike_by_both_paths(banks, spmd):
    """6 experts on (dp, ep) = (2, 2): ep rank e holds [3e, 3e+3), split over dp as 2 + 1 (rank = d * ep + e),
    on a (dp, ep) mesh with [_StridedShard(0, sf=2), Shard(0)], whichever FSDP2 call made it."""
    if spmd and not apply.SPMD_MESH_DIMS:
        pytest.skip("this torch's fully_shard has no dp_mesh_dims (torch < 2.13)")
    shapes = {"w_in_EDF": (16, 32), "w_out_EHD": (32, 16)}
    for rank, rows in enumerate([2, 2, 1, 1]):
        seen = banks[f"{spmd}/{rank}"]
        assert set(seen) == set(shapes), seen
        for name, tail in shapes.items():
            s = seen[name]
            assert s["type"] == "DTensor" and s["mesh"] == ["dp", "ep"] and s["ranks"] == [[0, 1], [2, 3]], s
            assert s["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", s
            assert s["global"] == [6, *tail] and s["local"] == [rows, *tail], (rank, s)


def test_parallelize_refuses_a_torch_older_than_the_oldest_tested(monkeypatch):
    monkeypatch.setattr(apply, "TORCH_VERSION", (2, 7))
    monkeypatch.setattr(apply.torch, "__version__", "2.7.0+cu126")
    with pytest.raises(
        ValueError,
        match=r"torch 2\.7\.0\+cu126: parallelize needs torch>=2\.11 \(the oldest it is "
        r"tested on; 2\.11 and 2\.13 are\); install a newer torch, or train in "
        r"one process",
    ):
        apply.parallelize(torch.nn.Linear(2, 2), None)
