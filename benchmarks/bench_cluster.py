"""Lesson 12 on an emulated cluster (course/cluster.py, issue 46): the flat ring against the
hierarchical all-reduce on 2 nodes x 2 ranks, measured and predicted.

1. The node's own link, on an unshaped cluster: a ping-pong between the two ranks of a node (MPI's
   shared memory) fitted to alpha + n beta, and the bus bandwidth of an all-reduce inside each node
   with both nodes at work (nccl-tests' busbw: 2(P-1)/P S / t), which is what a collective gets from
   the node: the ranks also add and copy, and on this machine 4 ranks share its cores.
2. For each link setting, a cluster whose NICs are shaped to it (printed with the token bucket and the
   MTU), one launch that measures both links as the algorithms use them (all pairs bouncing at once,
   `link_sweep(all_pairs=True)`, fitted by `fit_link`), then per size the ring in rank order and the
   hierarchical all-reduce (lesson 12's reference), the best of 5 trials taking turns (`best_times`),
   against `two_level_cost` with the fitted links, and the bytes each rank's NIC sent (veth counters).
   Settings: a tenth of the node's all-reduce bus bandwidth (the target's setting), and a tenth of the
   ping-pong bandwidth, with a check of whether this machine can carry that: one pair of ranks
   bouncing 4 MiB across the nodes against two pairs at once (a ratio well above 1: the emulation runs
   out of cores, and the link is not what limits).
Targets (issue 46), printed as pass or MISS per size, never asserted: the hierarchical all-reduce >=
1.5x the ring; the cost model within 30% of each measurement. Where no cluster can be made (no root,
not Linux) it says why and stops. The load is printed before and after each launch: the 4 ranks share
this machine's cores, and any other load lands on the critical path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from minitorch.comm import run
from minitorch.parallel import (TWO_LEVEL, best_times, fit_link, hierarchical_allreduce, link_sweep, machine_load,
                                ring_allreduce, two_level_cost)

SWEEP = [4 ** k for k in range(0, 13)]  # 1 byte to 16 MiB
SIZES = [2 ** 14, 2 ** 16, 2 ** 18, 2 ** 20, 2 ** 22, 2 ** 24]
NODES, PPN = 2, 2


def node_links(comm):
    """Rank 0: the ping-pong inside node 0 (the other node idle), then the bus bandwidth of a ring
    all-reduce of 4 MiB and of 16 MiB inside each node, both nodes at once."""
    shm = link_sweep(comm, SWEEP, 10, peer=1)
    node = comm.group([PPN * (comm.rank // PPN) + i for i in range(PPN)])
    busbw = []
    for nbytes in (2 ** 22, 2 ** 24):
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 8)
        t = best_times(comm, [lambda: ring_allreduce(node, x)], 3, 3)[0]
        busbw.append(2 * (PPN - 1) / PPN * nbytes / t)
    return (shm, busbw) if comm.rank == 0 else None


def pairs_check(comm, nbytes):
    """Seconds of a 4 MiB ping-pong across the nodes by one pair (ranks 0 and 2), then by two at once."""
    x = np.zeros(nbytes, np.uint8)
    out = []
    for pairs in (1, 2):
        def op(active=comm.rank % PPN < pairs, peer=(comm.rank + PPN) % (NODES * PPN)):
            if active and comm.rank < PPN:
                comm.send(x, peer)
                comm.recv(peer)
            elif active:
                comm.send(comm.recv(peer), peer)
        out.append(best_times(comm, [op], 2, 3)[0])
    return out


def timings(comm, sizes, nics, reps, trials):
    """Rank 0: both links' one-way times (all pairs at once), the pair check, and per size (bytes, ring s,
    hierarchical s, ring NIC bytes, hierarchical NIC bytes)."""
    from course.cluster import read_nic_bytes

    inside = link_sweep(comm, SWEEP, 10, peer=1, all_pairs=True)  # both nodes' pairs at once, as the algorithms
    across = link_sweep(comm, SWEEP, 10, peer=2, all_pairs=True)  # use them; and both ranks' NICs at once
    check = pairs_check(comm, 2 ** 22)
    rows = []
    for nbytes in sizes:
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 8)
        ops = [lambda: ring_allreduce(comm, x), lambda: hierarchical_allreduce(comm, x, PPN)]
        t = best_times(comm, ops, reps, trials)
        sent = []
        for op in ops:
            comm.barrier()
            before = read_nic_bytes(nics) if comm.rank == 0 else None
            comm.barrier()
            op()
            comm.barrier()
            sent.append([a[0] - b[0] for a, b in zip(read_nic_bytes(nics), before)] if comm.rank == 0 else None)
        rows.append((nbytes, *t, *sent))
    return (inside, across, check, rows) if comm.rank == 0 else None


def measure(link_bits: float, why: str) -> list[tuple]:
    from course.cluster import EmulatedCluster

    with EmulatedCluster(NODES, PPN, link=f"{link_bits / 1e9:.2f}gbit") as cluster:
        print(f"\n== each NIC at {link_bits / 1e9:.2f} Gbit/s: {why}")
        print(cluster.describe())
        print(f"before the launch: {machine_load()}")
        inside, across, check, rows = run(timings, NODES * PPN, SIZES, cluster.nics(), 3, 5, engine="mpi",
                                          nodes=NODES, timeout=1200).results[0]
        print(f"after the launch: {machine_load()}")
    (a_in, b_in), (a_x, b_x) = fit_link(SWEEP, inside), fit_link(SWEEP, across)
    print(f"{'bytes':>9} {'inside us':>10} {'fit':>9} {'across us':>10} {'fit':>9}   (one way, all pairs at once)")
    for n, ti, tx in zip(SWEEP, inside, across):
        print(f"{n:>9} {ti * 1e6:>10.1f} {(a_in + n * b_in) * 1e6:>9.1f} {tx * 1e6:>10.1f} {(a_x + n * b_x) * 1e6:>9.1f}")
    print(f"fitted: inside a node alpha {a_in * 1e6:.1f} us, {1 / b_in / 1e9:.2f} GB/s; between nodes alpha "
          f"{a_x * 1e6:.1f} us, {1 / b_x / 1e9:.3f} GB/s ({b_x / b_in:.1f}x slower per byte)")
    print(f"this machine carries it? 4 MiB ping-pong across the nodes: one pair {check[0] * 1e3:.2f} ms, two pairs at "
          f"once {check[1] * 1e3:.2f} ms ({check[1] / check[0]:.2f}x; near 1: the link limits, not the cores)")
    print("targets (issue 46): hierarchical >= 1.5x the ring; the model within 30% of each measurement")
    print(f"{'bytes':>9} {'ring ms':>9} {'model':>8} {'err':>6} {'hier ms':>9} {'model':>8} {'err':>6} "
          f"{'speed-up':>9} {'model':>6}  targets")
    table = []
    for nbytes, t_ring, t_hier, nic_ring, nic_hier in rows:
        p_ring, p_hier = (two_level_cost(a, nbytes, NODES, PPN, a_in, b_in, a_x, b_x).time for a in TWO_LEVEL)
        e_ring, e_hier = p_ring / t_ring - 1, p_hier / t_hier - 1
        speed = t_ring / t_hier
        marks = (f"speed-up {'pass' if speed >= 1.5 else 'MISS'}, model "
                 f"{'pass' if max(abs(e_ring), abs(e_hier)) <= 0.3 else 'MISS'}")
        print(f"{nbytes:>9} {t_ring * 1e3:>9.3f} {p_ring * 1e3:>8.3f} {e_ring:>+6.0%} {t_hier * 1e3:>9.3f} "
              f"{p_hier * 1e3:>8.3f} {e_hier:>+6.0%} {speed:>8.2f}x {p_ring / p_hier:>5.2f}x  {marks}")
        table.append((nbytes, t_ring, p_ring, t_hier, p_hier))
    nbytes, *_, nic_ring, nic_hier = rows[-1]
    ring_x, hier_x = (two_level_cost(a, nbytes, NODES, PPN, a_in, b_in, a_x, b_x).bytes for a in TWO_LEVEL)
    print(f"bytes each rank's NIC sent in one all-reduce of {nbytes} bytes (veth counters): ring {nic_ring} (the "
          f"algorithm: {ring_x:.0f} from ranks 1 and 3, 0 from 0 and 2), hierarchical {nic_hier} (the algorithm: "
          f"{hier_x:.0f} from each)")
    return table


def main(out_dir: Path) -> None:
    from course.cluster import EmulatedCluster, cluster_status

    ok, why = cluster_status()
    if not ok:
        print(f"no emulated cluster here: {why}")
        return
    print(f"before: {machine_load()}")
    with EmulatedCluster(NODES, PPN, link=None) as cluster:
        print(cluster.describe())
        shm, busbw = run(node_links, NODES * PPN, engine="mpi", nodes=NODES, timeout=600).results[0]
    a_node, b_node = fit_link(SWEEP, shm)
    print(f"inside a node, ping-pong (2 ranks, the other node idle): alpha {a_node * 1e6:.1f} us, "
          f"{1 / b_node / 1e9:.2f} GB/s")
    print(f"inside a node, all-reduce bus bandwidth (both nodes at once): {busbw[0] / 1e9:.2f} GB/s at 4 MiB, "
          f"{busbw[1] / 1e9:.2f} GB/s at 16 MiB")
    tenth_bus = max(0.1e9, round(max(busbw) * 8 / 10 / 1e8) * 1e8)  # the better of the two: the harder setting
    tenth_pingpong = max(0.1e9, round(8 / b_node / 10 / 1e8) * 1e8)
    table = measure(tenth_bus, "a tenth of the node's all-reduce bus bandwidth")
    measure(tenth_pingpong, "a tenth of the node's ping-pong bandwidth")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = [r[0] for r in table]
    for (i, name), color in zip(enumerate(TWO_LEVEL), ("C0", "C2")):
        ax.loglog(sizes, [r[1 + 2 * i] for r in table], "o", color=color, label=f"{name} (measured)")
        ax.loglog(sizes, [r[2 + 2 * i] for r in table], "-", color=color, label=f"{name} (model)")
    ax.set(xlabel="bytes per rank", ylabel="seconds",
           title=f"2 nodes x 2 ranks, NICs at {tenth_bus / 1e9:.2f} Gbit/s (emulated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "cluster_allreduce.png"
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
