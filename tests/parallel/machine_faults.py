"""Cross-machine faults of a ``mode train`` job on two machines (tests/parallel/netns.py), shared by
tests/parallel/test_machines.py and benchmarks/parallel/bench_machines.py.

Every job: one torchrun agent per machine (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on machine 0,
``--max-restarts``), ``mode train --preset quick --dp 2 --ep 2 --steps STEPS --ckpt-every 2 --keep 2 --resume
auto`` over gloo, ranks 0-1 on machine 0 and 2-3 on machine 1. A fault fires once step ``AT`` is logged:

    kill        SIGKILL to every process of machine 1 (its kernel still closes their connections); machine 1's
                agent is started again
    power_off   machine 1's link cut, then every process on it killed: no connection is closed, the peers see
                silence; plugged back in after 1 s and its agent started again
    cut         machine 1's link down for ``cut_s`` seconds, nothing killed; torchrun restarts both sides
    rdzv_host   machine 0, which hosts the rendezvous, powered off; the surviving agent cannot re-form the job
                and exits; both agents started again with the rendezvous on machine 1 (the recovery procedure)
    save_sync   machine 1 powered off while a checkpoint is being written (rank 2 stopped inside the save of
    save_async  step 4, its shards written, ``latest`` not yet switched): the half-written save must never be
                used; ``--async-save`` for save_async
    netem       delay 50 ms and loss 1% on machine 1's link for the whole run: ``tc netem delay 50ms loss 1%``, or
                where the kernel has no sch_netem the same by ``netns.relay`` (``Network.impair``)

Measured: seconds from the fault to the first ``CollectiveError`` of a surviving rank (detected), and to the
restarted job's ``resuming at step N`` (resumed), the steps lost (the last step logged before the fault minus
the step resumed from), whether every tensor of the final checkpoint and every logged loss equal the
uninterrupted run's (``torch.equal``, ``==``)."""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import netns

STEPS, CKPT_EVERY, AT = 6, 2, 3
KINDS = ("kill", "power_off", "cut", "rdzv_host", "save_sync", "save_async", "netem")
_RESUMED = re.compile(r"mode train: resuming at step (\d+) of")
FAILED = "a collective failed"


@dataclass
class Outcome:
    fault: str
    ok: bool = False  # the job ended (status 0 on every agent) with the reference's final state
    detected_s: float | None = None
    resumed_s: float | None = None
    steps_lost: int | None = None
    resumed_from: int | None = None
    equal: bool = False
    wall_s: float = 0.0
    note: str = ""
    details: dict = field(default_factory=dict)

    def row(self) -> dict:
        return asdict(self)


