"""Machines on a network of their own, on one host: Linux network namespaces joined by veth pairs to a bridge,
for the cross-machine fault tests (tests/parallel/test_machines.py) and benchmarks/parallel/bench_machines.py.

    with Network(2) as net:                      # machines 192.0.2.1 and 192.0.2.2 (TEST-NET-1), loopback up
        p = net.start(0, ["python", "-c", "..."])  # a process on machine 0 (``ip netns exec``), tracked
        net.cut(1); net.restore(1)               # machine 1's cable out of the switch, and back
        net.impair(1, delay_ms=50, loss=0.01)    # tc netem on machine 1's link, or the relay (no sch_netem)
        net.kill(1)                              # SIGKILL every process started on machine 1
        net.power_off(1)                         # cut, then kill: gone without closing a connection
    # teardown: every process killed, every link, the bridge and the namespaces deleted, also after a failure

Layout: machine ``i`` is namespace ``mode<pid>x<k>m<i>`` with interface ``eth0`` (address ``192.0.2.<i+1>/24``),
whose veth peer ``md<pid>x<k>h<i>`` is a port of the bridge ``md<pid>x<k>br`` in the caller's namespace; the
caller's namespace gets no address on it and answers no ARP request on it (``arp_ignore=8``: the host may use a
192.0.2.x address itself), so nothing outside the machines reaches them and they reach nothing else. Names carry the
creating process's pid (and a counter), so parallel pytest workers never clash, and ``remove_stale`` deletes
what a killed run left (namespaces and links whose pid is no longer alive).

Processes: ``start`` runs each command in a session of its own (its process group), so ``kill`` reaches the
torchrun agent and every worker it forked; ``ip netns pids`` catches anything else still in the namespace.

``job`` (below) starts one torchrun agent per machine for ``mode train``: the c10d rendezvous on one machine's
address, ``GLOO_SOCKET_IFNAME=eth0``, ``--local-addr`` the machine's address (torchrun would otherwise publish
the host name, which resolves to the host, not to the machine) and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(docs/distributed.md).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pools import torchrun_env

SUBNET = "192.0.2"  # TEST-NET-1 (RFC 5737): never routed, never anyone's real address
IFNAME = "eth0"  # every machine's interface, inside its namespace
_count = itertools.count()
_NAME = re.compile(r"^(?:mode|md)(\d+)x\d+")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (no ``ip``, no root or CAP_NET_ADMIN), found by trying; None if they can."""
    name = f"mode{os.getpid()}probe"
    try:
        made = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "no 'ip' command (iproute2) on this machine"
    if made.returncode != 0:
        return f"'ip netns add' failed ({made.stderr.strip()}): needs root or CAP_NET_ADMIN and CAP_SYS_ADMIN"
    try:
        link = _ip("link", "add", f"md{os.getpid()}pb", "type", "bridge", check=False)
        if link.returncode != 0:
            return f"'ip link add ... type bridge' failed: {link.stderr.strip()}"
        _ip("link", "del", f"md{os.getpid()}pb", check=False)
    finally:
        _ip("netns", "del", name, check=False)
    return None


