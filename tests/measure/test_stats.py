"""Load-balance and per-token compute statistics (mode.measure.stats, mode.measure.token_compute), their accumulation
over
steps and ranks, the training log's "routing" records, and `mode report`."""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mode.measure.flops import attention_flops, forward_flops, mlp_flops_per_token
from mode.measure.stats import RoutingAccumulator, coefficient_of_variation, max_over_mean, rate_by_position
from mode.measure.token_compute import slots_to_positions, token_compute
from mode.model import LM, LMConfig
from mode.routing.mod_topk import MoDRouter, MoDRouterConfig
from mode.routing.plan import RoutingStats
from mode.routing.token_choice import TokenChoiceConfig, TokenChoiceRouter
from mode.train.data import Corpus

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_cfg(*layers: str, **kw) -> LMConfig:
    base = dict(
        seq_len=16,
        d_model=16,
        n_heads=2,
        d_hidden=32,
        layers=layers,
        num_experts=4,
        capacity=0.25,
        num_noop=2 if "integrated" in layers else 0,
    )
    base.update(kw)
    return LMConfig(**base)


# ------------------------------------------------------------------------------------------ hand counts


def hand_token_choice_stats() -> RoutingStats:
    """8 tokens (B=2, S=4) choose slots [0,0,0,0,0,1,2,2]: slot 2 is a no-op, capacity 2 per expert."""
    router = TokenChoiceRouter(
        TokenChoiceConfig(d_model=3, num_experts=2, num_noop=1, top_k=1, capacity_factor=0.5)
    )  # ceil(0.5 * 8 * 1 / 2) = 2
    with torch.no_grad():
        router.weight.copy_(3 * torch.eye(3))
    choice_T = torch.tensor([0, 0, 0, 0, 0, 1, 2, 2])
    x_BSD = F.one_hot(choice_T, 3).float().view(2, 4, 3)
    return router(x_BSD).aux.stats["router"]


def test_token_choice_with_drops_and_noop_equals_hand_counts():
    acc = RoutingAccumulator()
    acc.add({"moe": hand_token_choice_stats()})
    s = acc.router_summary("moe", buckets=None)
    # expert 0 asked for 5 and kept its first 2 (tokens 0, 1); expert 1 kept token 5; 2 chose the no-op
    assert s["kept"] == [2.0, 1.0]
    assert s["requested"] == [5.0, 1.0, 2.0]
    assert s["expert_frac"] == pytest.approx([2 / 3, 1 / 3])
    assert s["max_mean"] == pytest.approx(2 / 1.5)
    assert s["cv"] == pytest.approx(0.5 / 1.5)  # population std of [2, 1] over the mean
    assert s["dropped"] == 3 and s["dropped_frac"] == pytest.approx(3 / 6)
    assert s["noop"] == 2 and s["noop_share"] == pytest.approx(2 / 8)
    p_big, p_small = math.exp(3) / (math.exp(3) + 2), 1 / (math.exp(3) + 2)
    assert s["entropy"] == pytest.approx(-(p_big * math.log(p_big) + 2 * p_small * math.log(p_small)), rel=1e-5)
    assert s["max_entropy"] == pytest.approx(math.log(3))
    # computed tokens 0, 1 (row 0, positions 0, 1) and 5 (row 1, position 1)
    assert s["selected_by_position"] == [0.5, 1.0, 0.0, 0.0]
    assert s["selected_frac"] == pytest.approx(3 / 8)
    assert s["assignments_per_token"] == pytest.approx(3 / 8)
    assert not s["mod"]


def hand_mod_stats() -> RoutingStats:
    """MoD on scores [[4,3,2,1],[5,1,2,6]], C = 2: routes positions {0,1} and {0,3}."""
    router = MoDRouter(MoDRouterConfig(d_model=1, capacity=0.5))
    with torch.no_grad():
        router.weight.fill_(1.0)
    x_BSD = torch.tensor([[4.0, 3, 2, 1], [5, 1, 2, 6]]).unsqueeze(-1)
    return router(x_BSD).aux.stats["router"]


def test_mod_router_equals_hand_counts():
    acc = RoutingAccumulator()
    acc.add({"layers.1.mod.router": hand_mod_stats()})
    s = acc.router_summary("layers.1.mod.router")
    assert s["mod"] and s["kept"] == [4.0] and s["requested"] == [4.0, 4.0]
    assert s["noop_share"] == 0.5 and s["dropped_frac"] == 0.0 and s["entropy"] is None
    assert s["selected_by_position"] == [1.0, 0.5, 0.0, 0.5]
    assert acc.router_summary("layers.1.mod.router", buckets=2)["selected_by_position"] == [0.75, 0.25]
    small = acc.summary()
    assert small["layers"]["1"]["routed_frac"] == 0.5
    assert small["overall"] == {"routed_frac": 0.5}