def curve(out: Path) -> dict[int, tuple[float, float]]:
    """Step -> (loss, grad norm) from OUT/log.jsonl, the last record of each step (a step trained again after a
    restart replaces the first)."""
    rows = {}
    for line in (out / "log.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            rows[r["step"]] = (r["loss"], r["grad_norm"])
    return rows


@dataclass
class Reference:
    params: dict
    curve: dict
    wall_s: float
    step_s: float  # mean seconds per step (from the agent's log), for the slow-link cost
    link: str = "clean"  # or how the link was slowed: "tc netem" or "relay" (netns.Network.impair)


def clean_run(
    work: Path, data: Path, timeout_s: float, steps: int = STEPS, impair: bool = False, dp: int = 2, ep: int = 2
) -> Reference:
    """The uninterrupted job on two machines (with ``impair``: on a slow, lossy link); ``dp``, ``ep``: its mesh."""
    shutil.rmtree(work, ignore_errors=True)
    out = work / "out"
    with netns.Network(2) as net:
        link = net.impair(1, delay_ms=50, loss=0.01) if impair else "clean"
        train = netns.train_argv(out, data, steps, CKPT_EVERY, timeout_s, dp=dp, ep=ep)
        t0 = time.monotonic()
        agents = [netns.start_agent(net, i, train, work / "logs", nnodes=2, port=29400) for i in range(2)]
        for a in agents:
            a.proc.wait(timeout=600)
        wall = time.monotonic() - t0
        codes = [a.proc.returncode for a in agents]
        assert codes == [0, 0], (codes, agents[0].text()[-3000:])
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    times = [r["wall"] for r in records if "wall" in r and "loss" in r]
    step_s = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return Reference(netns.final_params(out), curve(out), wall, step_s, link)


def _first(agents, needle: str, since: float) -> float | None:
    """Seconds since ``since`` when ``needle`` first shows in any agent's log (polled), else None."""
    return next((time.monotonic() - since for a in agents if needle in a.text()), None)


def _finish(outcome: Outcome, out: Path, reference: Reference, agents, last_before: int, t_fault: float) -> Outcome:
    texts = "".join(a.text() for a in agents)
    m = _RESUMED.search(texts)
    outcome.resumed_from = int(m.group(1)) if m else None
    outcome.steps_lost = None if m is None else last_before - int(m.group(1))
    codes = [a.proc.returncode for a in agents]
    diff = netns.unequal(netns.final_params(out), reference.params) if (out / "ckpt").is_dir() else ["no ckpt"]
    outcome.equal = not diff and curve(out) == reference.curve
    outcome.ok = codes == [0] * len(agents) and outcome.equal
    outcome.details.update(codes=codes, unequal=diff[:5])
    if not outcome.ok:
        outcome.details["log_tail"] = [a.text()[-2000:] for a in agents]
    return outcome


def run_fault(
    kind: str,
    work: Path,
    data: Path,
    reference: Reference,
    timeout_s: float = 10,
    cut_s: float = 20,
    port: int = 29400,
    dp: int = 2,
    ep: int = 2,
) -> Outcome:
    """One job with fault ``kind`` (see the module's docstring) on a (``dp``, ``ep``) mesh, ``reference`` the
    uninterrupted job on the same mesh; the network is torn down whatever happens."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {', '.join(KINDS)}")
    shutil.rmtree(work, ignore_errors=True)
    out, logs = work / "out", work / "logs"
    outcome = Outcome(kind)
    t0 = time.monotonic()
    extra = ["--async-save"] if kind == "save_async" else []
    train = netns.train_argv(out, data, STEPS, CKPT_EVERY, timeout_s, extra, dp=dp, ep=ep)
    with netns.Network(2) as net:
        if kind == "netem":
            outcome.note = f"delay 50 ms, loss 1% on machine 1's link by {net.impair(1, delay_ms=50, loss=0.01)}"
        fault = "stopsave@2:4" if kind in ("save_sync", "save_async") else None
        restarts = 2 if kind == "cut" else 1
        agents = [
            netns.start_agent(net, i, train, logs, nnodes=2, port=port, restarts=restarts, fault=fault if i else None)
            for i in range(2)
        ]
        if kind == "netem":
            for a in agents:
                a.proc.wait(timeout=600)
            outcome.wall_s = time.monotonic() - t0
            return _finish(outcome, out, reference, agents, STEPS, t0)
        if kind in ("save_sync", "save_async"):
            marker = "mode fault: rank 2 stops (SIGSTOP) inside the save of step 4"
            assert netns.wait_for(lambda: marker in agents[1].text(), 180) is not None, agents[1].text()[-3000:]
        else:
            assert netns.wait_for(lambda: AT in netns.logged_steps(out), 180) is not None, agents[0].text()[-3000:]
        last_before = max(netns.logged_steps(out))
        t_fault = time.monotonic()
        victim = 0 if kind == "rdzv_host" else 1
        if kind == "kill":
            net.kill(1)
        elif kind == "cut":
            net.cut(1)
        else:  # power_off, rdzv_host, save_*
            net.power_off(victim)
        survivors = [agents[1 - victim]]
        # a surviving rank's CollectiveError (the collective timeout, or at once when a connection closes)
        detect = netns.wait_for(lambda: FAILED in survivors[0].text(), timeout_s + 60)
        outcome.detected_s = None if detect is None else time.monotonic() - t_fault
        if kind == "cut":
            netns.wait_for(lambda: False, max(0.0, cut_s - (time.monotonic() - t_fault)))
            net.restore(1)
        elif kind == "rdzv_host":
            # what torch does: the surviving agent loses the rendezvous store with machine 0; it gives up after
            # its rendezvous timeouts. The procedure: stop it (if it has not exited), restart both machines with
            # the rendezvous on the survivor.
            exited = netns.wait_for(lambda: agents[1].proc.poll() is not None, 30)
            outcome.details["survivor_agent"] = (
                f"exited with status {agents[1].proc.returncode} after {exited:.1f} s"
                if exited is not None
                else "still waiting for the rendezvous 30 s later: stopped (the procedure)"
            )
            net.kill(1)
            net.restore(0)
            agents = [
                netns.start_agent(net, i, train, logs, nnodes=2, port=port + 1, rdzv_host=1, run_id="job-r1", tag="b")
                for i in range(2)
            ]
        else:
            if kind != "kill":
                net.restore(1)
            agents = [agents[0], netns.start_agent(net, 1, train, logs, nnodes=2, port=port, tag="b")]
        resumed = netns.wait_for(lambda: _RESUMED.search("".join(a.text() for a in agents)) is not None, 240)
        outcome.resumed_s = None if resumed is None else time.monotonic() - t_fault
        for a in agents:
            try:
                a.proc.wait(timeout=300)
            except Exception:  # noqa: BLE001 - judged below by the status codes
                pass
        outcome.wall_s = time.monotonic() - t0
        return _finish(outcome, out, reference, agents, last_before, t_fault)