def netem_unavailable() -> str | None:
    """Why ``tc qdisc ... netem`` cannot be used here (a kernel without sch_netem), found by trying; None if it can."""
    name = f"mode{os.getpid()}netem"
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        tc = subprocess.run(
            ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return None if tc.returncode == 0 else f"tc netem: {tc.stderr.strip()} (this kernel has no sch_netem)"
    except FileNotFoundError:
        return "no 'tc' command"
    finally:
        _ip("netns", "del", name, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces and links a run of this harness left behind when it was killed (its pid is gone)."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = _NAME.match(ns)
        if m and not _alive(int(m.group(1))):
            _kill_pids(_netns_pids(ns))
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        dev = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = _NAME.match(dev)
        if m and not _alive(int(m.group(1))):
            _ip("link", "del", dev, check=False)
            removed.append(dev)
    return removed


def _netns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def _kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Machine:
    index: int
    ns: str  # the namespace
    host_link: str  # the bridge's end of its cable
    addr: str
    procs: list[subprocess.Popen] = field(default_factory=list)


class Network:
    """``n`` machines on one bridge (a context manager; see the module's docstring)."""

    def __init__(self, n: int = 2):
        if not 1 <= n <= 250:
            raise ValueError(f"n={n}: must be 1 .. 250 machines")
        tag = f"{os.getpid()}x{next(_count)}"
        self.bridge = f"md{tag}br"
        self.machines = [Machine(i, f"mode{tag}m{i}", f"md{tag}h{i}", f"{SUBNET}.{i + 1}") for i in range(n)]
        assert all(len(name) <= 15 for name in (self.bridge, *(m.host_link for m in self.machines))), tag
        self.impaired: dict[int, str] = {}  # machine -> "tc netem" or "relay"
        self.relays: dict[int, tuple[subprocess.Popen, str]] = {}  # machine -> (relay process, its bridge port)

    # -------------------------------------------------------------------------------------------- set-up

    def __enter__(self) -> Network:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        # The caller's namespace must never answer for a machine: a host whose own address is in 192.0.2.0/24
        # (this sandbox's is 192.0.2.2) would otherwise answer the machines' ARP requests for it on the bridge
        Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/arp_ignore").write_text("8\n")
        _ip("link", "set", self.bridge, "up")
        for m in self.machines:
            _ip("netns", "add", m.ns)
            _ip("-n", m.ns, "link", "set", "lo", "up")  # a machine's own processes talk over loopback too
            inner = f"{m.host_link[:-2]}i{m.index}"  # temporary name of the machine's end, then eth0
            _ip("link", "add", m.host_link, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", m.ns)
            _ip("-n", m.ns, "link", "set", inner, "name", IFNAME)
            _ip("-n", m.ns, "addr", "add", f"{m.addr}/24", "dev", IFNAME)
            _ip("-n", m.ns, "link", "set", IFNAME, "up")
            _ip("link", "set", m.host_link, "master", self.bridge)
            _ip("link", "set", m.host_link, "up")
        self.wait_links()

    def wait_links(self, timeout_s: float = 20) -> None:
        """Wait until every machine's interface is up, every switch port forwards (a veth's carrier and a bridge
        port come up a moment after ``ip link set ... up``) and every machine answers every other; RuntimeError
        after ``timeout_s``."""

        def ready(m: Machine) -> bool:
            state = Path(f"/sys/class/net/{m.host_link}/brport/state")
            port = not state.exists() or state.read_text().strip() == "3"  # 3: BR_STATE_FORWARDING
            inner = _ip("-n", m.ns, "-o", "link", "show", IFNAME, check=False).stdout
            return port and "state UP" in inner and "NO-CARRIER" not in inner

        if wait_for(lambda: all(ready(m) for m in self.machines), timeout_s, every_s=0.05) is None:
            raise RuntimeError(f"the machines' links did not come up within {timeout_s:g} s")
        # ... and every machine connects to every other until each answers (a refusal counts)
        code = (
            "import socket,sys,time\n"
            f"todo=set(sys.argv[1:]); end=time.monotonic()+{timeout_s}\n"
            "while todo and time.monotonic()<end:\n"
            "  for a in sorted(todo):\n"
            "    try: socket.create_connection((a, 9), 0.3)\n"
            "    except ConnectionRefusedError: todo.discard(a)\n"
            "    except OSError: pass\n"
            "sys.exit(1 if todo else 0)\n"
        )
        for m in self.machines:
            others = [o.addr for o in self.machines if o is not m]
            if others and self.run(m.index, [sys.executable, "-c", code, *others], timeout=timeout_s + 30).returncode:
                raise RuntimeError(f"machine {m.index} could not reach the others within {timeout_s:g} s")

    def close(self) -> None:
        """Kill every process on every machine, then delete the links, the bridge and the namespaces; never raises."""
        for m in self.machines:
            try:
                self.kill(m.index)
            except Exception:  # noqa: BLE001 - teardown goes on
                pass
        for i in list(self.relays):
            try:
                self.clear(i)
            except Exception:  # noqa: BLE001 - teardown goes on
                pass
        for m in self.machines:
            _ip("link", "del", m.host_link, check=False)  # deletes its peer too
            _ip("netns", "del", m.ns, check=False)
        _ip("link", "del", self.bridge, check=False)

    # -------------------------------------------------------------------------------------------- machines

    def __getitem__(self, i: int) -> Machine:
        return self.machines[i]

    def exec_args(self, i: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.machines[i].ns, *argv]

    def start(self, i: int, argv: Sequence[str], **popen) -> subprocess.Popen:
        """Start ``argv`` on machine ``i``, in a session (process group) of its own; tracked for ``kill``."""
        p = subprocess.Popen(self.exec_args(i, argv), start_new_session=True, **popen)
        self.machines[i].procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``argv`` on machine ``i`` to its end (e.g. ``ping``, ``tc``)."""
        return subprocess.run(self.exec_args(i, argv), capture_output=True, text=True, timeout=timeout)

    def kill(self, i: int) -> None:
        """SIGKILL every process started on machine ``i`` (their whole process groups) and anything else still
        in its namespace; waits for the started ones."""
        m = self.machines[i]
        for p in m.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _kill_pids(_netns_pids(m.ns))
        for p in m.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        m.procs = [p for p in m.procs if p.poll() is None]

    def cut(self, i: int) -> None:
        """Pull machine ``i``'s cable out of the switch: its link goes down, its sockets stay open (no FIN, no
        RST reaches anyone): the peers see silence."""
        _ip("link", "set", self.machines[i].host_link, "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.machines[i].host_link, "up")

    def power_off(self, i: int) -> None:
        """Machine ``i`` dies at once: its link is cut first, so no connection is closed in an orderly way (a
        kill alone lets the kernel send FINs for the dead processes), then every process on it is killed.
        ``restore(i)`` plugs the machine back in (with nothing running on it)."""
        self.cut(i)
        self.kill(i)

    def impair(self, i: int, delay_ms: float = 50, loss: float = 0.01, seed: int = 0) -> str:
        """Delay and drop what machine ``i`` sends and receives: ``tc qdisc add dev eth0 root netem delay <ms>ms
        loss <pct>%`` on its interface and on its switch port; where the kernel has no netem
        (``netem_unavailable``), the same by ``relay``: machine ``i``'s switch port leaves the bridge and a
        process of this module forwards its frames to and from a new port, each held ``delay_ms`` and dropped with
        probability ``loss`` (a seeded draw). Returns how ("tc netem" or "relay")."""
        if netem_unavailable() is None:
            spec = ["netem", "delay", f"{delay_ms:g}ms", "loss", f"{loss * 100:g}%"]
            m = self.machines[i]
            for argv in (
                self.exec_args(i, ["tc", "qdisc", "add", "dev", IFNAME, "root", *spec]),
                ["tc", "qdisc", "add", "dev", m.host_link, "root", *spec],
            ):
                r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
                if r.returncode != 0:
                    raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
            self.impaired[i] = "tc netem"
            return "tc netem"
        m = self.machines[i]
        port, inner = f"{m.host_link[:-2]}r{i}", f"{m.host_link[:-2]}q{i}"
        _ip("link", "add", port, "type", "veth", "peer", "name", inner)
        _ip("link", "set", port, "master", self.bridge)
        for dev in (port, inner):
            _ip("link", "set", dev, "up")
        relay = subprocess.Popen(
            [sys.executable, __file__, "relay", m.host_link, inner, str(delay_ms / 1000), str(loss), str(seed)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.relays[i] = (relay, port)
        assert relay.stdout is not None
        ready = relay.stdout.readline()
        if "ready" not in ready:
            raise RuntimeError(f"the relay for machine {i} did not start: {ready!r}")
        _ip("link", "set", m.host_link, "nomaster")  # from now on machine i's frames pass the relay
        self.impaired[i] = "relay"
        return "relay"

    def clear(self, i: int) -> None:
        """Undo ``impair`` on machine ``i``."""
        how = self.impaired.pop(i, None)
        m = self.machines[i]
        if how == "tc netem":
            subprocess.run(self.exec_args(i, ["tc", "qdisc", "del", "dev", IFNAME, "root"]), capture_output=True)
            subprocess.run(["tc", "qdisc", "del", "dev", m.host_link, "root"], capture_output=True)
        elif i in self.relays:
            _ip("link", "set", m.host_link, "master", self.bridge, check=False)
            relay, port = self.relays.pop(i)
            relay.kill()
            relay.wait(timeout=30)
            _ip("link", "del", port, check=False)

    def reachable(self, src: int, dst: int, port: int = 9, timeout_s: float = 2.0) -> bool:
        """Whether machine ``src`` gets an answer from machine ``dst`` (a TCP connect: refused counts as an answer)."""
        code = (
            "import socket,sys\n"
            f"s=socket.socket(); s.settimeout({timeout_s})\n"
            f"try: s.connect(('{self.machines[dst].addr}', {port}))\n"
            "except ConnectionRefusedError: sys.exit(0)\n"
            "except OSError: sys.exit(1)\n"
        )
        return self.run(src, [sys.executable, "-c", code], timeout=timeout_s + 30).returncode == 0


# ------------------------------------------------------------------------------------------------ mode train jobs


@dataclass
class Agent:
    """One machine's torchrun agent: its process and its log file (stdout and stderr together)."""

    machine: int
    proc: subprocess.Popen
    log: Path
    started: float

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def train_argv(
    out: Path,
    data: Path,
    steps: int,
    ckpt_every: int,
    timeout_s: float,
    extra: Sequence[str] = (),
    dp: int = 2,
    ep: int = 2,
) -> list[str]:
    """``mode train`` on a (dp, ep) mesh of the quick preset: the command every agent runs."""
    return [
        "-m",
        "mode",
        "train",
        "--preset",
        "quick",
        "--dp",
        str(dp),
        "--ep",
        str(ep),
        "--steps",
        str(steps),
        "--ckpt-every",
        str(ckpt_every),
        "--keep",
        "2",
        "--eval-every",
        "1000",
        "--log-every",
        "1",
        "--data",
        str(data),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--collective-timeout",
        f"{timeout_s:g}",
        "--no-progress",
        "--resume",
        "auto",
        "--out",
        str(out),
        *extra,
    ]


def start_agent(
    net: Network,
    machine: int,
    train: Sequence[str],
    logs: Path,
    *,
    nnodes: int,
    nproc: int = 2,
    rdzv_host: int = 0,
    port: int = 29400,
    restarts: int = 1,
    run_id: str = "job",
    fault: str | None = None,
    rdzv_timeout_s: float = 300,
    tag: str = "",
) -> Agent:
    """Start machine ``machine``'s ``torchrun --nnodes N --nproc-per-node 2 --rdzv-backend c10d`` agent running
    ``python <train>``; its output goes to ``logs/m<machine><tag>.log``."""
    m = net[machine]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{net[rdzv_host].addr}:{port}",
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        # is_host: torchrun hosts the rendezvous store where the endpoint names its host name; a machine here
        # shares the host's name, so say which one hosts it
        f"join_timeout={rdzv_timeout_s:g},read_timeout={rdzv_timeout_s:g},is_host={int(machine == rdzv_host)}",
        "--local-addr",
        m.addr,
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        "--shutdown-timeout",
        "5",
        *train,
    ]
    env = torchrun_env(
        GLOO_SOCKET_IFNAME=IFNAME,
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    if fault:
        env["MODE_TEST_FAULT"] = fault
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"m{machine}{tag}.log"
    with open(log, "ab") as f:
        proc = net.start(machine, argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    return Agent(machine, proc, log, time.monotonic())


def wait_for(predicate, timeout_s: float, every_s: float = 0.1) -> float | None:
    """Poll ``predicate()`` until true; the seconds it took, or None after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(every_s)
    return None


def logged_steps(out: Path) -> list[int]:
    """Steps rank 0 logged to OUT/log.jsonl so far (a step trained twice appears twice)."""
    import json

    path = out / "log.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line being written
        if "loss" in row:
            steps.append(row["step"])
    return steps


def final_params(out: Path) -> dict:
    """Every model tensor of OUT's newest complete sharded checkpoint (read in this process, no group)."""
    from mode.train.checkpoint import load_checkpoint

    return load_checkpoint(out / "ckpt")["model"]


def unequal(params: dict, reference: dict) -> list[str]:
    """Names of the tensors that differ from the reference (bit for bit, ``torch.equal``); [] when all equal."""
    import torch

    if params.keys() != reference.keys():
        return sorted(set(params) ^ set(reference))
    return [k for k in params if not torch.equal(params[k], reference[k])]


# ------------------------------------------------------------------------------------------------ the relay

SOL_PACKET, PACKET_VNET_HDR, PACKET_OUTGOING, ETH_P_ALL = 263, 15, 4, 0x0003  # <linux/if_packet.h>


def relay(a: str, b: str, delay_s: float, loss: float, seed: int) -> None:
    """Forward every frame between interfaces ``a`` and ``b`` (raw ``AF_PACKET`` sockets), each held ``delay_s``
    seconds (in order) and dropped with probability ``loss``: ``tc netem`` in user space, for kernels without
    sch_netem. The sockets carry a virtio-net header (``PACKET_VNET_HDR``), so a TCP segment offloaded as one
    64 KiB frame with its checksum still to fill in passes unchanged; a drop drops that whole frame."""
    import heapq
    import random
    import select
    import socket

    def open_(dev: str) -> socket.socket:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        s.bind((dev, 0))
        s.setblocking(False)
        return s

    sa, sb = open_(a), open_(b)
    other = {sa: sb, sb: sa}
    rng = random.Random(seed)
    queue: list[tuple[float, int, socket.socket, bytes]] = []
    seq = 0
    print("ready", flush=True)
    while True:
        wait = max(0.0, queue[0][0] - time.monotonic()) if queue else 1.0
        readable, _, _ = select.select([sa, sb], [], [], wait)
        now = time.monotonic()
        for s in readable:
            while True:
                try:
                    frame, addr = s.recvfrom(1 << 17)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING or rng.random() < loss:  # our own sends; the lost frames
                    continue
                heapq.heappush(queue, (now + delay_s, seq, other[s], frame))
                seq += 1
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, frame = heapq.heappop(queue)
            try:
                out.send(frame)
            except OSError:
                pass  # a link down: the frame is lost, as on a wire


if __name__ == "__main__" and sys.argv[1:2] == ["relay"]:
    relay(sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
