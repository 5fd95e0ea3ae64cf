"""`mode isoflop`: step counts on budget, paired data order, a tiny sweep end to end (JSON, tables, PNGs,
resume), the CLI, and the interval arithmetic of `mode.experiments.stats_ci` against hand-computed numbers."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_compare import write_text_file

import mode.experiments.isoflop
import mode.model
from mode.cli import main
from mode.experiments import stats_ci, sweep
from mode.experiments.compare import CLAIMS, variants
from mode.experiments.isoflop import run_isoflop
from mode.experiments.isoflop_plan import IsoflopPreset, plan, preset, size_config
from mode.experiments.isoflop_report import format_report, parabola_fit
from mode.model import LMConfig
from mode.train import TrainConfig, Trainer
from mode.train.data import file_corpus

NAMES = ["dense", "mod", "mod_random", "moe", "staged_mode", "integrated_mode"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VOLATILE = ("wall_s", "run_s", "tok_s", "wall", "machine", "estimate")  # estimate: measured seconds too


def tiny_preset(**kw) -> IsoflopPreset:
    """4 sizes (2 to 5 layers, d = 4 x layers) x 3 budgets: 1 to 2 steps of the largest size, 6 to 13 of the
    smallest. A whole 2-seed sweep of the six variants (144 runs) takes seconds."""
    base = LMConfig(seq_len=32, d_model=16, n_heads=1, d_hidden=64, num_experts=2)
    train = TrainConfig(batch_size=4, lr=3e-3, warmup_steps=2, eval_every=10**9, eval_batches=1, log_every=5)
    args = dict(
        budgets=(2e7, 3e7, 4.5e7), aspect=4, n_layers=(2, 3, 4, 5), head_dim=4, eval_windows=32, eval_batch_size=16
    )
    return IsoflopPreset(base, train, **{**args, **kw})


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("isoflop")
    data = write_text_file(out / "corpus.txt")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        report = run_isoflop(out / "run", data=str(data), seeds=2, progress=False, preset_override=tiny_preset())
    return out / "run", data, report, stdout.getvalue()


# ------------------------------------------------------------------------------------- budgets and steps


@pytest.mark.parametrize(
    "p, budgets, sizes",
    [(preset(True), 3, 4), (preset(False), 3, 4), (preset("gpu"), 2, 3), (tiny_preset(), 3, 4)],
    ids=["quick", "default", "gpu", "tiny"],
)
def test_step_counts_hit_the_budget_for_every_size_and_variant(p, budgets, sizes, tmp_path):
    specs = plan(p, tmp_path, seeds=[0])
    assert len(specs) == len(p.budgets) * len(p.sizes) * len(NAMES)
    # the gpu preset has what 6 minutes of one GPU allow (isoflop_plan.preset's comment): 3 sizes, the fewest
    # that can show an optimum inside them, and 2 budgets
    assert len(p.budgets) >= budgets and len(p.sizes) >= sizes
    for s in specs:
        cost = sweep.step_flops(s.cfg, p.train.batch_size)
        assert abs(s.steps * cost - s.budget) <= cost / 2 + 1e-9 * s.budget, s.label  # nearest whole step
        assert s.steps >= 1


def test_sizes_keep_one_aspect_ratio_and_grow():
    for p in (preset(True), preset(False)):
        cfgs = [size_config(p, s) for s in p.sizes]
        assert all(c.d_model == p.aspect * c.n_layers for c in cfgs)  # depth and width scale together
        assert all(c.d_hidden == 4 * c.d_model for c in cfgs)
        params = [sum(x.numel() for x in mode.model.LM(c).parameters()) for c in cfgs]
        assert params == sorted(params) and params[-1] > 10 * params[0]


def test_budget_below_one_step_is_a_clean_error(tmp_path):
    with pytest.raises(ValueError, match=r"budget=1e\+06 FLOPs: less than one training step of dense L2_d8"):
        run_isoflop(tmp_path / "out", budgets=[1e6], preset_override=tiny_preset(), progress=False)
    assert not (tmp_path / "out" / "runs").exists()  # nothing trained


def test_one_layer_sizes_are_refused():
    with pytest.raises(ValueError, match="n_layers=1: must be >= 2"):
        tiny_preset(n_layers=(1, 2, 3, 4))


# --------------------------------------------------------------------------------------- paired seeds


def _batches_seen(cfg, seed, corpus, tmp_path, steps=4):
    """The batches a sweep run of ``cfg`` on ``seed`` trains on, recorded from its sampler."""
    tcfg = sweep.run_train_config(tiny_preset().train, steps, seed, None)
    trainer = Trainer(cfg, tcfg, corpus, tmp_path, progress=False)
    seen = []
    orig = trainer.sampler.next

    def record():
        x, y = orig()
        seen.append(x.clone())
        return x, y

    trainer.sampler.next = record
    trainer.run()
    return seen


def test_paired_seeds_give_identical_data_order_across_variants_and_sizes(tmp_path):
    corpus = file_corpus(write_text_file(tmp_path / "c.txt"), 100)
    p = tiny_preset()
    small, large = (variants(size_config(p, s)) for s in (p.sizes[0], p.sizes[-1]))
    runs = {
        (name, n): _batches_seen(cfg, 7, corpus, tmp_path / f"{name}{n}")
        for n, vs in (("small", small), ("large", large))
        for name, cfg in vs.items()
    }
    ref = runs[("dense", "small")]
    for key, seen in runs.items():
        assert len(seen) == len(ref) and all(torch.equal(a, b) for a, b in zip(seen, ref)), key
    other = _batches_seen(small["dense"], 8, corpus, tmp_path / "other")
    assert not torch.equal(other[0], ref[0])  # another seed, another order


def test_validation_windows_are_fixed_and_shared(tmp_path):
    corpus = file_corpus(write_text_file(tmp_path / "c.txt"), 100)
    a = sweep.validation_windows(corpus, 32, 64, 16)
    b = sweep.validation_windows(corpus, 32, 64, 16)
    assert len(a) == 4 and all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    with pytest.raises(ValueError, match="eval_windows=30: must be a multiple of eval_batch_size=16"):
        sweep.validation_windows(corpus, 32, 30, 16)


# --------------------------------------------------------------------------------------- the tiny sweep


def test_tiny_sweep_writes_valid_json_with_every_size_and_seed(tiny_sweep):
    out, data, report, _ = tiny_sweep
    on_disk = json.loads((out / "isoflop.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert on_disk["config"]["seeds"] == [0, 1] and on_disk["config"]["corpus"] == str(data)
    p = tiny_preset()
    assert [e["budget"] for e in on_disk["budgets"]] == list(p.budgets)
    for entry in on_disk["budgets"]:
        assert list(entry["variants"]) == NAMES
        for name, v in entry["variants"].items():
            assert [s["size"] for s in v["sizes"]] == [s.name for s in p.sizes]
            for s in v["sizes"]:
                assert set(s["loss"]) == {"0", "1"} and all(0 < x < 10 for x in s["loss"].values())
                assert s["params"] > 0 and s["steps"] >= 1
                cost = s["nominal_flops"] / s["steps"]
                assert abs(s["nominal_flops"] - entry["budget"]) <= cost / 2 + 1e-9  # within half a step
                if name != "integrated_mode":  # static routing: realized FLOPs are the nominal ones
                    assert all(f == pytest.approx(s["nominal_flops"]) for f in s["train_flops"].values())
                assert s["loss_mean"] == pytest.approx(sum(s["loss"].values()) / 2)
            best = v["best"]
            assert best["loss_mean"] == min(s["loss_mean"] for s in v["sizes"])
            assert v["fit"] is not None and {"a", "b", "c", "params_opt", "interior"} <= set(v["fit"])
        assert set(entry["claims"]) == set(CLAIMS)
        for label, c in entry["claims"].items():
            a, b = CLAIMS[label]
            va, vb = entry["variants"][a]["best"], entry["variants"][b]["best"]
            assert c["mean"] == pytest.approx(va["loss_mean"] - vb["loss_mean"])
            assert c["low"] <= c["mean"] <= c["high"] and c["n"] == 2
            assert c["significant"] == (c["low"] > 0 or c["high"] < 0)
            assert c["at_edge"] == [n for n, v in ((a, va), (b, vb)) if v["at_edge"]]  # flagged: not an optimum
        assert set(entry["per_size"]) == set(CLAIMS)
        for label, rows in entry["per_size"].items():  # the same claim at each size: same size, same FLOPs
            a, b = CLAIMS[label]
            assert [r["size"] for r in rows] == [s["size"] for s in entry["variants"][a]["sizes"]]
            for r, sa, sb in zip(rows, entry["variants"][a]["sizes"], entry["variants"][b]["sizes"]):
                assert r["mean"] == pytest.approx(sa["loss_mean"] - sb["loss_mean"]) and r["n"] == 2
                assert r["low"] <= r["mean"] <= r["high"]
                assert r["flops_per_token_ratio"] == pytest.approx(
                    sa["nominal_flops"] / sa["steps"] / (sb["nominal_flops"] / sb["steps"])
                )
    assert on_disk["validation"]["windows"] == 32 and on_disk["validation"]["loss_se_max"] > 0


def test_tiny_sweep_writes_tables_and_nonempty_pngs(tiny_sweep):
    out, _, report, stdout = tiny_sweep
    for name in ("loss_vs_params.png", "best_loss_vs_budget.png"):
        png = (out / name).read_bytes()
        assert png[:8] == PNG_MAGIC and len(png) > 5000, name
    assert format_report(report) in stdout
    assert "validation: 32 fixed windows of 32 bytes" in stdout
    md = (out / "isoflop.md").read_text()
    n_sizes = len(report["budgets"][0]["variants"]["dense"]["sizes"])
    assert md.count("| 2e+07 |") == len(NAMES) + len(CLAIMS) + len(CLAIMS) * n_sizes  # best, claims, per size
    assert "MoD - best dense" in md and "learned - random routing" in md


def test_rerun_reuses_finished_runs_and_resumes_an_interrupted_one(tiny_sweep, tmp_path, capsys):
    """A sweep killed part-way: finished runs (result.json) are skipped; a run with a checkpoint and no
    result resumes from it; the report equals the uninterrupted one."""
    import shutil

    src, data, report, _ = tiny_sweep
    out = tmp_path / "run"
    shutil.copytree(src, out)
    p = tiny_preset()
    spec = next(s for s in plan(p, out, [0, 1]) if s.variant == "mod_random" and s.seed == 1)
    (spec.dir / "result.json").unlink()  # killed after its last checkpoint, before writing its result
    (out / "isoflop.json").unlink()
    capsys.readouterr()
    again = run_isoflop(out, data=str(data), seeds=2, progress=False, preset_override=p)
    stdout = capsys.readouterr().out
    assert "143 of 144 runs done in an earlier run" in stdout
    assert f"{spec.label}: resuming at step {spec.steps} of {spec.steps}" in stdout
    strip = lambda r: {k: v for k, v in r.items() if k not in VOLATILE}  # noqa: E731
    assert strip(json.loads(json.dumps(again))) == strip(json.loads(json.dumps(report)))


def test_more_seeds_later_reuse_the_first_ones(tiny_sweep, tmp_path, capsys):
    import shutil

    src, data, _, _ = tiny_sweep
    out = tmp_path / "run"
    shutil.copytree(src, out)
    p = tiny_preset(budgets=(2e7,), n_layers=(2, 3, 4))
    report = run_isoflop(out, data=str(data), seeds=3, only=["dense", "mod"], progress=False, preset_override=p)
    assert "12 of 18 runs done in an earlier run" in capsys.readouterr().out  # seeds 0 and 1 were there
    assert report["budgets"][0]["claims"]["MoD - best dense"]["n"] == 3


def test_rerun_with_another_preset_is_refused_unless_fresh(tiny_sweep, tmp_path):
    import shutil

    src, data, _, _ = tiny_sweep
    out = tmp_path / "run"
    shutil.copytree(src, out)
    other = tiny_preset()
    other.train = replace(other.train, lr=1e-3)
    with pytest.raises(ValueError, match="holds a run with other arguments: train.lr=0.003 there, train.lr=0.001 now"):
        run_isoflop(out, data=str(data), progress=False, preset_override=other)
    with pytest.raises(ValueError, match="causal='predictor' there, causal='aux_bce' now"):
        run_isoflop(out, data=str(data), progress=False, preset_override=tiny_preset(), causal="aux_bce")


def test_parallel_jobs_give_the_same_numbers(tmp_path):
    """--jobs 2 trains in two worker processes (one thread each): the same losses as one process."""
    data = write_text_file(tmp_path / "c.txt")
    p = tiny_preset(budgets=(2e7,), n_layers=(2, 3))
    kw = dict(data=str(data), only=["dense", "mod"], progress=False, preset_override=p, threads=1)
    torch.set_num_threads(1)
    one = run_isoflop(tmp_path / "one", jobs=1, **kw)
    two = run_isoflop(tmp_path / "two", jobs=2, **kw)
    assert one["budgets"] == two["budgets"]


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_isoflop_runs_and_reports(tmp_path, capsys, monkeypatch):
    import mode.experiments.isoflop

    monkeypatch.setattr(
        mode.experiments.isoflop, "preset", lambda quick: tiny_preset(budgets=(2e7, 3e7, 4.5e7), n_layers=(2, 3, 4, 5))
    )
    data = write_text_file(tmp_path / "c.txt")
    rc = main(
        [
            "isoflop",
            "--quick",
            "--data",
            str(data),
            "--seeds",
            "2",
            "--only",
            "dense",
            "mod",
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
            "--threads",
            "1",
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "out" / "isoflop.json").read_text())
    assert list(report["budgets"][0]["variants"]) == ["dense", "mod"]
    out = capsys.readouterr().out
    assert "MoD - best dense" in out
    # --no-progress: no bar, but each run's start, end and result lines, and no carriage return
    n = 3 * 4 * 2 * 2  # budgets x sizes x variants x seeds
    assert len(re.findall(r"^\S+ (dense|mod) L\d_d\d+ seed \d: \d layers, d_model \d+, \d+ steps$", out, re.M)) == n
    assert len(re.findall(r"^\S+ (dense|mod) L\d_d\d+ seed \d: step (\d+)/\2 done in ", out, re.M)) == n
    assert len(re.findall(rf"^\[\d+/{n}\] .*: val loss ", out, re.M)) == n and "\r" not in out


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--only", "dense", "mdo"], "only=['dense', 'mdo']: unknown variant 'mdo'; must be among dense, mod,"),
        (["--seeds", "0"], "seeds=0: must be >= 1"),
        (["--jobs", "0"], "jobs=0: must be >= 1"),
        (["--budgets", "1e3"], "budget=1e+03 FLOPs: less than one training step of dense L2_d"),
        (["--budgets", "-1"], "budget=-1.0: must be finite and > 0"),
        (["--mod-capacity", "0"], "capacity=0.0: must be in (0, 1]"),
        pytest.param(
            ["--device", "cuda"],
            "device='cuda': torch.cuda.is_available() is False",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible"),
        ),
    ],
)
def test_cli_bad_arguments_are_clean_errors(tmp_path, capsys, argv, msg):
    rc = main(["isoflop", "--quick", "--out", str(tmp_path / "out"), "--no-progress", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("mode isoflop: error: ") and msg in err
    assert not (tmp_path / "out" / "runs").exists()


# ------------------------------------------------------------------------------------ interval arithmetic


@pytest.mark.parametrize(
    "df,expected", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (5, 2.5706), (9, 2.2622), (29, 2.0452)]
)
def test_t_quantile_matches_the_table(df, expected):
    assert stats_ci.t_quantile(0.975, df) == pytest.approx(expected, abs=5e-5)
    assert stats_ci.t_quantile(0.025, df) == pytest.approx(-expected, abs=5e-5)


def test_t_cdf_known_values():
    assert stats_ci.t_cdf(0.0, 3) == 0.5
    assert stats_ci.t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert stats_ci.t_cdf(2.0, 2) == pytest.approx(0.5 + 2 / (2 * math.sqrt(6)))  # df 2: 1/2 + t / (2 sqrt(2 + t^2))


def test_paired_difference_by_hand():
    # a - b = [0.5, 0.2, 0.9]: mean 0.53333, std sqrt(0.24667 / 2) = 0.35119, se 0.20276,
    # t(0.975, 2) = 4.30265, half-width 0.87240 -> [-0.33907, 1.40573]: contains 0, not significant
    d = stats_ci.paired_difference([1.0, 2.0, 3.0], [0.5, 1.8, 2.1])
    assert d["n"] == 3 and d["mean"] == pytest.approx(0.533333, abs=1e-6)
    assert d["std"] == pytest.approx(0.351188, abs=1e-6)
    assert d["low"] == pytest.approx(-0.339067, abs=1e-6) and d["high"] == pytest.approx(1.405734, abs=1e-6)
    assert d["significant"] is False
    assert d["rel"] == pytest.approx(0.533333 / (4.4 / 3), abs=1e-6)
    # a - b = [-0.02, -0.03, -0.025, -0.022]: mean -0.02425, squared deviations sum to 5.675e-5,
    # std sqrt(5.675e-5 / 3) = 0.0043493, se 0.0021747, t(0.975, 3) = 3.18245, half-width 0.0069208
    # -> [-0.0311708, -0.0173292]: excludes 0, significant
    d = stats_ci.paired_difference([1.00, 1.10, 0.90, 1.05], [1.02, 1.13, 0.925, 1.072])
    assert d["mean"] == pytest.approx(-0.02425, abs=1e-9)
    assert d["std"] == pytest.approx(0.0043493, abs=1e-7)
    assert d["low"] == pytest.approx(-0.0311708, abs=1e-6) and d["high"] == pytest.approx(-0.0173292, abs=1e-6)
    assert d["significant"] is True


def test_one_seed_has_no_interval_and_lengths_must_match():
    d = stats_ci.paired_difference([1.0], [1.5])
    assert d["mean"] == -0.5 and d["std"] is None and d["low"] is None and d["significant"] is None
    assert stats_ci.format_difference(d) == "-0.5000 (1 seed: no interval)"
    with pytest.raises(ValueError, match="len\\(a\\)=2, len\\(b\\)=1: a paired difference needs one pair per seed"):
        stats_ci.paired_difference([1.0, 2.0], [1.0])


def test_window_noise_by_hand():
    # losses [1, 2, 3, 4]: std 1.29099, SE 0.645497; paired with [1, 1, 2, 3]: diffs [0, 1, 1, 1], SE 0.25
    assert stats_ci.window_noise([1.0, 2.0, 3.0, 4.0]) == pytest.approx(0.645497, abs=1e-6)
    assert stats_ci.window_noise([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 2.0, 3.0]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="same validation windows"):
        stats_ci.window_noise([1.0, 2.0], [1.0])


def test_format_helpers():
    assert stats_ci.format_pm(1.23456, 0.0123) == "1.2346 ± 0.0123"
    assert stats_ci.format_pm(1.23456, None) == "1.2346"
    assert stats_ci.format_pm(-0.5, 0.25, "+.2f") == "-0.50 ± 0.25"  # the sign belongs to the mean only
    d = stats_ci.paired_difference([1.00, 1.10, 0.90, 1.05], [1.02, 1.13, 0.925, 1.072])
    assert stats_ci.format_difference(d) == "-0.0242 ± 0.0043 [-0.0312, -0.0173] *"


def test_parabola_fit_finds_the_minimum():
    xs = [4.0, 4.5, 5.0, 5.5]
    ys = [2 * (x - 4.8) ** 2 + 1.5 for x in xs]
    fit = parabola_fit(xs, ys)
    assert fit["params_opt"] == pytest.approx(10**4.8) and fit["loss_opt"] == pytest.approx(1.5)
    assert fit["interior"] is True
    assert parabola_fit(xs, [-y for y in ys])["params_opt"] is None  # a maximum, not a minimum
    assert parabola_fit([4.0, 5.0], [1.0, 2.0]) is None  # too few points


# ----------------------------------------------------------------------- the gpu preset's planning arithmetic


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "layers",
    [("dense", "mod"), ("moe", "staged", "moe"), ("integrated",) * 3, ("dense", "mod_random", "dense", "mod_random")],
)
def test_operation_counts_of_the_time_estimate_match_a_counted_step(layers, tmp_path):
    """isoflop_plan.OPS_PER_STEP / OPS_PER_LAYER against the aten operations of one real training step
    (bf16 autocast, after two warm-up steps). They were counted so on the code the H200 timed (6ad4109); the
    fused ops since (mode/kernels) cut a step's count by 10-15% here, but each custom op costs the host more
    than an aten op, so the estimate stays the upper bound it was calibrated as until a GPU re-times it: a step
    may count fewer operations (down to 60% of the estimate), never more than 10% above it."""
    from mode.experiments.isoflop_plan import step_ops
    from mode.train.data import stdlib_corpus

    cfg = LMConfig(
        seq_len=32,
        d_model=32,
        n_heads=2,
        d_hidden=64,
        num_experts=4,
        num_noop=4,
        layers=layers,
        predictor_hidden=16,
        causal="predictor" if "mod" in layers or "staged" in layers else "none",
    )
    tcfg = TrainConfig(steps=10, batch_size=4, warmup_steps=1, eval_every=10**9, eval_batches=1, log_every=10**9)
    trainer = Trainer(cfg, tcfg, stdlib_corpus(max_bytes=200_000), tmp_path, name="ops", progress=False, bf16=True)
    trainer.train_step()
    trainer.train_step()
    with _CountOps() as count:
        trainer.train_step()
    assert 0.6 * step_ops(cfg) <= count.n <= 1.1 * step_ops(cfg)


def test_the_time_estimate_reproduces_the_measured_h200_step_and_the_preset_fits_six_minutes():
    from mode.experiments.isoflop_plan import estimate_s, estimate_step_s, run_cost
    from mode.parallel.command import PRESETS

    # the one measurement behind the constants: mode train --preset base --bf16, 477,526 tokens/s at 64 x 512
    assert estimate_step_s(PRESETS["base"].model, 64) == pytest.approx(64 * 512 / 477_526, rel=0.005)
    p = preset("gpu")
    assert p.data == "packages" and p.train.batch_size * p.base.seq_len == 131_072
    assert 300 <= estimate_s(p, seeds=2) <= 420  # "about 6 minutes" for 2 seeds of the six variants
    specs = plan(p, Path("."), [0])
    tokens = [run_cost(s, p)["tokens"] for s in specs]
    assert max(tokens) < 1.3e8  # at most one epoch of any packages corpus of 130 MB or more (219 MB here)
    assert min(s.steps for s in specs) >= 30


def test_extra_variants_join_the_sweep_only_when_named(tmp_path):
    p = tiny_preset(budgets=(2e7,), n_layers=(2, 3))
    names = {s.variant for s in plan(p, tmp_path, [0])}
    assert names == set(NAMES)
    names = {s.variant for s in plan(p, tmp_path, [0], only=["staged_mode", "integrated_mode_matched"])}
    assert names == {"staged_mode", "integrated_mode_matched"}
    with pytest.raises(ValueError, match="unknown variant 'integrated_mode_matchd'"):
        run_isoflop(tmp_path / "o", only=["integrated_mode_matchd"], preset_override=p, progress=False)
