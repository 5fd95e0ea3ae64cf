"""A converted transformers MoE model (``mode.hf.to_mode_moe``) trained on a (dp, ep) mesh (gloo, CPU) equals
one process: ``parallelize`` unchanged, the training loop of examples/hf_moe_ep.py, DCP checkpoints through
``mode.parallel.model_state`` across layouts, and ``save_transformers`` gathered from the shards.

Two spawned pools, started together by one module fixture (each rank writes what it saw to a file, judged here):
    * 4 processes: Mixtral, Qwen3-MoE, GLM-4.5, LongCat-Flash and gpt-oss (one family of each router kind) at
      (dp, ep) = (2, 2) and (1, 4), 6 steps; the (2, 2) runs of all but Mixtral save a checkpoint after step 3,
      and Qwen3's, at the end, a transformers folder;
    * 2 processes: resume each checkpoint at (1, 2) and train steps 4 to 6.
The parent computes the single-process references, resumes the checkpoint in one process with no process
group, and loads the transformers folder with plain transformers.

Exactness: every rank holds the same number of rows (the mean of the per-rank cross-entropies is the global
mean), our routing losses are off (the converted default) and routing is dropless, so the mesh computes the
single-process function: losses to 1e-5 and gradient norms to 1e-4 relative, as tests/parallel/test_ep_training.py.
Near-ties (tests/ties.py): the token ids are Zipf draws, none following itself (the leading positions of a run
of one id have identical hidden states, whose scores tie exactly and break by the tensor's shape), and every
top-k gap of each family's reference is asserted above GAP_FLOOR, 100x the float32 rounding that parts the
runs (test_reference_decisions_are_not_near_ties): no decision flips. These models run in float32, as
transformers builds them.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import time
from pathlib import Path

import pools
import pytest
import ties
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'mode-torch[hf]'): the models to convert"
)

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.cpu_only("gloo ranks on CPU; the CPU run covers them (NCCL needs one GPU per rank)"),
]

ROOT = Path(__file__).resolve().parents[2]
HF_TESTS = ROOT / "tests" / "hf"
JOIN_TIMEOUT_S = 240.0
TIMEOUT_S = 60.0
TOL = 1e-5
NORM_RTOL = 1e-4
GAP_FLOOR = 1e-5  # float32 scores of the two runs differ by ~1e-7 over 6 steps (the losses by <= 1e-6)
STEPS, SAVE_AT, BATCH, SEQ = 6, 3, 8, 16
LAYOUTS = [(2, 2), (1, 4)]
# one family of each router kind: softmax (Mixtral, Qwen3-MoE), sigmoid + correction bias + groups (GLM-4.5),
# zero-computation experts (LongCat-Flash), gpt-oss (logit bias, expert biases, clamped interleaved SwiGLU)
# llama4_top1: Llama-4 (input-scaled experts) with its checkpoints' top-1 routing, scaled before dispatch
# gemma4: transformers' router, mode's experts (the plan of the given choices) over the mesh
FAMILIES = ("mixtral", "qwen3_moe", "glm4_moe", "longcat_flash", "gpt_oss", "llama4_top1", "gemma4")
RESUMED = ("qwen3_moe", "glm4_moe", "longcat_flash", "gpt_oss")  # each (2, 2) run saves after step 3
SAVER = ("qwen3_moe", 2, 2)  # ... and this one writes a transformers folder at the end


def _models():
    if str(HF_TESTS) not in sys.path:
        sys.path.insert(0, str(HF_TESTS))
    import moe_models

    return moe_models


def _example():
    spec = importlib.util.spec_from_file_location("hf_moe_ep", ROOT / "examples" / "hf_moe_ep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of Zipf token ids, none following itself (no pad, bos or eos ids), and their next tokens."""
    V = _models().V
    ids = torch.from_numpy(ties.zipf_no_repeat(STEPS * BATCH * (SEQ + 1), V - 3, seed=0)) + 3
    ids = ids.view(STEPS, BATCH, SEQ + 1)
    return [(ids[s, :, :-1], ids[s, :, 1:]) for s in range(STEPS)]


def _model(family: str):
    import mode.hf as mh

    if family == "llama4_top1":
        return mh.to_mode_moe(_models().build("llama4", num_experts_per_tok=1))
    return mh.to_mode_moe(_models().build(family))


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)


# ----------------------------------------------------------------------------------------------------
# worker side


def _pool4(rank: int, out: Path) -> dict:
    import mode.hf as mh
    from mode.parallel import ParallelDims, build_mesh, parallelize
    from mode.parallel.model_state import save_state

    ex, batches, res = _example(), _batches(), {}
    for family in FAMILIES:
        for dp, ep in LAYOUTS:

            def run(family=family, dp=dp, ep=ep):
                mesh = build_mesh(ParallelDims(dp, ep), timeout_s=TIMEOUT_S)
                model = parallelize(_model(family), mesh)
                opt = _optimizer(model)
                kw = dict(world_size=4, row_rank=rank, optimizer=opt)
                if family not in RESUMED or (dp, ep) != (2, 2):
                    return {"curve": ex.train(model, batches, **kw)}
                curve = ex.train(model, batches[:SAVE_AT], **kw)
                save_state(out / f"ckpt3_{family}", model, opt, extra={"step": SAVE_AT})
                if rank == 0:
                    (out / f"ckpt3_{family}.ready").write_text("")
                curve += ex.train(model, batches[SAVE_AT:], first_step=SAVE_AT + 1, **kw)
                if (family, dp, ep) != SAVER:
                    return {"curve": curve}
                folder = mh.save_transformers(model, out / "hf")
                return {"curve": curve, "folder": None if folder is None else str(folder)}

            pools.run_case(res, f"{family}_{dp}x{ep}", run)
    return res