def test_summary_functions_on_constructed_stats():
    kept = torch.tensor([6.0, 2.0, 0.0, 0.0])
    assert max_over_mean(kept) == pytest.approx(6 / 2)
    assert coefficient_of_variation(kept) == pytest.approx(math.sqrt((16 + 0 + 4 + 4) / 4) / 2)
    assert coefficient_of_variation(torch.ones(4)) == 0.0
    rates = rate_by_position(torch.tensor([1.0, 2, 0, 4]), torch.tensor([2.0, 2, 0, 4]))
    assert rates[:2] == [0.5, 1.0] and math.isnan(rates[2]) and rates[3] == 1.0


def test_staged_slots_map_back_to_positions():
    routed_BS = torch.tensor([[0, 1, 0, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    slots_BC = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # row 1 routed only 2: slot 2 is filler
    out = slots_to_positions(slots_BC, routed_BS)
    assert out.tolist() == [[0, 1, 0, 2, 3], [4, 5, 0, 0, 0]]


# ---------------------------------------------------------------------------------- per-token compute


def test_per_token_compute_by_hand_for_mod():
    cfg = tiny_cfg("dense", "mod", seq_len=8)  # C = 2 of 8
    model = LM(cfg)
    x = torch.randint(0, 256, (3, 8))
    out = model(x)
    tc = token_compute(cfg, out.aux, (3, 8))
    routed_BS = out.aux.stats["layers.1.mod.router"].compute_T.view(3, 8)
    assert torch.equal(tc.blocks_BS, 1 + routed_BS.double())
    assert torch.equal(tc.attn_LBS[0], torch.ones(3, 8, dtype=torch.float64))
    d, h = cfg.d_model, cfg.d_hidden
    dense_tok = attention_flops(8, d) / 8 + mlp_flops_per_token(d, h, "gelu")
    routed_tok = attention_flops(2, d) / 2 + mlp_flops_per_token(d, h, "gelu")
    expect = 2 * d * 256 + dense_tok + 2 * d + routed_BS.double() * routed_tok
    assert torch.allclose(tc.flops_BS, expect)


@pytest.mark.parametrize(
    "layers,extra",
    [
        (("moe", "staged"), dict(top_k=2, capacity_factor=0.5)),  # drops, inside the staged layer too
        (("integrated", "mod"), dict(top_k=2)),
        (("staged", "integrated"), dict(router="expert_choice", capacity_factor=1.5)),
    ],
)
def test_per_token_flops_sum_to_the_realized_forward_flops(layers, extra):
    cfg = tiny_cfg(*layers, **extra)
    out = LM(cfg)(x := torch.randint(0, 256, (3, 16)))
    tc = token_compute(cfg, out.aux, tuple(x.shape))
    total = sum(f.total for f in forward_flops(cfg, 16, out.aux)) * 3
    assert float(tc.flops_BS.sum()) == pytest.approx(total, rel=1e-12)
    for i, kind in enumerate(cfg.layers):
        if kind == "staged":  # experts only where the MoD router routed, as many as the inner MoE computed
            routed = out.aux.stats[f"layers.{i}.mod.router"].compute_T.view(3, 16) > 0
            assert float(tc.mlp_LBS[i][~routed].abs().sum()) == 0
            inner = out.aux.stats[f"layers.{i}.moe.router"]
            assert float(tc.mlp_LBS[i].sum()) == float(inner.kept_E.sum())
            assert torch.equal(tc.mlp_LBS[i][routed].view(3, -1), inner.compute_T.view(inner.batch_shape).double())


# ----------------------------------------------------------------------------------------- accumulation


def test_accumulation_over_steps_adds_the_raw_counts():
    tc_stats, mod_stats = hand_token_choice_stats(), hand_mod_stats()
    acc = RoutingAccumulator()
    for _ in range(3):  # three "steps" with the same routing
        acc.add({"moe": tc_stats, "mod": mod_stats})
    s = acc.router_summary("moe")
    assert s["calls"] == 3 and s["kept"] == [6.0, 3.0] and s["requested"] == [15.0, 3.0, 6.0]
    assert s["dropped_frac"] == pytest.approx(0.5) and s["noop_share"] == pytest.approx(0.25)
    assert s["selected_by_position"] == [0.5, 1.0, 0.0, 0.0]
    # merge of two accumulators == one accumulator over all calls
    a, b = RoutingAccumulator(), RoutingAccumulator()
    a.add({"moe": tc_stats, "mod": mod_stats})
    b.add({"moe": tc_stats, "mod": mod_stats})
    b.add({"moe": tc_stats, "mod": mod_stats})
    a.merge(b)
    assert a.sums.keys() == acc.sums.keys()
    assert all(torch.equal(a.sums[k], acc.sums[k]) for k in acc.sums)


def test_accumulating_two_batches_equals_one_concatenated_batch():
    """Token-choice (dropless) and MoD routing are per token / per sequence, so two forward passes add
    up to the forward of their concatenation, per-token compute included."""
    cfg = tiny_cfg("integrated", "mod", "moe", top_k=2)
    model = LM(cfg)
    x1, x2 = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (3, 16))
    steps = RoutingAccumulator()
    for x in (x1, x2):
        steps.add_lm(cfg, model(x).aux, tuple(x.shape))
    once = RoutingAccumulator()
    x = torch.cat([x1, x2])
    once.add_lm(cfg, model(x).aux, tuple(x.shape))
    for k in once.sums:
        if k.endswith("calls"):
            assert float(steps.sums[k]) == 2 * float(once.sums[k])
        else:
            assert torch.allclose(steps.sums[k], once.sums[k], rtol=1e-6), k
    assert steps.summary()["overall"]["noop_share"] == pytest.approx(once.summary()["overall"]["noop_share"])


def test_state_dict_round_trip_and_different_lengths():
    cfg = tiny_cfg("mod")
    model = LM(cfg)
    acc = RoutingAccumulator()
    for S in (16, 8):  # per-position sums grow to the longest sequence seen
        x = torch.randint(0, 256, (2, S))
        acc.add_lm(cfg, model(x).aux, (2, S))
    assert acc.sums["tokens|pos_count_S"].tolist() == [4.0] * 8 + [2.0] * 8
    copy = RoutingAccumulator()
    copy.load_state_dict(acc.state_dict())
    assert copy.summary() == acc.summary() and copy.layer_kinds == ("mod",)


# --------------------------------------------------------------------------------------------- ranks

RANK_LAYERS, RANK_CFG = ("moe", "staged", "integrated"), dict(top_k=2, capacity_factor=1.0)
RANK_SHAPES = [[(2, 16), (1, 16)], [(3, 12), (2, 16)]]  # per rank, per step: uneven batches and lengths


def _rank_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 256, shape, generator=g) for shape in RANK_SHAPES[rank]]


