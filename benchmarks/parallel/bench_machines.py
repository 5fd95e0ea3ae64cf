"""Training across machines that fail: ``mode train`` on two machines (Linux network namespaces on a bridge, one
torchrun agent each, c10d rendezvous, gloo), every cross-machine fault, each ending where the uninterrupted run
ends?

    sudo PYTHONPATH=. python benchmarks/parallel/bench_machines.py                  # ~15 min on 2 CPU cores
    sudo PYTHONPATH=. python benchmarks/parallel/bench_machines.py --repeats 1 --no-long-cut   # ~5 min

Needs root (network namespaces). The machines, the job and the faults are tests/parallel/netns.py and
tests/parallel/machine_faults.py: ``mode train --preset quick --dp 2 --ep 2 --steps 6 --ckpt-every 2 --keep 2
--resume auto --collective-timeout T`` (T = ``--timeout``, 10 s), ranks 0-1 on machine 0 and 2-3 on machine 1,
``--max-restarts 1`` (2 for a cut link). First the uninterrupted job; then ``--repeats`` rounds of kill, power_off,
cut (``--cut-s``, 20 s), save_sync, save_async and rdzv_host, then one cut of ``--long-cut-s`` (120 s) and the netem
link, ``--repeats`` times (delay 50 ms and loss 1% on machine 1's link: ``tc netem delay 50ms loss 1%``, or
where the kernel has no sch_netem the same in user space, tests/parallel/netns.py's ``relay``).

Then ``--ep4`` (power_off and cut) on a (dp, ep) = (1, 4) mesh against its own uninterrupted run: every
all-to-all crosses the machines.

Per fault: **detected** = seconds from the fault to the first ``CollectiveError`` of a surviving rank; **resumed** =
seconds from the fault to the restarted job's ``resuming at step N``; **steps lost** = the last step logged before the
fault minus N; **equal** = every tensor of the final checkpoint ``torch.equal`` to the uninterrupted run's, and
every step's loss and gradient norm ``==``. Prints the table and writes benchmarks/results/machines.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests" / "parallel"):  # run as a script from anywhere; the harness lives with the tests
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import machine_faults  # noqa: E402  # pyright: ignore[reportMissingImports] - tests/parallel, on sys.path above
import netns  # noqa: E402  # pyright: ignore[reportMissingImports]
import torch  # noqa: E402

from benchmarks.common import machine_info, print_table, write_json  # noqa: E402

ROUND = ("kill", "power_off", "cut", "save_sync", "save_async", "rdzv_host")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2, help="rounds of the six faults (default 2)")
    p.add_argument("--timeout", type=float, default=10.0, help="--collective-timeout of the job (default 10)")
    p.add_argument("--cut-s", type=float, default=20.0, help="seconds a cut link stays down (default 20)")
    p.add_argument("--long-cut-s", type=float, default=120.0, help="the long cut (default 120)")
    p.add_argument("--no-long-cut", action="store_true", help="skip the long cut")
    p.add_argument(
        "--ep4",
        type=lambda text: [k for k in text.split(",") if k],
        default=["power_off", "cut"],
        help="faults also run on a (1, 4) mesh, whose all-to-alls all cross machines (default power_off,cut; "
        "'' for none)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "machines.json"), help="JSON path")
    args = p.parse_args()
    reason = netns.unavailable()
    if reason:
        sys.exit(f"bench_machines: no network namespaces here: {reason}")
    netns.remove_stale()
    netem = netns.netem_unavailable()  # then Network.impair slows the link by its relay instead
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_machines_") as tmp:
        folder = Path(tmp)
        data = folder / "text.txt"
        data.write_text((ROOT / "mode" / "train" / "data.py").read_text() * 3)
        ref = machine_faults.clean_run(folder / "clean", data, args.timeout)
        print(f"uninterrupted: {ref.wall_s:.1f} s, {ref.step_s:.3f} s per step", flush=True)
        plan = [(kind, args.cut_s) for _ in range(args.repeats) for kind in ROUND]
        if not args.no_long_cut:
            plan.append(("cut", args.long_cut_s))
        for i, (kind, cut_s) in enumerate(plan):
            o = machine_faults.run_fault(kind, folder / f"f{i}", data, ref, timeout_s=args.timeout, cut_s=cut_s)
            row = o.row()
            row["fault"] = f"cut {cut_s:g} s" if kind == "cut" else kind
            rows.append(row)
            print(
                f"{row['fault']:12s} {'ok' if o.ok else 'FAILED'}: detected {o.detected_s}, resumed {o.resumed_s}, "
                f"lost {o.steps_lost}, equal {o.equal} ({o.wall_s:.1f} s) {o.details.get('survivor_agent', '')}",
                flush=True,
            )
        if args.ep4:  # every all-to-all spans both machines: (dp, ep) = (1, 4)
            ref4 = machine_faults.clean_run(folder / "clean4", data, args.timeout, dp=1, ep=4)
            print(f"uninterrupted (1, 4): {ref4.wall_s:.1f} s, {ref4.step_s:.3f} s per step", flush=True)
            for j, kind in enumerate(args.ep4):
                o = machine_faults.run_fault(
                    kind, folder / f"e{j}", data, ref4, timeout_s=args.timeout, cut_s=args.cut_s, dp=1, ep=4
                )
                row = o.row()
                row["fault"] = (f"cut {args.cut_s:g} s" if kind == "cut" else kind) + ", ep 4"
                rows.append(row)
                print(
                    f"{row['fault']:12s} {'ok' if o.ok else 'FAILED'}: detected {o.detected_s}, resumed "
                    f"{o.resumed_s}, lost {o.steps_lost}, equal {o.equal} ({o.wall_s:.1f} s)",
                    flush=True,
                )
        for _ in range(args.repeats):
            t0 = time.monotonic()
            slow = machine_faults.clean_run(folder / "netem", data, args.timeout, impair=True)
            equal = not netns.unequal(slow.params, ref.params) and slow.curve == ref.curve
            rows.append(
                dict(
                    fault="netem 50ms 1%",
                    ok=equal,
                    equal=equal,
                    steps_lost=0,
                    wall_s=time.monotonic() - t0,
                    step_s=slow.step_s,
                    clean_step_s=ref.step_s,
                    note=f"{slow.link}: {slow.step_s:.3f} s per step against {ref.step_s:.3f} on the clean link "
                    f"(x{slow.step_s / ref.step_s:.1f}); the whole job {slow.wall_s:.1f} s against {ref.wall_s:.1f}",
                )
            )
            print(f"netem        {'ok' if equal else 'FAILED'}: {rows[-1]['note']}", flush=True)
    print(
        f"\nmode train on 2 machines x 2 processes (network namespaces, c10d rendezvous, gloo), quick preset, "
        f"(dp, ep) = (2, 2), {machine_faults.STEPS} steps, a checkpoint every {machine_faults.CKPT_EVERY}, "
        f"--collective-timeout {args.timeout:g}; uninterrupted {ref.wall_s:.1f} s\n"
    )
    print_table(
        rows,
        [
            ("fault", "fault", ""),
            ("detected_s", "detected after s", ".1f"),
            ("resumed_s", "resumed after s", ".1f"),
            ("steps_lost", "steps lost", "d"),
            ("equal", "final state equal", ""),
            ("ok", "survived", ""),
        ],
    )
    run = [r for r in rows if r.get("ok") is not None]
    survived = sum(bool(r["ok"]) for r in run)
    print(f"\n{survived}/{len(run)} faults survived, bit-equal; {len({r['fault'] for r in run})} kinds")
    payload = dict(
        benchmark="bench_machines",
        machine=machine_info(torch.device("cpu")),
        command=" ".join(
            netns.train_argv(Path("OUT"), Path("DATA"), machine_faults.STEPS, machine_faults.CKPT_EVERY, args.timeout)
        ),
        launcher=(
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 2 "
            "--rdzv-backend c10d --rdzv-endpoint 192.0.2.1:29400 --rdzv-id job --rdzv-conf "
            "join_timeout=300,read_timeout=300,is_host=<1 on machine 0> --local-addr <the machine's address> "
            "--max-restarts 1 python ..."
        ),
        timeout_s=args.timeout,
        cut_s=args.cut_s,
        long_cut_s=None if args.no_long_cut else args.long_cut_s,
        reference=dict(wall_s=ref.wall_s, step_s=ref.step_s),
        netem=netem or "available",
        slow_link="tc netem" if netem is None else "netns.relay (no sch_netem in this kernel)",
        survived=survived,
        faults=len(run),
        rows=rows,
    )
    print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
