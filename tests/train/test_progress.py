"""Progress for a person (mode.train.progress): a bar only on a terminal, plain lines in a log file, and
``--no-progress`` turning off the bar but not the lines (`mode train` here; `mode compare` in
tests/experiments/test_compare.py)."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

from mode.cli import main
from mode.model import LMConfig
from mode.train import TrainConfig, Trainer
from mode.train.data import Corpus
from mode.train.progress import Progress, format_duration, phase

LINE = re.compile(r"^run: step (\d+)/10 \((\d+)%\)  loss (\d+\.\d{4})  ([\d,]+) tok/s  ETA (\S+)$")
END = re.compile(r"^run: step 10/10 done in \S+  loss (\d+\.\d{4})  ([\d,]+) tok/s$")


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def feed(cfg: Progress, clock: Clock, steps: int = 10, dt: float = 1.0) -> None:
    run = cfg.start("run", steps, clock=clock)
    for step in range(1, steps + 1):
        clock.t += dt
        run.update(step, 3.0 - 0.1 * step, 1000.0 * step)
    run.close()


def test_lines_come_at_the_interval_with_loss_speed_and_eta_and_never_a_carriage_return():
    out, err = io.StringIO(), io.StringIO()
    feed(Progress(bar=True, every_s=3.0, out=out, err=err), Clock())  # a bar asked for, but stderr is no terminal
    assert err.getvalue() == ""  # no bar in a file
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    periodic = [LINE.match(line) for line in lines[:-1]]
    assert all(periodic), lines
    assert [int(m[1]) for m in periodic] == [3, 6, 9]  # one every 3 s of a 1 s step
    m = periodic[0]
    assert m[2] == "30" and m[3] == "2.7000" and m[4] == "3,000" and m[5] == "7s"  # 7 steps left at 1 s a step
    assert END.match(lines[-1]) and END.match(lines[-1])[1] == "2.0000"


def test_every_step_at_zero_seconds_and_only_the_end_line_when_the_interval_is_longer_than_the_run():
    out = io.StringIO()
    feed(Progress(every_s=0, out=out, err=io.StringIO()), Clock())
    assert len(out.getvalue().splitlines()) == 10  # steps 1..9, then the end line
    out = io.StringIO()
    feed(Progress(every_s=60, out=out, err=io.StringIO()), Clock())
    assert len(out.getvalue().splitlines()) == 1 and END.match(out.getvalue().strip())


def test_a_bar_only_on_a_terminal_and_lines_unless_the_bar_shares_stdouts_terminal():
    term = Terminal()  # stdout and stderr on one terminal: the bar, and no periodic lines
    feed(Progress(bar=True, every_s=0, out=term, err=term), Clock())
    text = term.getvalue()
    assert "\r" in text and "run:" in text  # tqdm draws
    assert not any(LINE.match(line.strip("\r")) for line in text.splitlines())
    assert END.search(text.splitlines()[-1].split("\r")[-1])  # the end line still prints

    out, err = io.StringIO(), Terminal()  # `mode train > log` on a terminal: the bar there, lines in the log
    feed(Progress(bar=True, every_s=0, out=out, err=err), Clock())
    assert "\r" in err.getvalue() and len(out.getvalue().splitlines()) == 10 and "\r" not in out.getvalue()

    out, err = Terminal(), Terminal()  # --no-progress on a terminal: lines, no bar
    feed(Progress(bar=False, every_s=0, out=out, err=err), Clock())
    assert err.getvalue() == "" and len(out.getvalue().splitlines()) == 10


def test_silent_and_bad_settings():
    out, err = io.StringIO(), io.StringIO()
    feed(Progress(bar=False, lines=False, every_s=0, out=out, err=err), Clock())
    assert out.getvalue() == err.getvalue() == ""
    assert Progress.of(False) == Progress(bar=False) and Progress.of(True) == Progress()
    with pytest.raises(TypeError, match="progress='yes': must be a bool or a mode.train.progress.Progress"):
        Progress.of("yes")
    with pytest.raises(ValueError, match="every_s=-1: must be finite and >= 0"):
        Progress(every_s=-1)
    with pytest.raises(TypeError, match="bar=1"):
        Progress(bar=1)


def test_a_run_stopped_early_and_a_run_with_nothing_left_to_train():
    out = io.StringIO()
    run = Progress(out=out, err=io.StringIO()).start("run", 10, initial=4)
    run.update(5, 2.5, 100.0)
    run.close()
    assert re.fullmatch(r"run: step 5/10 stopped after \S+  loss 2\.5000  100 tok/s\n", out.getvalue())
    out = io.StringIO()
    Progress(out=out, err=io.StringIO()).start("run", 10, initial=10).close()
    assert out.getvalue() == "run: step 10/10: nothing to train\n"


@pytest.mark.parametrize(
    "seconds, text", [(0.4, "0s"), (45, "45s"), (185, "3m05s"), (3720, "1h02m"), (float("inf"), "?")]
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def corpus() -> Corpus:
    text = np.frombuffer(b"def f(x):\n    return x + 1\n" * 120, dtype=np.uint8)
    return Corpus(train=text[:3000], val=text[3000:], source="synthetic")


def model_cfg(*layers: str) -> LMConfig:
    return LMConfig(seq_len=16, d_model=16, n_heads=2, d_hidden=32, layers=layers, capacity=0.25)


def train_cfg(steps: int) -> TrainConfig:
    return TrainConfig(steps=steps, batch_size=4, warmup_steps=1, eval_every=3, eval_batches=1, log_every=1)


def test_trainer_writes_the_lines_and_keeps_its_jsonl_log(tmp_path, capsys):
    out = io.StringIO()
    t = Trainer(
        model_cfg("dense", "mod"),
        train_cfg(steps=6),
        corpus(),
        tmp_path / "a",
        name="run",
        progress=Progress(every_s=0, out=out),
    )
    t.run()
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines[:-1]] == [f"{s}/6" for s in range(1, 6)]
    losses = {r["step"]: r["loss"] for r in t.history if "loss" in r}
    assert lines[2].split("  ")[1] == f"loss {losses[3]:.4f}"
    assert lines[-1].startswith("run: step 6/6 done in ")
    assert len((tmp_path / "a" / "log.jsonl").read_text().splitlines()) == len(t.history)  # the JSONL log stays

    Trainer(model_cfg("dense"), train_cfg(steps=2), corpus(), tmp_path / "b", name="quiet", progress=False).run()
    captured = capsys.readouterr()
    assert re.match(r"quiet: step 2/2 done in ", captured.out) and captured.err == ""  # progress=False: no bar


def test_mode_train_no_progress_still_logs_progress_lines(data, tmp_path, capsys):
    assert (
        main(
            [
                "train",
                "--preset",
                "quick",
                "--steps",
                "3",
                "--eval-every",
                "3",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "run"),
                "--device",
                "cpu",
                "--threads",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert re.search(r"^mode train: step 3/3 done in \S+  loss \d+\.\d{4}  [\d,]+ tok/s$", captured.out, re.M)
    assert "\r" not in captured.out + captured.err


def test_a_phase_longer_than_the_interval_prints_lines_with_eta_and_an_end_line():
    """``phase``: a conversion's skip costs, fits and calibration (issue 70: ``mode convert`` was silent for 20
    minutes). 5 s a layer, a line every 20 s: lines at layers 4 and 8 of 10, then the end line; None: silent."""
    out, clock = io.StringIO(), Clock()
    shown = phase(Progress(out=out, clock=clock), "skip costs (layer)", 10, "layers")
    for _ in range(10):
        clock.t += 5.0
        shown.advance()
    shown.close()
    assert out.getvalue().splitlines() == [
        "skip costs (layer): 4/10 layers (40%)  ETA 30s",
        "skip costs (layer): 8/10 layers (80%)  ETA 10s",
        "skip costs (layer): 10 layers done in 50s",
    ]
    quiet = phase(None, "calibration", 3, "batches")
    quiet.advance(3)
    quiet.close()  # nothing to check but that it writes nowhere: capsys in the conversion test below