def _pool2(rank: int, out4: Path) -> dict:
    from mode.parallel import ParallelDims, build_mesh, parallelize
    from mode.parallel.model_state import load_state

    ex, res = _example(), {}

    def resume(family):
        t0 = time.monotonic()
        while not (out4 / f"ckpt3_{family}.ready").exists():
            if time.monotonic() - t0 > JOIN_TIMEOUT_S / 2:
                raise TimeoutError(f"the (2, 2) run's checkpoint of {family} did not appear")
            time.sleep(0.2)
        mesh = build_mesh(ParallelDims(1, 2), timeout_s=TIMEOUT_S)
        model = parallelize(_model(family), mesh)
        opt = _optimizer(model)
        step = load_state(out4 / f"ckpt3_{family}", model, opt)["step"]
        return {
            "start": step,
            "curve": ex.train(
                model, _batches()[step:], world_size=2, row_rank=rank, optimizer=opt, first_step=step + 1
            ),
        }

    for family in RESUMED:
        pools.run_case(res, f"resume_1x2_{family}", functools.partial(resume, family))
    return res


def _worker(rank: int, world: int, store: str, out_dir: str, pool: str, out4: str) -> None:
    work = (lambda: _pool4(rank, Path(out_dir))) if pool == "mesh4" else (lambda: _pool2(rank, Path(out4)))
    pools.run_rank(rank, world, store, out_dir, TIMEOUT_S, work, barrier=True)


# ----------------------------------------------------------------------------------------------------
# parent side


POOLS = {"mesh4": 4, "mesh2": 2}


@pytest.fixture(scope="module")
def runs():
    from mode.parallel.model_state import load_state

    with pools.running(_worker, POOLS) as run:
        tmp = run.tmp
        ex, batches = _example(), _batches()
        ref, trained, gaps = {}, {}, {}
        for family in FAMILIES:
            model = _model(family)
            with ties.active() as gaps[family]:
                ref[family] = ex.train(model, batches, optimizer=_optimizer(model))
            trained[family] = model
        results = run.wait(None, JOIN_TIMEOUT_S)
        parent = {}
        for family in RESUMED:
            if (tmp / "mesh4" / f"ckpt3_{family}.ready").exists():  # one process, no process group
                model = _model(family)
                opt = _optimizer(model)
                step = load_state(tmp / "mesh4" / f"ckpt3_{family}", model, opt)["step"]
                parent[f"resume_one_{family}"] = {
                    "start": step,
                    "curve": ex.train(model, batches[step:], optimizer=opt, first_step=step + 1),
                }
        if (tmp / "mesh4" / "hf" / "config.json").exists():
            plain = transformers.AutoModelForCausalLM.from_pretrained(tmp / "mesh4" / "hf", dtype=torch.float32)
            x = batches[0][0]
            with torch.no_grad():
                parent["hf_logits"] = (
                    plain.eval()(input_ids=x).logits,
                    trained["qwen3_moe"].eval()(input_ids=x).logits,
                )
                parent["hf_class"] = type(plain).__name__
        yield {"gaps": gaps, "results": results, "ref": ref, "parent": parent}


_assert_curve = functools.partial(pools.assert_curve, tol=TOL, norm_rtol=NORM_RTOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_decisions_are_not_near_ties(runs, family):
    """The precondition of the equalities below (tests/ties.py)."""
    runs["gaps"][family].assert_above(GAP_FLOOR, f"{family}'s one-process reference")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"dp{x[0]}xep{x[1]}")
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_trains_on_the_mesh_as_in_one_process(runs, family, layout):
    dp, ep = layout
    for r, res in enumerate(pools.case_results(runs["results"], "mesh4", f"{family}_{dp}x{ep}")):
        _assert_curve(res["curve"], runs["ref"][family], f"{family} ({dp}, {ep}) rank {r}")


@pytest.mark.parametrize("family", RESUMED)
def test_checkpoint_saved_on_2x2_resumes_on_1x2_and_in_one_process(runs, family):
    expected = runs["ref"][family][SAVE_AT:]
    for r, res in enumerate(pools.case_results(runs["results"], "mesh2", f"resume_1x2_{family}")):
        assert res["start"] == SAVE_AT
        _assert_curve(res["curve"], expected, f"{family}: resume (1, 2) rank {r}")
    one = runs["parent"].get(f"resume_one_{family}")
    assert one is not None, "the (2, 2) run wrote no checkpoint"
    assert one["start"] == SAVE_AT
    _assert_curve(one["curve"], expected, "resume in one process")


def test_transformers_folder_gathered_from_the_shards_loads_in_plain_transformers(runs):
    saver = pools.case_results(runs["results"], "mesh4", f"{SAVER[0]}_{SAVER[1]}x{SAVER[2]}")
    assert saver[0]["folder"] is not None and all(r["folder"] is None for r in saver[1:])  # rank 0 writes
    assert runs["parent"].get("hf_class") == "Qwen3MoeForCausalLM"
    theirs, ours = runs["parent"]["hf_logits"]  # the mesh-trained model vs the one-process-trained one
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
