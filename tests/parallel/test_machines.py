"""``mode train`` on two machines (network namespaces joined by a bridge, tests/parallel/netns.py), one torchrun
agent each, the c10d rendezvous on machine 0: a machine powered off in mid-step and a cut link both end in the
uninterrupted run's final state, bit for bit, and the survivors notice within the collective timeout.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to make namespaces: skipped with the reason otherwise. The faults
and the measurements are tests/parallel/machine_faults.py; every fault, repeated, is
benchmarks/parallel/bench_machines.py (docs/distributed.md, "Across machines")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mode.train.data

netns = pytest.importorskip("netns")  # tests/parallel/netns.py (this folder is on sys.path under pytest)
machine_faults = pytest.importorskip("machine_faults")

TIMEOUT_S = 10.0  # --collective-timeout of every job here
SLACK_S = 30.0  # the bound: a fault is noticed within the timeout + 30 s

pytestmark = pytest.mark.cpu_only("gloo across network namespaces")


@pytest.fixture(scope="module")
def rights() -> None:
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    netns.remove_stale()  # what a killed earlier run left


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(Path(mode.train.data.__file__).read_text() * 3)
    return path


@pytest.fixture(scope="module")
def reference(rights, data, tmp_path_factory):
    """The uninterrupted two-machine job."""
    ref = machine_faults.clean_run(tmp_path_factory.mktemp("clean"), data, TIMEOUT_S)
    assert sorted(ref.curve) == list(range(1, machine_faults.STEPS + 1))
    return ref


def _names() -> str:
    return (
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        + subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    )


def _connect_s(net, src: int, dst: int) -> float:
    """Seconds machine ``src`` takes to get machine ``dst``'s answer to a TCP connect (a refusal)."""
    code = (
        "import socket,time\nt=time.monotonic()\n"
        f"try: socket.create_connection(('{net[dst].addr}', 9), 5)\n"
        "except ConnectionRefusedError: print(time.monotonic()-t)\n"
    )
    return float(net.run(src, [sys.executable, "-c", code]).stdout)


def test_three_machines_cut_slowed_and_always_torn_down(rights):
    """The harness itself: three machines reach each other; a cut link isolates one, restore joins it again; a
    slowed link delays a round trip by 2 x 50 ms; after an error inside the block no namespace, link or process
    of the network is left."""
    procs = []
    with pytest.raises(RuntimeError, match="a failing test"):
        with netns.Network(3) as net:
            names = [m.ns for m in net.machines] + [net.bridge] + [m.host_link for m in net.machines]
            assert all(net.reachable(i, j) for i in range(3) for j in range(3) if i != j)
            procs = [net.start(i, ["sleep", "600"]) for i in range(3)]
            net.cut(2)
            assert not net.reachable(0, 2, timeout_s=1) and not net.reachable(2, 1, timeout_s=1)
            assert net.reachable(0, 1)
            net.restore(2)
            assert netns.wait_for(lambda: net.reachable(0, 2), 10) is not None
            assert _connect_s(net, 1, 0) < 0.05
            net.impair(1, delay_ms=50, loss=0.0)
            assert _connect_s(net, 1, 0) >= 0.1  # the SYN and its answer each wait 50 ms on machine 1's link
            net.clear(1)
            raise RuntimeError("a failing test")
    assert all(p.poll() is not None for p in procs)
    left = _names()
    assert not any(name in left for name in names), left


def _check(outcome, resumed_from: int) -> None:
    assert outcome.ok, outcome.details
    assert outcome.equal  # every tensor of the final checkpoint and every logged loss and grad norm
    assert outcome.detected_s is not None and outcome.detected_s <= TIMEOUT_S + SLACK_S, outcome.detected_s
    assert outcome.resumed_from == resumed_from  # the newest complete checkpoint


def test_a_machine_powered_off_mid_step_rejoins_and_ends_bit_equal(reference, data, tmp_path):
    # machine 1's link cut and every process on it SIGKILLed after step 3: no FIN reaches machine 0, whose
    # ranks fail at the collective timeout; machine 1 comes back and the job resumes from step 2's checkpoint
    outcome = machine_faults.run_fault("power_off", tmp_path, data, reference, timeout_s=TIMEOUT_S)
    _check(outcome, resumed_from=2)
    assert outcome.detected_s >= TIMEOUT_S - 1  # silence: only the timeout can tell
    assert outcome.steps_lost == 1


def test_a_link_cut_in_an_all_to_all_restarts_and_ends_bit_equal(reference, data, tmp_path):
    # machine 1's link down for 12 s (longer than the timeout) with nothing killed: both sides fail at the
    # timeout, both agents re-form the job when the link is back, and it resumes
    outcome = machine_faults.run_fault("cut", tmp_path, data, reference, timeout_s=TIMEOUT_S, cut_s=12)
    _check(outcome, resumed_from=2)
