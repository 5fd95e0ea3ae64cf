"""`mode compare`: six variants and a dense depth sweep at matched training FLOPs, the headline against the
best dense model, seeds and paired intervals, the JSON report, the table, the plot, the CLI."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mode.train.data
from mode.cli import main
from mode.experiments.compare import (
    CLAIMS,
    dense_depths,
    dense_sweep,
    extra_variants,
    format_table,
    legend,
    preset,
    run_compare,
    variants,
)
from mode.measure.flops import forward_flops_per_token, train_flops_per_token

SIX = ["dense", "mod", "mod_random", "moe", "staged_mode", "integrated_mode"]
SWEEP = ["dense_1l", "dense_2l", "dense_3l"]  # the quick preset has 4 layers: the dense sweep adds 1, 2 and 3
NAMES = [*SWEEP, *SIX]
TABLE_KEYS = {
    "val_loss",
    "val_loss_std",
    "loss_ratio",
    "loss_ratio_same_size",
    "fwd_flops_per_token",
    "flop_ratio",
    "params",
    "steps",
    "wall_s",
    "tok_s",
    "val_loss_seeds",
    "eval_se",
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DENSE_STEPS = 3


def write_text_file(path: Path) -> Path:
    # real UTF-8 text, comfortably above min_file_bytes(128) = 2580 bytes
    path.write_text(Path(mode.train.data.__file__).read_text() * 3 + "caf\u00e9 \u2211\n")
    return path


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    data = write_text_file(out / "corpus.txt")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        report = run_compare(out / "run", quick=True, data=str(data), dense_steps=DENSE_STEPS, progress=False)
    return out / "run", data, report, stdout.getvalue()


def test_report_has_all_variants_and_the_dense_sweep_with_the_table_keys(quick_run):
    out, data, report, _ = quick_run
    on_disk = json.loads((out / "compare.json").read_text())
    assert on_disk == json.loads(json.dumps(report))  # the file is the returned report
    results = on_disk["results"]
    assert list(results) == NAMES
    for name, r in results.items():
        assert TABLE_KEYS <= set(r), name
        assert math.isfinite(r["val_loss"]) and 0 < r["val_loss"] < math.log(256) + 1
        assert r["curve"] and r["curve"][-1][0] == pytest.approx(r["train_flops"])
        assert r["tokens"] == r["steps"] * 8 * 128
        assert (out / name / "log.jsonl").is_file() and (out / name / "ckpt.pt").is_file()
    assert on_disk["config"]["corpus"] == str(data)
    assert on_disk["config"]["dense_steps"] == DENSE_STEPS
    assert on_disk["config"]["quick"] is True
    assert on_disk["config"]["seeds"] == [0] and on_disk["config"]["eval_windows"] == 512
    assert "window_losses" not in results["dense"]  # per-window losses stay in each run's result.json
    assert len(json.loads((out / "dense" / "result.json").read_text())["window_losses"]) == 512


def test_variants_train_to_the_same_flop_budget(quick_run):
    _, _, report, _ = quick_run
    results = report["results"]
    base = preset(True).model
    tokens_per_step = 8 * 128
    models = {**dense_sweep(base), **variants(base)}
    budget = DENSE_STEPS * 3 * forward_flops_per_token(models["dense"]) * tokens_per_step
    assert report["config"]["budget_flops"] == pytest.approx(budget)
    for name, r in results.items():
        cost = train_flops_per_token(models[name]) * tokens_per_step  # nominal training FLOPs of one step
        assert abs(r["steps"] * cost - budget) <= cost / 2 + 1e-6 * budget, name  # nearest whole number of steps
        # realized FLOPs (from the routing each step) equal nominal wherever compute is static; integrated
        # MoDE's depends on how many tokens its router sends to the no-op experts
        rel = 0.25 if name == "integrated_mode" else 1e-9
        assert r["train_flops"] == pytest.approx(r["steps"] * cost, rel=rel), name
    dense = results["dense"]
    assert dense["steps"] == DENSE_STEPS
    assert dense["train_flops"] == pytest.approx(budget)  # dense routing is static: realized == nominal
    assert dense["flop_ratio"] == 1.0 and dense["loss_ratio_same_size"] == 1.0
    for name in ("mod", "mod_random", "staged_mode", "integrated_mode", *SWEEP):
        assert results[name]["flop_ratio"] < 1, name
        assert results[name]["steps"] > DENSE_STEPS, name  # cheaper steps: more of them in the same budget
    assert results["moe"]["params"] > results["dense"]["params"]
    best = report["baseline"]["variant"]
    for r in results.values():
        assert r["loss_ratio"] == pytest.approx(r["val_loss"] / results[best]["val_loss"])
        assert r["loss_ratio_same_size"] == pytest.approx(r["val_loss"] / dense["val_loss"])


def test_headline_is_the_best_of_the_dense_depth_sweep(quick_run):
    _, _, report, stdout = quick_run
    results, baseline = report["results"], report["baseline"]
    assert dense_depths(4) == [1, 2, 3, 4]
    assert set(baseline["candidates"]) == {"dense", *SWEEP}
    losses = {name: results[name]["val_loss"] for name in baseline["candidates"]}
    assert baseline["variant"] == min(losses, key=losses.get) and baseline["val_loss"] == min(losses.values())
    assert baseline["rule"].startswith(
        "best of 4 dense depths (1, 2, 3, 4 layers) of the same width at the same training FLOPs"
    )
    assert results[baseline["variant"]]["loss_ratio"] == 1.0
    assert all(r["loss_ratio"] >= 1.0 for name, r in results.items() if name in baseline["candidates"])
    assert f"best dense model: {baseline['variant']} (best of 4 dense depths" in stdout
    assert "loss/best dense" in format_table(results).splitlines()[0]


def test_claims_and_validation_noise_with_one_seed(quick_run):
    _, _, report, stdout = quick_run
    claims, best = report["claims"], report["baseline"]["variant"]
    assert set(claims) == set(CLAIMS)
    assert (claims["MoD - best dense"]["a"], claims["MoD - best dense"]["b"]) == ("mod", best)
    assert (claims["learned - random routing"]["a"], claims["learned - random routing"]["b"]) == ("mod", "mod_random")
    for c in claims.values():
        r = report["results"]
        assert c["mean"] == pytest.approx(r[c["a"]]["val_loss"] - r[c["b"]]["val_loss"])
        assert c["n"] == 1 and c["low"] is None and c["significant"] is None  # one seed: no interval
        assert 0 < c["eval_se"] < 0.1
    v = report["validation"]
    assert v["windows"] == 512 and v["seq_len"] == 128 and 0 < v["difference_se_max"] < v["loss_se_max"]
    assert "(1 seed: no interval)" in stdout
    assert f"validation: 512 fixed windows of 128 bytes; noise of one loss <= {v['loss_se_max']:.4f}" in stdout


def test_causal_routing_report_for_learned_mod_variants(quick_run):
    results = quick_run[2]["results"]
    for name in ("mod", "staged_mode"):
        c = results[name]["causal"]
        assert 0 <= c["causal_accuracy"] <= 1 and 0 <= c["routed_fraction"] <= 1
        assert c["ar_gap"] == pytest.approx(c["loss_causal"] / c["loss_topk"] - 1)
    for name in ("dense", "mod_random", "moe", "integrated_mode"):
        assert results[name]["causal"] is None


def test_table_is_printed_and_formats_the_report(quick_run):
    _, _, report, stdout = quick_run
    table = format_table(json.loads(json.dumps(report))["results"])
    lines = table.splitlines()
    assert len(lines) == 2 + len(NAMES)
    assert set(lines[1]) == {"-"}
    assert [line.split()[0] for line in lines[2:]] == NAMES
    assert table in stdout
    dense_row = lines[2 + NAMES.index("dense")].split()
    assert float(dense_row[1]) == pytest.approx(report["results"]["dense"]["val_loss"], abs=1e-4)


def test_every_variant_logs_its_start_progress_and_end_as_plain_lines(quick_run):
    stdout = quick_run[3]  # run with progress=False: no bar, the lines still print
    assert "\r" not in stdout
    for k, name in enumerate(NAMES, 1):
        start = rf"^\[{k}/{len(NAMES)}\] {name}: \d layers?, \d+ steps of 1,024 tokens \(budget "
        assert re.search(start, stdout, re.M)
        assert re.search(rf"^{name}: step (\d+)/\1 done in \S+  loss \d+\.\d{{4}}  [\d,]+ tok/s$", stdout, re.M)
        assert re.search(
            rf"^\[{k}/{len(NAMES)}\] {name}: val loss \d\.\d{{4}} \(final evaluation, 512 held-out "
            r"windows\)",
            stdout,
            re.M,
        )


def test_table_titles_are_distinct_and_a_legend_explains_them(quick_run):
    _, _, report, stdout = quick_run
    results = json.loads(json.dumps(report))["results"]
    table = format_table(results)
    titles = re.split(r"\s{2,}", table.splitlines()[0].strip())[1:]
    assert "vs dense" not in titles and len(titles) == len(set(titles)), titles
    assert {"loss/best dense", "loss/same-size dense", "fwd FLOP/tok", "FLOP/tok / dense"} <= set(titles)
    text = legend(report, "text")
    assert table + "\n" + text in stdout  # right under the table
    explained = {line[2:].split("  ")[0] for line in text.splitlines()[1:]}
    assert set(titles) - {"params"} <= explained, set(titles) - explained
    assert "nats/byte" in text and "512 fixed windows of 128 bytes" in text
    assert "top-k routes exactly 12.5%" in text  # why routed is below the capacity
    assert "means over the routed blocks (unrouted blocks are not averaged in), on the 32 windows" in text


def test_plot_ends_at_the_tables_loss_and_names_the_dense_depth(quick_run, monkeypatch):
    import matplotlib.figure

    out, _, report, _ = quick_run
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    monkeypatch.setattr("mode.train.checkpoint.atomic_write", lambda path, data: None)
    from mode.experiments.compare import plot_curves

    plot_curves(json.loads(json.dumps(report)), out / "unused.png")
    ax = figures[0].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert f"dense (4 layers): {report['results']['dense']['val_loss']:.4f}" in labels
    stars = [line for line in ax.get_lines() if line.get_marker() == "*"]
    assert [(float(s.get_xdata()[0]), float(s.get_ydata()[0])) for s in stars] == [
        (r["train_flops"], r["val_loss"]) for r in report["results"].values()
    ]
    legend_box = ax.get_legend().get_window_extent()
    assert legend_box.x0 >= ax.get_window_extent().x1  # outside the axes: it covers no curve


def test_plot_is_a_real_png(quick_run):
    out = quick_run[0]
    png = (out / "val_loss_vs_flops.png").read_bytes()
    assert png[:8] == PNG_MAGIC
    assert len(png) > 1024


def test_markdown_table_lists_every_variant_with_its_loss(quick_run):
    out, _, report, _ = quick_run
    text = (out / "compare.md").read_text()
    lines = text.split("\n\n")[0].splitlines()  # the table, then the notes
    assert lines[1].startswith("|---|") and len(lines) == 2 + len(report["results"])
    assert "best dense model: " in text and "MoD - best dense" in text
    assert (
        legend(report, "md") in text
        and "- *loss / same-size dense*: val loss / dense's (the same depth: 4 layers)" in text
    )
    for line, (name, r) in zip(lines[2:], report["results"].items()):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == name and float(cells[1]) == pytest.approx(r["val_loss"], abs=5e-5)


# --------------------------------------------------------------------------------------------------- CLI


def test_cli_compare_only_two_variants(tmp_path, capsys):
    rc = main(
        ["compare", "--quick", "--dense-steps", "2", "--out", str(tmp_path), "--no-progress", "--only", "dense", "mod"]
    )
    assert rc == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    assert list(report["results"]) == ["dense", "mod"]
    assert report["results"]["dense"]["steps"] == 2
    assert report["config"]["corpus"].startswith("python-stdlib (")  # the default corpus
    assert report["baseline"]["variant"] == "dense" and "not a sweep" in report["baseline"]["rule"]
    assert (tmp_path / "val_loss_vs_flops.png").read_bytes()[:8] == PNG_MAGIC
    assert not (tmp_path / "moe").exists()
    out = capsys.readouterr().out
    for k, name in enumerate(["dense", "mod"], 1):  # --no-progress: no bar, the lines still print
        assert re.search(rf"^{name}: step \d+/\d+ done in .* tok/s$", out, re.M), out
        assert f"[{k}/2] {name}: val loss " in out


def test_a_run_logged_to_files_has_plain_lines_and_no_carriage_returns(tmp_path):
    """`mode compare > log 2> err` (pipes here, not a terminal): no bar however asked, a start, end and result
    line for each variant on stdout as it goes, and no carriage return anywhere."""
    data = write_text_file(tmp_path / "corpus.txt")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mode.cli",
            "compare",
            "--quick",
            "--data",
            str(data),
            "--dense-steps",
            "2",
            "--only",
            "dense",
            "mod",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "run"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout and "\r" not in proc.stderr
    for k, name in enumerate(["dense", "mod"], 1):
        assert re.search(rf"^\[{k}/2\] {name}: 4 layers, \d+ steps", proc.stdout, re.M), proc.stdout
        assert re.search(rf"^{name}: step (\d+)/\1 done in \S+  loss \d+\.\d{{4}}  [\d,]+ tok/s$", proc.stdout, re.M)
        assert re.search(rf"^\[{k}/2\] {name}: val loss ", proc.stdout, re.M)
    # the lines come before the table, as each run ends, not all at the end
    assert proc.stdout.index("[2/2] mod: val loss") < proc.stdout.index("variant ")


def test_cli_missing_data_file_is_a_clean_error(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    rc = main(
        [
            "compare",
            "--quick",
            "--dense-steps",
            "2",
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
            "--data",
            str(missing),
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("mode compare: error: ")
    assert f"data={str(missing)!r}: no such file" in err
    assert not (tmp_path / "out" / "compare.json").exists()


def test_cli_binary_data_file_is_a_clean_error(tmp_path, capsys):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\x00" * 5000)
    rc = main(["compare", "--quick", "--out", str(tmp_path / "out"), "--no-progress", "--data", str(blob)])
    assert rc == 2
    assert "looks binary" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,msg",
    [
        (
            ["--only", "dense", "mdo"],
            "only=['dense', 'mdo']: unknown variant 'mdo'; must be among dense_1l, dense_2l, dense_3l, dense, mod,",
        ),
        (["--seeds", "0"], "seeds=0: must be >= 1"),
        (["--dense-steps", "0"], "dense_steps=0: must be >= 1"),
        (["--dense-steps", "-3"], "dense_steps=-3: must be >= 1"),
        (["--threads", "0"], "--threads=0: must be >= 1"),
    ],
)
def test_cli_bad_arguments_are_clean_errors(tmp_path, capsys, argv, msg):
    rc = main(["compare", "--quick", "--out", str(tmp_path / "out"), "--no-progress", *argv])
    assert rc == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # rejected before any work


def test_matched_pairs_run_on_request_at_about_equal_flops(tmp_path):
    names = ["integrated_mode_matched", "staged_mode_matched"]
    report = run_compare(tmp_path, quick=True, dense_steps=2, only=names, progress=False)
    assert list(report["results"]) == names  # extras never join the default six
    base = preset(True).model
    default, extra = variants(base), extra_variants(base)
    assert extra["integrated_mode_matched"].num_noop == 7 * base.num_experts
    assert extra["staged_mode_matched"].capacity == 0.5 and extra["staged_mode_matched"].causal == "predictor"
    dense_fwd = forward_flops_per_token(default["dense"])

    def ratio(cfg):
        return forward_flops_per_token(cfg) / dense_fwd

    # each matched variant sits closer to its partner's per-token FLOPs than the default variant does
    for matched, partner, unmatched in (
        ("integrated_mode_matched", "staged_mode", "integrated_mode"),
        ("staged_mode_matched", "integrated_mode", "staged_mode"),
    ):
        got = report["results"][matched]["flop_ratio"]
        assert abs(got - ratio(extra[matched])) < 1e-9
        assert abs(got - ratio(default[partner])) < 0.1
        assert abs(got - ratio(default[partner])) < abs(ratio(default[unmatched]) - ratio(default[partner]))


def test_seeds_give_paired_runs_with_mean_std_and_intervals(tmp_path, capsys):
    data = write_text_file(tmp_path / "corpus.txt")
    out = tmp_path / "run"
    report = run_compare(
        out,
        quick=True,
        data=str(data),
        dense_steps=2,
        seed=3,
        seeds=2,
        progress=False,
        only=["dense", "dense_2l", "mod", "mod_random"],
    )
    assert report["config"]["seeds"] == [3, 4]
    runs = {
        name: [json.loads((out / name / f"seed{s}" / "result.json").read_text()) for s in (3, 4)]
        for name in report["results"]
    }
    for name, r in report["results"].items():
        losses = [x["val_loss"] for x in runs[name]]
        assert [x["seed"] for x in runs[name]] == [3, 4]
        assert r["val_loss"] == pytest.approx(sum(losses) / 2)
        assert r["val_loss_std"] == pytest.approx(abs(losses[0] - losses[1]) / math.sqrt(2))
        assert r["val_loss_seeds"] == {"3": losses[0], "4": losses[1]}
    assert set(report["claims"]) == {"MoD - best dense", "learned - random routing"}  # only those were trained
    c = report["claims"]["learned - random routing"]
    assert c["diffs"] == pytest.approx([m["val_loss"] - r["val_loss"] for m, r in zip(runs["mod"], runs["mod_random"])])
    assert c["n"] == 2 and c["low"] < c["mean"] < c["high"]
    assert c["significant"] == (c["low"] > 0 or c["high"] < 0)
    assert "differences, paired over 2 seed(s)" in capsys.readouterr().out


def test_run_compare_rejects_unknown_variant_before_training(tmp_path):
    with pytest.raises(ValueError, match="unknown variant 'moe2'"):
        run_compare(tmp_path, quick=True, only=["moe2"], progress=False)


def test_quick_preset_is_valid_and_comparable():
    p = preset(True)
    models = variants(p.model)
    assert list(models) == SIX
    assert len({cfg.n_layers for cfg in models.values()}) == 1  # same depth
    assert len({cfg.d_model for cfg in models.values()}) == 1  # same width
    assert models["integrated_mode"].num_noop >= 1
    assert models["mod"].layers == ("dense", "mod") * (p.model.n_layers // 2)


# ------------------------------------------------------------------------------------- kill and resume

VOLATILE = ("wall_s", "tok_s", "wall", "mfu")  # timings differ between any two runs (mfu: on a GPU)


def _stable(obj):
    """``obj`` without its timing fields, at any depth."""
    if isinstance(obj, dict):
        return {k: _stable(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_stable(v) for v in obj]
    return obj


def test_killed_compare_resumes_to_identical_results(tmp_path, capsys):
    """SIGKILL in the middle of a run (half-way through writing a checkpoint of the third variant), then
    the same command again: the finished variants are skipped, the third resumes, and compare.json equals
    an uninterrupted run's (timings aside) bit for bit. The resumed variant is mod_random, whose routing
    draws from torch's global RNG: its restore is tested too."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from mode.train import checkpoint

    data = write_text_file(tmp_path / "corpus.txt")
    args = [
        "--quick",
        "--data",
        str(data),
        "--dense-steps",
        "2",
        "--only",
        "dense",
        "mod",
        "mod_random",
        "--threads",
        "1",
        "--no-progress",
    ]
    assert main(["compare", *args, "--out", str(tmp_path / "ref")]) == 0  # uninterrupted

    out = tmp_path / "run"
    env = {
        **os.environ,
        checkpoint.STALL_ENV: "/mod_random/ckpt.pt@1",  # its second checkpoint stops half-way
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "mode.cli", "compare", *args, "--out", str(out), "--ckpt-every-s", "1e-9"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        # the stall hook marks the stuck write (an ordinary write in progress also has a non-empty temp file)
        while not list((out / "mod_random").glob(".ckpt.pt.*.tmp.stalled")):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the write never stalled"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (out / "mod" / "result.json").is_file() and not (out / "compare.json").exists()
    assert checkpoint.load_checkpoint(out / "mod_random" / "ckpt.pt")["step"] == 1  # the last complete one

    capsys.readouterr()
    assert main(["compare", *args, "--out", str(out)]) == 0  # the same command again
    stdout = capsys.readouterr().out
    assert f"dense: done in an earlier run, results from {out / 'dense' / 'result.json'}" in stdout
    assert "mod: done in an earlier run" in stdout
    assert f"mod_random: resuming at step 1 of 3 from {out / 'mod_random' / 'ckpt.pt'}" in stdout
    ref = json.loads((tmp_path / "ref" / "compare.json").read_text())
    got = json.loads((out / "compare.json").read_text())
    assert _stable(got) == _stable(ref)
    assert got["results"]["mod_random"]["val_loss"] == ref["results"]["mod_random"]["val_loss"]
    for name in ("dense", "mod", "mod_random"):  # the log holds each record once, as in the uninterrupted run
        log, ref_log = ((d / name / "log.jsonl").read_text().splitlines() for d in (out, tmp_path / "ref"))
        assert _stable([json.loads(x) for x in log]) == _stable([json.loads(x) for x in ref_log])
    assert (out / "compare.md").read_text() == (tmp_path / "ref" / "compare.md").read_text()


def test_rerun_with_other_arguments_is_refused_unless_fresh(tmp_path, capsys):
    data = write_text_file(tmp_path / "corpus.txt")
    args = [
        "compare",
        "--quick",
        "--data",
        str(data),
        "--dense-steps",
        "1",
        "--only",
        "dense",
        "--no-progress",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(args) == 0
    before = (tmp_path / "run" / "compare.json").read_text()
    capsys.readouterr()
    assert main([*args, "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds a run with other arguments: seed=0 there, seed=1 now" in err
    assert "pass --fresh to discard it and start over" in err
    assert (tmp_path / "run" / "compare.json").read_text() == before  # untouched
    assert main([*args, "--dense-steps", "2"]) == 2
    assert "dense_steps=1 there, dense_steps=2 now" in capsys.readouterr().err
    other = write_text_file(tmp_path / "other.txt")
    other.write_text(other.read_text() + "# one more line\n")
    assert main([a if a != str(data) else str(other) for a in args]) == 2
    assert "data=" in capsys.readouterr().err
    assert main([*args, "--seed", "1", "--fresh"]) == 0
    assert json.loads((tmp_path / "run" / "compare.json").read_text())["config"]["seed"] == 1
    assert main([*args, "--seed", "1"]) == 0  # the same arguments as the fresh run: resumes (nothing to do)
    assert "dense: done in an earlier run" in capsys.readouterr().out


def test_bf16_trains_under_autocast_and_is_part_of_the_run_identity(tmp_path, capsys, monkeypatch):
    import mode.train

    seen = []
    real_init = mode.train.Trainer.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        seen.append(self.bf16)

    monkeypatch.setattr(mode.train.Trainer, "__init__", spy)
    data = write_text_file(tmp_path / "corpus.txt")
    args = [
        "compare",
        "--quick",
        "--data",
        str(data),
        "--dense-steps",
        "1",
        "--only",
        "dense",
        "moe",
        "--no-progress",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main([*args, "--bf16"]) == 0
    report = json.loads((tmp_path / "run" / "compare.json").read_text())
    assert seen == [True, True] and report["config"]["bf16"] is True and report["config"]["device"] == "cpu"
    assert all(math.isfinite(r["val_loss"]) for r in report["results"].values())
    capsys.readouterr()
    assert main(args) == 2  # the same folder in float32 is another run
    assert "bf16=True there" in capsys.readouterr().err
    assert main([*args, "--bf16"]) == 0 and seen == [True, True]  # resumes: nothing left to train


def test_negative_ckpt_every_s_is_refused(tmp_path, capsys):
    assert main(["compare", "--quick", "--ckpt-every-s", "-1", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "ckpt_every_s=-1.0: must be finite and > 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_gpu_preset_is_the_isoflop_gpu_presets_largest_size_on_the_packages_corpus():
    """The numbers of compare.preset's comment and docs/compare.md: budget, steps, tokens, estimated time."""
    from mode.experiments import sweep
    from mode.experiments.isoflop_plan import RUN_OVERHEAD_S, estimate_step_s, preset as iso_preset

    p, iso = preset("gpu"), iso_preset("gpu")
    assert (
        p.data == "packages" and p.model.d_model == iso.sizes[-1].d_model and p.model.n_layers == iso.sizes[-1].n_layers
    )
    assert (p.train.batch_size, p.model.seq_len) == (iso.train.batch_size, iso.base.seq_len)
    models = {**dense_sweep(p.model), **variants(p.model)}
    budget = p.dense_steps * sweep.step_flops(models["dense"], p.train.batch_size)
    assert budget == pytest.approx(6.7e14, rel=0.01)
    steps = {n: sweep.steps_for_budget(c, budget, p.train.batch_size) for n, c in models.items()}
    assert steps["dense_1l"] == 765 and steps["mod"] == 355
    seconds = sum(steps[n] * estimate_step_s(c, p.train.batch_size) + RUN_OVERHEAD_S for n, c in models.items())
    assert seconds == pytest.approx(80, abs=2)
    assert preset(True) == preset("quick") and preset(False) == preset("default")
    with pytest.raises(ValueError, match="preset='gpu2'"):
        preset("gpu2")