def _rank_accumulate(rank: int, acc: RoutingAccumulator) -> None:
    cfg = tiny_cfg(*RANK_LAYERS, **RANK_CFG)
    torch.manual_seed(0)
    model = LM(cfg)  # the same weights on every rank
    for x in _rank_batches(rank):
        acc.add_lm(cfg, model(x).aux, tuple(x.shape))
    if rank == 1:  # a router only one rank has seen: the union of layouts must still line up
        acc.add({"extra.router": hand_token_choice_stats()})


def _rank_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    from mode.parallel.stats_reduce import all_reduce_accumulator

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        acc = RoutingAccumulator()
        _rank_accumulate(rank, acc)
        all_reduce_accumulator(acc, dist.group.WORLD)
        torch.save(acc.state_dict(), Path(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.cpu_only("gloo ranks on CPU; the CPU run covers them")
def test_all_reduce_over_two_gloo_ranks_equals_one_accumulator():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _rank_worker, args=(2, str(Path(tmp, "store")), tmp), nprocs=2, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + 90
        try:
            while not ctx.join(timeout=0.2):  # raises ProcessRaisedException if a worker failed
                if time.monotonic() > deadline:
                    pytest.fail("all_reduce workers did not finish in 90 s (hang in a collective?)")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        states = [torch.load(Path(tmp, f"rank{r}.pt")) for r in range(2)]
    single = RoutingAccumulator()
    for rank in range(2):
        _rank_accumulate(rank, single)
    for state in states:
        acc = RoutingAccumulator()
        acc.load_state_dict(state)
        assert acc.sums.keys() == single.sums.keys()
        for k in single.sums:
            assert torch.allclose(acc.sums[k], single.sums[k], rtol=1e-12, atol=0), k
        assert acc.layer_kinds == single.layer_kinds
        assert acc.summary() == single.summary()
    assert acc.sums["tokens|count"].item() == 2 * 16 + 1 * 16 + 3 * 12 + 2 * 16


# ------------------------------------------------------------------------------------- training + report


def write_text(path: Path, n: int = 4000, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    words = ["def ", "return ", "self", ".x", " = ", "(", ")", ":\n", "    ", "import ", "mode", "1", "+"]
    path.write_text("".join(rng.choice(words, size=n)))
    return path


def corpus_of(path: Path) -> Corpus:
    arr = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    cut = int(len(arr) * 0.9)
    return Corpus(arr[:cut], arr[cut:], str(path))


def test_training_logs_routing_records_and_compare_reads_them(tmp_path):
    from mode.experiments.compare import _routing_summary, format_table
    from mode.train import TrainConfig, Trainer

    cfg = tiny_cfg("dense", "mod", "integrated", top_k=1)
    tcfg = TrainConfig(steps=6, batch_size=2, warmup_steps=1, eval_every=6, eval_batches=1, log_every=3, stats_every=2)
    t = Trainer(cfg, tcfg, corpus_of(write_text(tmp_path / "t.txt")), tmp_path / "run", progress=False)
    hist = t.run()
    recs = [r for r in hist if "routing" in r]
    assert [r["step"] for r in recs] == [2, 4, 6]
    assert hist[-1]["val_loss"] > 0  # the evaluation record stays last
    for r in recs:
        layers, overall = r["routing"]["layers"], r["routing"]["overall"]
        assert set(layers) == {"1", "2"}
        assert layers["1"]["routed_frac"] == 0.25  # exactly C = 4 of 16 per sequence
        assert set(layers["2"]) >= {
            "expert_frac",
            "max_mean",
            "cv",
            "dropped_frac",
            "noop_share",
            "entropy",
            "routed_frac",
        }
        assert sum(layers["2"]["expert_frac"]) == pytest.approx(1.0, abs=1e-5)
        assert overall["blocks_per_token"] == 2.25  # dense + integrated always, MoD a quarter of the time
        assert 0 <= overall["noop_share"] <= 1 and overall["dropped_frac"] == 0.0
    assert not t.routing  # emptied after each record: a record covers only the steps since the last one
    row = {
        "val_loss": 5.0,
        "fwd_flops_per_token": 1.0,
        "flop_ratio": 1.0,
        "params": 1,
        "steps": 6,
        "wall_s": 1.0,
        "tok_s": 1.0,
        "routing": _routing_summary(hist),
    }
    table = format_table({"integrated": row})
    assert "blocks/tok" in table.splitlines()[0] and table.splitlines()[2].rstrip().endswith("2.25")


def test_mode_report_on_a_trained_checkpoint(tmp_path, capsys):
    from mode.cli import main
    from mode.train import TrainConfig, Trainer

    data = write_text(tmp_path / "data.txt")
    cfg = tiny_cfg("moe", "staged", "integrated", "mod", top_k=2, capacity_factor=1.0)
    tcfg = TrainConfig(steps=3, batch_size=2, warmup_steps=1, eval_every=3, eval_batches=1, log_every=3)
    Trainer(cfg, tcfg, corpus_of(data), tmp_path / "run", progress=False).run()
    out = tmp_path / "report"
    assert (
        main(["report", str(tmp_path / "run" / "ckpt.pt"), "--data", str(data), "--out", str(out), "--batches", "2"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "Load balance per layer" in printed and "Bytes with the most compute" in printed
    report = json.loads((out / "report.json").read_text())
    assert [layer["kind"] for layer in report["layers"]] == list(cfg.layers)
    assert report["data"]["tokens"] == 2 * 2 * 16
    assert report["layers"][3]["routed_frac"] == 0.25
    assert len(report["heatmap"]["routed_frac"]) == 4 and len(report["heatmap"]["routed_frac"][0]) == 16
    assert report["top_bytes"]["most"] and report["top_bytes"]["least"]
    assert set(report["layers"][1]["routers"]) == {"mod", "moe"}
    for name in ("compute_hist.png", "routing_heatmap.png", "expert_load.png"):
        blob = (out / name).read_bytes()
        assert blob[:8] == PNG_MAGIC and len(blob) > 1000, name
    assert main(["report", str(tmp_path / "missing.pt")]) == 2
    assert "mode report: error: checkpoint=" in capsys.readouterr().err


def test_expert_load_plot_has_headroom_and_one_legend_outside_the_panels(monkeypatch):
    import matplotlib.figure

    from mode.experiments.report import plot_expert_load

    def router(requested, kept, E, mod=False):
        return {"tokens": 100.0, "num_experts": E, "requested": requested, "kept": kept, "mod": mod}

    report = {
        "layers": [
            {"layer": 0, "kind": "integrated", "routers": {"moe": router([40, 10, 30, 20], [35, 10], 2)}},
            {"layer": 1, "kind": "mod", "routers": {"mod": router([12.5, 87.5], [12.5], 1, True)}},
        ]
    }
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    plot_expert_load(report, Path("unused.png"))
    fig = figures[0]
    moe_ax, mod_ax = fig.axes[:2]
    for ax, tallest in ((moe_ax, 0.40), (mod_ax, 0.875)):
        assert ax.get_ylim()[1] >= 1.1 * tallest  # no bar touches the frame
        assert ax.get_legend() is None  # no legend over the bars
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["computed", "dropped", "no-op", "uniform"]
    assert legend.get_window_extent().y0 >= max(ax.get_window_extent().y1 for ax in fig.axes)  # above the panels


def forced_model() -> LM:
    """Layer 0 is MoD whose score is embedding column 0: 'Z' scores 5, every other byte at most 0."""
    cfg = tiny_cfg("mod", "dense")
    model = LM(cfg)
    with torch.no_grad():
        model.layers[0].router.weight.zero_()
        model.layers[0].router.weight[0] = 1.0
        # a fixed CPU draw whatever the default device: the same scores under MODE_TEST_DEVICE=cuda (a CUDA
        # draw gave another byte order, and with it a 'least' list holding 'Z' or an always-routed byte)
        model.embed.weight[:, 0] = -torch.rand(256, generator=torch.Generator().manual_seed(0), device="cpu")
        model.embed.weight[ord("Z"), 0] = 5.0
    return model


def test_report_shows_a_forced_routing_pattern(tmp_path):
    from mode.experiments.report import build_report, run_report

    model = forced_model()
    # heatmap: 'Z' only at the last 4 positions (C = 4) -> layer 0 routes exactly those positions
    x = torch.randint(ord("a"), ord("y"), (6, 16))
    x[:, 12:] = ord("Z")
    report, _ = build_report(model, [(x, x)])
    assert report["heatmap"]["routed_frac"][0] == [0.0] * 12 + [1.0] * 4
    assert report["heatmap"]["routed_frac"][1] == [1.0] * 16  # the dense layer
    assert report["layers"][0]["routers"]["mod"]["selected_by_position"] == [0.0] * 12 + [1.0] * 4
    # top tokens, through the checkpoint path: 'Z' (at most 2 per 16-byte window) always gets both blocks
    rng = np.random.default_rng(1)
    text = "".join(rng.choice(["ab", "cd ", "e", "fgh", "\n"], size=3000).tolist())
    text = "".join(ch + ("Z" if i % 9 == 8 else "") for i, ch in enumerate(text))
    (tmp_path / "z.txt").write_text(text)
    torch.save({"model_cfg": asdict(model.cfg), "model": model.state_dict(), "step": 0}, tmp_path / "ckpt.pt")
    rep = run_report(tmp_path / "ckpt.pt", data=str(tmp_path / "z.txt"), batches=2, batch_size=4, quiet=True)
    most = rep["top_bytes"]["most"][0]
    assert most["text"] == "Z" and most["mean_blocks"] == 2.0
    assert all(r["mean_blocks"] < 2.0 for r in rep["top_bytes"]["least"])
    assert (tmp_path / "report" / "report.json").is_file()


def test_report_with_causal_routing_maps_packed_slots():
    """Causal routing packs a variable number of routed tokens per row (fillers after them): the staged
    layer's experts still land only on routed positions, and the blocks count matches the MoD decisions."""
    from mode.experiments.report import build_report

    torch.manual_seed(3)
    model = LM(tiny_cfg("staged", "mod", causal="aux_bce", top_k=2))
    x = torch.randint(0, 256, (4, 16))
    report, table = build_report(model, [(x, x)], causal_routing=True)
    out = model(x, causal_routing=True)
    tc = token_compute(model.cfg, out.aux, (4, 16))
    routed0 = out.aux.stats["layers.0.mod.router"].compute_T.view(4, 16) > 0
    routed1 = out.aux.stats["layers.1.mod.router"].compute_T.view(4, 16) > 0
    assert torch.equal(table.blocks_NS, (routed0.double() + routed1.double()).cpu())  # the table is host data
    assert float(tc.mlp_LBS[0][~routed0].abs().sum()) == 0
    if "layers.0.moe.router" in out.aux.stats:
        assert float(tc.mlp_LBS[0].sum()) == float(out.aux.stats["layers.0.moe.router"].kept_E.sum())
    assert report["data"]["causal_routing"] and report["layers"][0]["routed_frac"] == float(routed0.double().mean())
