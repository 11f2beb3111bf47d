"""asap_comm in one screen: 4 PEs on this host move tensors with one-sided
puts, completion signals and mailboxes, with no barrier on the data path.

    python examples/primitives_demo.py [--world-size 4] [--iters 20000]

What it shows:
1. a ring: every PE put_signals a tensor into its right neighbour and waits
   for its left neighbour's (data visible before the signal, checked);
2. an all-to-one inbox: PEs 1..W-1 send tagged messages to PE 0's mailbox,
   which receives them zero-copy (per-producer order checked);
3. latency of the lowest-latency path (prepared put_signal + wait), one-way.
"""
import argparse
import statistics
import sys
import time

import torch

import asap_comm


def demo(comm, iters):
    rank, world = comm.rank, comm.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    out = {}

    # 1. ring of put_signal
    x = comm.zeros((1024,), torch.float32)
    sig = comm.signals(1)
    comm.put_signal(x, torch.full((1024,), float(rank)), right, sig, 0, 1)
    comm.signal_wait_until(sig, 0, "==", 1)
    out["ring_ok"] = bool((x == left).all())

    # 2. all-to-one mailbox
    box = comm.mailbox(slot_bytes=4096, num_slots=16)
    n_msgs = 200
    if rank != 0:
        for i in range(n_msgs):
            box.send(0, torch.full((rank * 8,), i, dtype=torch.int32), tag=i)
    else:
        last = {pe: -1 for pe in range(1, world)}
        ok = True
        for _ in range(n_msgs * (world - 1)):
            with box.recv() as m:
                ok &= m.tag == last[m.src] + 1 and m.tensor.numel() == m.src * 8 and bool((m.tensor == m.tag).all())
                last[m.src] = m.tag
        out["mailbox_ok"] = ok and all(v == n_msgs - 1 for v in last.values())
    comm.barrier()

    # 3. ping-pong latency between PE 0 and PE 1 (the others idle in a barrier)
    if rank < 2 and world >= 2:
        y = comm.zeros((1,), torch.float64)
        s = comm.signals(1)
        src = torch.ones(1, dtype=torch.float64)
        peer = 1 - rank
        put = comm.prepare_put_signal(y, src, peer, s, 0)
        wait = comm.prepare_signal_wait(s, 0, ">=")
        samples = []
        batch = 1000
        for b in range(iters // batch):
            t0 = time.perf_counter_ns()
            for i in range(b * batch + 1, (b + 1) * batch + 1):
                if rank == 0:
                    put(i)
                    wait(i)
                else:
                    wait(i)
                    put(i)
            samples.append((time.perf_counter_ns() - t0) / batch / 2 / 1000)
        out["one_way_us"] = samples[len(samples) // 5:]  # drop warm-up batches
    else:
        comm.zeros((1,), torch.float64)
        comm.signals(1)
    comm.barrier()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--iters", type=int, default=20000)
    args = p.parse_args(argv)
    if args.world_size < 2:
        p.error("--world-size must be >= 2")
    print(f"launching {args.world_size} PEs ...", file=sys.stderr, flush=True)
    t0 = time.time()
    res = asap_comm.launch(demo, args.world_size, max(args.iters, 2000), timeout=300)
    print(f"done in {time.time() - t0:.1f} s (process start and torch import included)\n", file=sys.stderr)
    ring = all(r["ring_ok"] for r in res)
    lat = res[0]["one_way_us"]
    rows = [("put_signal ring, 4 KiB per PE", "PASS" if ring else "FAIL"),
            (f"mailbox all-to-one, {200 * (args.world_size - 1)} messages", "PASS" if res[0]["mailbox_ok"] else "FAIL"),
            ("put_signal+wait one-way latency (prepared), median",
             f"{statistics.median(lat):.3f} us (p10 {sorted(lat)[len(lat) // 10]:.3f}, "
             f"p90 {sorted(lat)[len(lat) * 9 // 10]:.3f})")]
    w = max(len(r[0]) for r in rows)
    for name, val in rows:
        print(f"{name:<{w}}  {val}")
    return 0 if ring and res[0]["mailbox_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
