"""The performance benchmark still runs end to end (quick shapes) and writes the JSON the docs cite."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from inproc import run_main  # noqa: E402


def test_bench_performance_quick_writes_every_case(tmp_path, device):
    out = tmp_path / "performance.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # a subprocess: the benchmark tunes malloc for its whole process (--malloc retain, the default)
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "layers" / "bench_performance.py"),
            "--quick",
            "--no-compile",
            "--threads",
            "1",
            "--device",
            str(device),
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    payload = json.loads(out.read_text())
    assert payload["malloc"]["malloc"] == "retain"
    machine = payload["machine"]
    assert payload["device"] == machine["device"] == str(device) and machine["torch"] == torch.__version__
    assert machine["device_name"] == (
        torch.cuda.get_device_name(device) if device.type == "cuda" else machine["processor"]
    )
    cases = [r["case"] for r in payload["results"]]
    assert sum(c.startswith("MoE top-") for c in cases) == 8  # top-1/2 x E=8/64 x reference/grouped
    assert any(c.startswith("MoE expert-choice E=64") for c in cases)
    assert any(c.startswith("MoD c=0.125") for c in cases) and any(c.startswith("MoD LM step") for c in cases)
    gpu_rows = [r for r in payload["results"] if r["kind"] == "gpu"]
    assert len(gpu_rows) == (8 if device.type == "cuda" else 0)  # top-1/2 x E=8/64 x grouped/megablocks
    for row in payload["results"]:
        if "skipped" in row:  # MegaBlocks where it does not import
            assert row["backend"] == "megablocks", row
            continue
        assert math.isfinite(row["ratio_median"]) and row["ratio_median"] > 0, row
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"], row
        assert isinstance(row["meets_target"], bool), row


def test_bench_layers_bf16_quick_times_under_autocast_and_records_the_dtype(tmp_path, device):
    """--bf16 (--dtype bfloat16): every forward under bfloat16 autocast (on CUDA the experts' fast grouped
    GEMM is bfloat16 only); the JSON says so."""
    out = tmp_path / "layers.json"
    run_main(
        "benchmarks.layers.bench_layers",
        [
            "--quick",
            "--bf16",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--device",
            str(device),
            "--out",
            str(out),
        ],
        cwd=tmp_path,
    )
    payload = json.loads(out.read_text())
    assert payload["dtype"] == "bfloat16" and payload["device"] == str(device)
    assert payload["autocast"] == f"torch.autocast({device.type!r}, torch.bfloat16); weights float32"
    assert len(payload["results"]) == 9  # top-1/2 x E=8/64 x reference/grouped, and the MoD block
    assert all(math.isfinite(r["ratio_median"]) and r["ratio_median"] > 0 for r in payload["results"])


def test_bench_peers_quick_runs_what_imports_and_says_why_not(tmp_path, device):
    """The peer benchmark at tiny sizes: mode's rows always; transformers / torchtitan rows where they
    import, else a reason in the JSON (CI installs only .[test], so there they are skipped)."""
    out = tmp_path / "peers.json"
    run_main(
        "benchmarks.layers.bench_peers",
        [
            "--quick",
            "--threads",
            "1",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--device",
            str(device),
            "--out",
            str(out),
        ],
        cwd=tmp_path,
    )
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    rows = payload["results"]
    configs = {r["config"] for r in rows}
    assert len(configs) == 2
    for config in configs:
        names = {r["implementation"] for r in rows if r["config"] == config}
        assert {"mode, auto", "mode, reference"} <= names and any(n.startswith("dense") for n in names)
    for family in ("transformers", "torchtitan"):
        ran = [r for r in rows if r["family"] == family]
        if not ran:  # skipped: the JSON says why, with the way to install it
            assert family in payload["skipped"] and payload["skipped"][family], family
    for r in rows:
        assert math.isfinite(r["ratio_median"]) and r["ratio_median"] > 0, r
        if r["family"] == "dense":
            assert r["ratio_median"] == 1.0
        elif r["same_function"] is False:  # group-limited routing chooses other experts: reported, not judged
            assert r["agrees"] is None and r["family"] == "mode", r
        elif r["computes_in"] == "float32":  # same weights, same routing: the same numbers
            assert r["agrees"] is True, (r["implementation"], r["max_abs_diff_y"], r["max_abs_diff_dx"])
    assert {"mode, auto, + bias balancing, sequence loss", "mode, auto, + bias, sequence loss, 4 groups keep 2"} <= {
        r["implementation"] for r in rows
    }


def test_bench_peers_bf16_quick_measures_autocast_beside_float32(tmp_path):
    """--precision bf16: mode under autocast agrees with its float32 output within bf16 rounding (its router
    stays float32), and every row gets its time relative to mode's float32 layer from the same rounds."""
    out = tmp_path / "peers_bf16.json"
    run_main(
        "benchmarks.layers.bench_peers",
        [
            "--quick",
            "--threads",
            "1",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--precision",
            "bf16",
            "--experts",
            "4",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
    )
    payload = json.loads(out.read_text())
    assert payload["dtype"] == "bf16"
    rows = {r["implementation"]: r for r in payload["results"]}
    auto, fp32 = rows["mode, auto"], rows["mode, auto, float32 (no autocast)"]
    assert auto["computes_in"] == "bfloat16 autocast" and auto["agrees"] is True and auto["diff_is_relative"]
    assert 0 < auto["max_abs_diff_y"] < 0.05, auto["max_abs_diff_y"]  # bf16 rounding: not zero, not large
    assert fp32["computes_in"] == "float32" and fp32["max_abs_diff_y"] == 0.0 and fp32["ratio_to_mode_float32"] == 1.0
    baseline = [r for r in rows.values() if r["implementation"].endswith("(the baseline)")]
    assert len(baseline) == 1 and baseline[0]["ratio_median"] == 1.0 and "bf16" in baseline[0]["implementation"]
    for r in rows.values():
        assert math.isfinite(r["ratio_to_mode_float32"]) and r["ratio_to_mode_float32"] > 0, r["implementation"]
        if r["family"] == "torchtitan":  # its router is float32 too: only bf16 rounding apart
            assert r["agrees"] is True, r


def test_bf16_training_smoke_compares_paired_runs(tmp_path):
    out = tmp_path / "bf16.json"
    run_main(
        "benchmarks.training.bf16_training",
        [
            "--quick-test",
            "--no-progress",
            "--threads",
            "1",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        cwd=tmp_path,
    )
    payload = json.loads(out.read_text())
    assert [r["variant"] for r in payload["results"]] == ["dense", "moe"]
    for r in payload["results"]:
        assert r["steps"] == 20 and math.isfinite(r["fp32"]) and math.isfinite(r["bf16"])
        assert r["fp32"] != r["bf16"]  # two trainings, not one read twice
        assert abs(r["diff"]["mean"]) < 0.1 and r["tok_s_ratio"] > 0
        assert len(r["curves"]["fp32"]) == len(r["curves"]["bf16"]) == 1 and len(r["curves"]["bf16"][0]) == 2
        assert math.isfinite(r["train_gap_late"]) and r["train_gap_max"] >= abs(r["train_gap_late"])
    assert out.with_suffix(".png").stat().st_size > 0
    assert (tmp_path / "work" / "bf16" / "compare.json").is_file()


def test_bench_balance_smoke_trains_each_recipe_and_reports_the_load(tmp_path):
    out = tmp_path / "balance.json"
    run_main(
        "benchmarks.layers.bench_balance",
        [
            "--quick-test",
            "--no-progress",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
    )
    payload = json.loads(out.read_text())
    assert [r["recipe"] for r in payload["results"]] == ["switch", "bias"]
    for r in payload["results"]:
        assert math.isfinite(r["loss"]) and r["max_mean"] >= 1.0 and r["tok_s"] > 0
    assert "vs_switch" in payload["results"][1] and len(payload["runs"]["bias"][0]["max_mean_curve"]) == 1  # every 10th
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_peers_families_compares_each_transformers_block(tmp_path):
    out = tmp_path / "families.json"
    run_main(
        "benchmarks.layers.bench_peers",
        [
            "--quick",
            "--families",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
    )
    rows = json.loads(out.read_text())["results"]
    assert [r["family"] for r in rows] == [
        "Qwen3-MoE",
        "Qwen2-MoE",
        "DeepSeek-V3",
        "DeepSeek-V2",
        "ERNIE-4.5",
        "LFM2-MoE",
        "Granite-MoE",
        "gpt-oss",
        "Llama-4",
        "LongCat-Flash",
    ]
    assert all(r["agrees"] and r["mode_over_transformers"] > 0 for r in rows), rows
    assert all(r["max_abs_diff_y"] < 1e-4 and r["precision"] == "float32" for r in rows), rows


def test_longcat_budget_holds_the_zero_expert_share_and_writes_its_plot(tmp_path):
    out = tmp_path / "longcat.json"
    run_main("benchmarks.hf.longcat_budget", ["--quick", "--threads", "1", "--out", str(out)], cwd=tmp_path)
    (row,) = json.loads(out.read_text())["results"]
    assert row["target"] == 0.2 and len(row["shares"]) == 20 and 0.0 <= row["share_mean_2nd_half"] <= 1.0
    assert out.with_suffix(".png").stat().st_size > 0


# heal_vs_prune --smoke (tiny random Llama, 2 points, 1 seed, 3 heal steps): one run, shared by the tests below,
# which were one test until it hit pytest's 300 s limit on a loaded 2-core machine (issue 70). The run: about 36
# CPU-seconds; each test after it a few calls of its own. In this process (tests/inproc.py): a subprocess per call
# cost more than the call's work, and no test here kills a run.
HVP = "benchmarks.hf.heal_vs_prune"
HVP_SPEED = "benchmarks.hf.heal_vs_prune_speed"


def _hvp_cmd(out) -> list[str]:
    return ["--smoke", "--threads", "1", "--out", str(out)]


@pytest.fixture(scope="module")
def hvp_smoke(tmp_path_factory):
    """(its folder, the result file, the result, the run's stdout) of the whole smoke run."""
    folder = tmp_path_factory.mktemp("hvp")
    out = folder / "hvp.json"
    first = run_main(HVP, _hvp_cmd(out), cwd=folder)
    return folder, out, json.loads(out.read_text()), first.stdout


def test_heal_vs_prune_refuses_a_negative_seed(tmp_path):
    bad = run_main(HVP, [*_hvp_cmd(tmp_path / "x.json"), "--first-seed", "-1"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "--first-seed -1: a seed is >= 0" in bad.stderr


def test_heal_vs_prune_smoke_pairs_equal_budgets(hvp_smoke):
    """One row per (method, point, seed), every MoD row healed with its pruning partners' budget at MACs within 1%
    of theirs, each method's conversion as it says, the intervals and the PNG."""
    import mode.hf as mh
    from benchmarks.hf.heal_vs_prune_models import tiny_llama

    _, out, payload, stdout = hvp_smoke
    rows = {r["key"]: r for r in payload["rows"]}
    methods = (
        "prune-bi",
        "prune-bi-est",
        "prune-bi-est-all",
        "prune-sc-est-all",
        "mod-layer-thr",
        "mod-layer-thr-est",
        "mod-layer-thr-est-c0.4",
        "mod-layer-thr-est-c0.3",
        "mod-layer-thr-est-c0.4-all",
        "mod-layer-thr-est-c0.4-all-sc",
        "mod-layer-thr-est-c0.4-all-sc-res",
        "mod-layer-thr-est-c0.4-all-sc-res-cd",
        "mod-layer-bce",
        "mod-attn-thr",
        "mod-mlp-thr",
        "mod-mix-thr",
        "mod-mix-thr-est",
        "mod-mix-thr-est-c0.4-all-res-cd",
        "mod-mix-thr-est-c0.4-all-sc-res-cd",
    )
    assert set(rows) == {f"{m}@{p}#s0" for m in methods for p in (0.9, 0.8)}
    assert "below what part='attention' reaches" in rows["mod-attn-thr@0.8#s0"]["skipped"]  # out of reach: said
    for key, r in rows.items():
        if "skipped" in r:
            continue
        assert math.isfinite(r["d_loss_pct"]) and math.isfinite(r["d_loss_pct_before"]), key
        assert len(r["window_losses"]) == 8 and r["decode_b1"] > 0 and r["decode_b8"] > 0, key
        assert r["steps"] == 3 and r["tokens"] == 3 * 4 * 64 and r["lora_params"] > 0, key
        assert r["trainable"] == r["lora_params"] + r["other_params"], key
        if r["method"] == "prune-sc-est-all":  # by skip cost with the estimates: every kept layer adapted
            assert r["by"] == "skip_cost" and r["lora_layers"] == list(range(8 - len(r["layers"]))), key
            est_costs = payload["skip_costs"]["layer+estimate8"]  # the costs that order the -sc MoD rows
            assert r["layers"] == sorted(sorted(range(8), key=lambda i: est_costs[str(i)])[: len(r["layers"])]), key
        if "-sc" in r["method"] and r["method"].startswith("mod-layer"):  # cheapest layers with their estimate first
            est_costs = payload["skip_costs"]["layer+estimate8"]
            want = sorted(range(8), key=lambda i: est_costs[str(i)])[: len(r["layers"])]
            assert r["layers"] == sorted(want) and r["order"] == "skip_cost_est", key
            assert r["label"] == ("residual" if "-res" in r["method"] else "update"), key
            assert r["calibrate"] == ("docstrings" if r["method"].endswith("-cd") else "fit"), key
            assert r["lora_layers"] == list(range(8)), key
        if r["method"] == "prune-bi-est-all":  # adapters on every kept layer: more than on those after the deleted
            assert r["lora_layers"] == list(range(8 - len(r["layers"]))), key
            assert r["lora_params"] > rows[key.replace("-all", "")]["lora_params"], key
        if r["method"] == "mod-layer-thr-est-c0.4-all":  # every layer, the same conversion as without "-all"
            same = rows[key.replace("-all", "")]
            assert r["lora_layers"] == list(range(8)) and r["layers"] == same["layers"], key
            assert r["lora_params"] > same["lora_params"] and r["d_loss_pct_before"] == same["d_loss_pct_before"]
        if r["method"].startswith("mod-"):
            partners = [
                f"{m}@{r['point']}#s0" for m in ("prune-bi", "prune-bi-est", "prune-bi-est-all", "prune-sc-est-all")
            ]
            assert r["same_budget_as"] == partners, key  # heal's report.same_budget asserted in the run
            for k in partners:
                assert all(r[f] == rows[k][f] for f in ("steps", "tokens", "data_digest", "objective")), (key, k)
            assert abs(r["macs_ratio"] - rows[partners[0]]["macs_ratio"]) < 0.01, key
            assert math.isfinite(r["d_loss_pct_topc"]) and 0 < r["share"] <= 1, key
            assert r["estimate_rank"] == (8 if "-est" in r["method"] else None), key
            floor = r["method"].split("-c")[1].split("-")[0] if "-est-c" in r["method"] else "0.5"
            assert r["min_capacity"] == float(floor) and r["capacity"] >= r["min_capacity"], key
            if floor != "0.5" and r.get("order") == "skip_cost" and r["part"] == "layer":  # a lower floor: never
                floor_05 = key.replace(f"-c{floor}", "").replace("-all", "")  # more layers at the same MACs
                assert len(r["layers"]) <= len(rows[floor_05]["layers"]), key
            assert sorted(i for g in r["groups"] for i in g["layers"]) == r["layers"], key
            if r["method"].startswith("mod-mix"):  # halves of different layers, at least two parts
                assert len({g["part"] for g in r["groups"]}) >= 2, (key, r["groups"])
            if r["method"].startswith("mod-mix-thr-est-c0.4-all-"):  # the best whole-layer row's other choices
                assert (r["label"], r["calibrate"], r["lora_layers"]) == ("residual", "docstrings", list(range(8)))
                assert all(g["capacity"] >= 0.4 for g in r["groups"]), (key, r["groups"])
                sc = "-sc" in r["method"]  # the halves ranked with their estimates standing in, or without
                half_costs = {
                    h: {int(i): c for i, c in payload["skip_costs"][h + ("+estimate8" if sc else "")].items()}
                    for h in ("attention", "mlp")
                }
                order = mh.mixed_order(tiny_llama(), half_costs, 64, skip_rank=8)
                taken = {
                    (i, h)
                    for g in r["groups"]
                    for i in g["layers"]
                    for h in (("attention", "mlp") if g["part"] == "layer" else (g["part"],))
                }
                assert taken == set(order[: len(taken)]), (key, taken, order)  # the cheapest units first
    assert payload["intervals"] and all(i["t_ci_pct"] is None for i in payload["intervals"])  # one seed: no t
    for i in payload["intervals"]:
        assert i["bootstrap_ci_pct"][0] <= i["diff_pct"] <= i["bootstrap_ci_pct"][1], i
    assert out.with_suffix(".png").stat().st_size > 0
    assert "prune-bi@0.9#s0" in stdout
    # the out-of-domain sets installed (the code set: transformers' own sources), each healed row measured on them
    # before and after healing, with their baseline, the summary and the pair's intervals per set
    unseen = payload["unseen"]
    assert "code" in unseen and all(u["windows"] == 8 and len(u["text_sha256"]) == 64 for u in unseen.values())
    for key, r in rows.items():
        if "steps" in r:
            assert set(r["unseen"]) == set(r["unseen_before"]) == set(unseen), key
            assert all(len(u["window_losses"]) == 8 and 0 < u["macs_ratio_measured"] <= 1 for u in r["unseen"].values())
    assert all(set(unseen) <= set(s["unseen"]) for s in payload["summary"])
    assert all(set(unseen) <= set(i["unseen"]) for i in payload["intervals"])
    assert "unseen code:" in stdout


def test_heal_vs_prune_resumes_and_splits_seeds(hvp_smoke, tmp_path):
    """A rerun skips the finished rows; a later seed alone (seeds split over processes) adds its own rows with its
    own batches; another heal text is refused (its own file)."""
    folder, done, payload, _ = hvp_smoke
    out = tmp_path / "hvp.json"
    out.write_text(done.read_text())
    rows = {r["key"]: r for r in payload["rows"]}
    cmd, run = _hvp_cmd(out), dict(cwd=tmp_path)
    again = run_main(HVP, cmd, **run)  # resume: every row is there, nothing is healed again
    assert "#s0 " not in again.stdout and "| mod-mlp-thr | 0.80 |" in again.stdout
    assert json.loads(out.read_text())["rows"] == payload["rows"]
    later = [*cmd, "--first-seed", "1", "--seeds", "1", "--macs", "0.9", "--methods", "prune-bi"]
    run_main(HVP, later, **run)  # seed 1 alone (seeds split over processes): its own batches, seed 0 kept
    seed1 = {r["key"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(seed1) == set(rows) | {"prune-bi@0.9#s1"}
    assert seed1["prune-bi@0.9#s1"]["data_digest"] != rows["prune-bi@0.9#s0"]["data_digest"]
    mixed = run_main(HVP, [*later, "--heal-text", "topics+docstrings"], **run, check=False)
    assert mixed.returncode != 0 and "'heal_text': 'topics'" in mixed.stderr  # other heal text: its own file


def test_heal_vs_prune_takes_costs_from_a_result_of_the_same_settings(hvp_smoke, tmp_path):
    _, _, payload, _ = hvp_smoke
    cmd, run = _hvp_cmd(tmp_path / "hvp.json"), dict(cwd=tmp_path)
    planted = tmp_path / "planted.json"  # costs from elsewhere, taken as they are: the last layers cheapest
    planted.write_text(
        json.dumps({**payload, "rows": [], "skip_costs": {"layer+estimate8": {str(i): -i for i in range(8)}}})
    )
    reuse = [*cmd[:-1], str(tmp_path / "reuse.json"), "--macs", "0.9", "--methods", "prune-sc-est-all", "--no-speed"]
    run_main(HVP, [*reuse, "--costs-from", str(planted)], **run)
    took = json.loads((tmp_path / "reuse.json").read_text())
    assert took["skip_costs"]["layer+estimate8"] == {str(i): -i for i in range(8)}  # not measured again
    (row,) = took["rows"]
    assert row["layers"] == list(range(8 - len(row["layers"]), 8)), row["layers"]  # deleted by the planted costs
    other = [*reuse, "--costs-from", str(planted), "--heal-text", "topics+docstrings", "--fresh"]
    refused = run_main(HVP, other, **run, check=False)
    assert refused.returncode != 0 and f"--costs-from {planted}: measured with other settings" in refused.stderr


def test_heal_vs_prune_speed_rebuilds_and_times_the_rows(hvp_smoke, tmp_path):
    """heal_vs_prune_speed.py: the conversions of a result rebuilt (the same layers) and timed alone, paired
    ratios per repeat, and a subset by method, point and batch."""
    _, out, payload, _ = hvp_smoke
    rows = {r["key"]: r for r in payload["rows"]}
    run = dict(cwd=tmp_path)
    speed = tmp_path / "speed.json"  # the conversions rebuilt and timed alone (heal_vs_prune_speed.py)
    # one method of each way a conversion is rebuilt (pruning by influence or by cost with estimates; MoD whole
    # layers, trained BCE routers, attention halves, mixed halves with every option): a third of the rows
    methods = ["prune-bi", "prune-sc-est-all", "mod-layer-thr-est-c0.4-all-sc-res-cd", "mod-layer-bce"]
    methods += ["mod-attn-thr", "mod-mix-thr-est-c0.4-all-sc-res-cd"]
    run_main(HVP_SPEED, ["--smoke", "--rows", out, "--out", speed, "--methods", *methods], **run)
    timed = json.loads(speed.read_text())["results"]
    assert {t["key"] for t in timed} == {k for k, r in rows.items() if "skipped" not in r and r["method"] in methods}
    for t in timed:
        assert t["layers"] == rows[t["key"]]["layers"], t  # the same conversion (pruning re-checks its layers)
        assert all(t[f"{k}_b{b}"] > 0 for k in ("decode", "prefill") for b in (1, 8)), t
        each = t["decode_b8_each"]  # one paired ratio per repeat; the smoke run times one repeat: the same ratio
        assert len(each) == 1 and each[0] == pytest.approx(t["decode_b8"], rel=1e-12), t
        assert t["decode_b8_ci"] is None, t  # one repeat: no interval
    only = ["--smoke", "--rows", str(out), "--out", str(speed), "--methods", "mod-mix-thr"]
    run_main(HVP_SPEED, [*only, "--points", "0.9", "--batches", "1", "--repeats", "2"], **run)
    alone = json.loads(speed.read_text())["results"]
    assert {(t["method"], t["point"]) for t in alone} == {("mod-mix-thr", 0.9)}
    none = run_main(HVP_SPEED, [*only, "--points", "0.5"], **run, check=False)
    assert none.returncode != 0 and "--points [0.5]: no seed-0 row" in none.stderr
    for t in alone:
        assert "decode_b8" not in t, t  # batch 1 only
        lo, hi = t["decode_b1_ci"]  # two repeats: a t interval around their geometric mean
        assert lo <= math.prod(t["decode_b1_each"]) ** 0.5 <= hi, t


def test_speed_ratio_interval():
    from benchmarks.hf.heal_vs_prune_speed import ratio_interval

    assert ratio_interval([1.2]) is None
    assert ratio_interval([1.1, 1.1, 1.1]) == pytest.approx([1.1, 1.1])
    lo, hi = ratio_interval([1.0, 1.21])  # logs 0 and 0.1906: mean 0.0953, half 12.706 * 0.1348 / sqrt(2)
    assert math.log(lo) == pytest.approx(0.0953 - 1.2111, abs=1e-3) and math.log(hi) == pytest.approx(1.3064, abs=1e-3)


def _hvp_doc(rows: list[tuple[str, float, int, float]], base: float = 2.0, steps: int = 100) -> dict:
    """A heal_vs_prune.py result: rows of (method, point, seed, Δ loss %), each over 8 windows."""
    out = []
    for method, point, seed, pct in rows:
        g = torch.Generator().manual_seed(7 * seed + len(method))  # windows that differ between methods
        window_W = base * (1 + pct / 100) + 0.01 * torch.randn(8, generator=g)
        window_W += base * (1 + pct / 100) - window_W.mean()  # the row's Δ exactly
        out.append(
            {
                "key": f"{method}@{point}#s{seed}",
                "method": method,
                "point": point,
                "seed": seed,
                "macs_ratio": point - 0.01,
                "d_loss_pct": pct,
                "window_losses": window_W.tolist(),
                "steps": steps,
                "tokens": steps * 1024,
                "data_digest": f"seed{seed}",
                "objective": "distill",
                "trainable_kind": "lora",
            }
        )
    return {"settings": {"smoke": False, "heal_steps": steps}, "base_loss": base, "skip_costs": {}, "rows": out}


def test_estimate_memory_smoke_fits_the_same_estimates_both_ways(tmp_path):
    """--smoke: each way (tokens held, running sums) in its own process on the tiny random Llama; both fit every
    layer, the maps they fit agree, and the JSON says the memory each took."""
    out = tmp_path / "em.json"
    run_main("benchmarks.hf.estimate_memory", ["--smoke", "--out", out], cwd=ROOT)
    doc = json.loads(out.read_text())
    assert [r["way"] for r in doc["rows"]] == ["forward", "tokens", "moments"]
    assert all(r["layers"] == 8 and r["tokens"] == 8 * 64 and r["growth_mib"] >= 0 for r in doc["rows"])
    assert doc["max_rel_map_diff"] < 1e-4  # the same fits from the sums as from the tokens (measured 0)
    assert math.isfinite(doc["memory_ratio"])


def test_conversion_choices_smoke_plans_each_order_and_label(tmp_path):
    """--smoke: one row per (layer order, router label), each planned to the pruning point's MACs (1%) with the
    layers its order ranks cheapest, measured on the held-out windows."""
    out = tmp_path / "cc.json"
    cmd = ["--smoke", "--threads", "1", "--out", str(out)]
    run_main("benchmarks.hf.conversion_choices", cmd, cwd=tmp_path)
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["order"], r["label"]) for r in rows] == [
        (o, label) for o in ("skip_cost", "skip_cost_est") for label in ("update", "residual")
    ]
    for r in rows:
        costs = doc["skip_costs"][r["order"]]
        ranked = sorted(range(8), key=lambda i: (costs[str(i)], i))
        assert r["layers"] == sorted(ranked[: len(r["layers"])]), r
        assert abs(r["macs_planned"] - doc["target_macs"]) <= 0.01 * doc["target_macs"], r
        assert r["capacity"] >= 0.4 and 0 < r["share_held_out"] <= 1 and 0 < r["share_fit"] <= 1, r
        assert math.isfinite(r["d_loss_pct"]) and math.isfinite(r["d_loss_pct_topc"]) and len(r["window_losses"]) == 8
    assert doc["skip_costs"]["skip_cost"] != doc["skip_costs"]["skip_cost_est"]

    # The thresholds set on docstrings first, then on the fit windows again: router_fit's thresholds come back
    # (the row equals the default run's), and each calibration routes about the planned share of its own text.
    cmd += ["--orders", "skip_cost_est", "--labels", "residual", "--calibrate", "docstrings", "fit"]
    run_main("benchmarks.hf.conversion_choices", cmd, cwd=tmp_path)
    doc_row, fit_row = json.loads(out.read_text())["rows"]
    assert (doc_row["calibrate"], fit_row["calibrate"]) == ("docstrings", "fit")
    before = rows[-1]
    assert fit_row["window_losses"] == before["window_losses"] and fit_row["share_fit"] == before["share_fit"]
    assert doc_row["d_loss_pct_topc"] == fit_row["d_loss_pct_topc"]  # top-C: no threshold involved
    assert abs(doc_row["share_docstrings"] - doc_row["capacity"]) < 0.05, doc_row
    assert abs(fit_row["share_fit"] - fit_row["capacity"]) < 0.05, fit_row


def test_heal_vs_prune_results_split_over_runs_merge_into_one_report(tmp_path):
    """Two runs (one point each, their own --out) merge into one result with both points' summaries, intervals
    over the seeds both methods have, and the PNG; conflicting rows, settings, models and budgets are refused."""
    from benchmarks.hf.heal_vs_prune_report import main, merge

    a, b, into = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "all.json"
    a.write_text(json.dumps(_hvp_doc([("prune-bi-est", 0.9, 0, 4.0), ("mod-layer-thr-est", 0.9, 0, 3.0)])))
    pairs = [(m, 0.8, s, pct + s) for s in (0, 1, 2) for m, pct in (("prune-bi-est", 10.0), ("mod-layer-thr-est", 7.0))]
    b.write_text(json.dumps(_hvp_doc(pairs)))
    doc = main(["--into", str(into), str(a), str(b)])
    assert len(doc["rows"]) == 8 and json.loads(into.read_text())["rows"] == doc["rows"]
    means = {(s["method"], s["point"]): (s["d_loss_pct"], s["seeds"]) for s in doc["summary"]}
    assert means == {
        ("prune-bi-est", 0.9): (4.0, [0]),
        ("mod-layer-thr-est", 0.9): (3.0, [0]),
        ("prune-bi-est", 0.8): (11.0, [0, 1, 2]),
        ("mod-layer-thr-est", 0.8): (8.0, [0, 1, 2]),
    }
    by_point = {i["point"]: i for i in doc["intervals"]}
    assert by_point[0.9]["t_ci_pct"] is None and abs(by_point[0.9]["diff_pct"] + 1.0) < 1e-9
    assert abs(by_point[0.8]["diff_pct"] + 3.0) < 1e-9 and by_point[0.8]["t_ci_pct"] == [-3.0, -3.0]  # no spread
    lo, hi = by_point[0.8]["bootstrap_ci_pct"]
    assert lo < -3.0 < hi
    assert all(
        r["same_budget_as"] == [r["key"].replace("mod-layer-thr-est", "prune-bi-est")]
        for r in doc["rows"]
        if r["method"].startswith("mod")
    )
    assert into.with_suffix(".png").stat().st_size > 0
    assert merge(into, [a])["rows"] == doc["rows"]  # rows already there with the same results: kept once

    bad = tmp_path / "bad.json"
    for rows, kw, match in (
        ([("prune-bi-est", 0.9, 0, 4.5)], {}, "prune-bi-est@0.9#s0 was measured differently"),
        ([("prune-bi-est", 0.75, 0, 4.5)], {"steps": 50}, "settings"),
        ([("prune-bi-est", 0.75, 0, 4.5)], {"base": 2.5}, "original held-out loss"),
    ):
        bad.write_text(json.dumps(_hvp_doc(rows, **kw)))
        with pytest.raises(ValueError, match=match):
            merge(into, [bad])
    doc = _hvp_doc([("mod-layer-thr-est", 0.9, 0, 3.0)])
    doc["rows"][0]["tokens"] += 1  # another budget than the pruning row it is paired with
    bad.write_text(json.dumps(doc))
    fresh = tmp_path / "fresh.json"
    with pytest.raises(ValueError, match="healed with another budget than prune-bi-est@0.9#s0"):
        merge(fresh, [bad, a])
    with pytest.raises(ValueError, match="does not exist"):
        merge(fresh, [])


def test_heal_vs_prune_methods_are_drawn_against_a_pruning_method():
    from benchmarks.hf.heal_vs_prune_report import MOD, PRUNE, _partner

    assert all(_partner(m) in PRUNE for m in MOD.values())
    assert _partner(MOD["mod-layer-thr-est"]) == "prune-bi-est"  # the same estimate and adapters
    assert _partner(MOD["mod-layer-thr-est-c0.4-all-sc-res-cd"]) == "prune-sc-est-all"  # the same layer choice
    assert _partner(MOD["mod-mix-thr-est-c0.4-all-res-cd"]) == "prune-sc-est-all"  # named: the strongest


def test_heal_vs_prune_plot_places_a_row_at_the_macs_it_measured():
    """A threshold router spends what it routes on the held-out text, not what was planned: the plot's x is the
    measured ratio, the planned one only where nothing was measured."""
    from benchmarks.hf.heal_vs_prune_report import _macs_drawn

    assert _macs_drawn({"macs_ratio": 0.841, "macs_ratio_measured": 0.847}) == 0.847
    assert _macs_drawn({"macs_ratio": 0.841, "macs_ratio_measured": None}) == 0.841
    assert _macs_drawn({"macs_ratio": 0.841}) == 0.841


def test_no_benchmark_file_over_450_lines():
    """benchmarks/ stays split by concern (issue 48): a file that grows past 450 lines is split along its seams."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "benchmarks").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 450
    }
    assert not long, long
