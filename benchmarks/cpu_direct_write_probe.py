"""Where a CPU refit that writes straight into the consumers' parameters can go, measured
without the library (the CPU half of issue 28's design, before building it).

    python3 benchmarks/cpu_direct_write_probe.py [--hidden 1024] [--consumers 1 2] [--repeats 7]

Each consumer process keeps its parameters (a Llama-shaped set: ``--layers`` layers of
``--hidden``, float32) in one POSIX shared-memory segment that it creates, fills and
exports once (its name and every tensor's offset). The producer (this process) maps each
consumer's segment once. Per push, in these ways (median of ``--repeats``, ms, wall clock
from the first byte to every consumer's reply):

- ``memcpy_limit``: this process copies its parameters into a private buffer of the same
  layout, once per consumer: the bytes a push must write, at memcpy's speed;
- ``direct_write``: the producer copies each of its tensors straight into every
  consumer's parameter (``Tensor.copy_``, torch's intra-op threads), then sends each
  consumer the push's sequence number over a pipe; a consumer answers once it has seen
  it (one message each way per consumer per push: the O(1) control of the design);
- ``staged``: today's shape: the producer packs buckets of ``--bucket-mib`` into two
  shared slots, each consumer copies each bucket out into its parameters and answers
  per bucket (a request and an ack per consumer per bucket): every byte copied twice.

The ratio ``x limit`` is memcpy_limit over the row: 1.0 means the push costs one memcpy
of the bytes it writes. One JSON object is printed last (and written to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch


def shapes(hidden: int, layers: int, vocab: int) -> list[tuple[int, ...]]:
    inter = int(hidden * 2.6875)
    out: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        out += [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter)]
        out += [(hidden,), (hidden,)]
    return [*out, (hidden,), (vocab, hidden)]


def layout(sizes: list[tuple[int, ...]]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for s in sizes:
        offsets.append(at)
        n = 4
        for d in s:
            n *= d
        at += (n + 63) // 64 * 64
    return offsets, at


def views(buf: Any, sizes: list[tuple[int, ...]], offsets: list[int]) -> list[torch.Tensor]:
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    out = []
    for s, o in zip(sizes, offsets, strict=True):
        n = 4
        for d in s:
            n *= d
        out.append(flat[o : o + n].view(torch.float32).view(s))
    return out


def consumer(conn: Connection, sizes: list[tuple[int, ...]], bucket_bytes: int) -> None:
    offsets, total = layout(sizes)
    segment = SharedMemory(create=True, size=total)
    try:
        params = views(segment.buf, sizes, offsets)
        for p in params:
            p.zero_()  # resident before the first push
        conn.send(segment.name)
        slots: list[SharedMemory] = []
        while True:
            message = conn.recv()
            if message[0] == "stop":
                break
            if message[0] == "push":  # direct write: the producer wrote; just answer
                conn.send(message[1])
            elif message[0] == "slots":
                slots = [SharedMemory(name=n) for n in message[1]]
                conn.send("ok")
            elif message[0] == "bucket":  # staged: copy the bucket's tensors out
                _, slot, items = message
                src = torch.frombuffer(slots[slot].buf, dtype=torch.uint8)
                for index, at, n in items:
                    params[index].view(-1).view(torch.uint8).copy_(src[at : at + n])
                conn.send(("ack", slot))
        del params
        for s in slots:
            s.close()
    finally:
        segment.close()
        segment.unlink()


def timed(fn: Any, repeats: int) -> list[float]:
    fn()  # warm-up: page tables of fresh mappings
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def buckets_of(ours: list[torch.Tensor], slot_bytes: int) -> list[list[tuple[int, int, int]]]:
    """``(tensor index, offset, bytes)`` per bucket, tensors packed in order into slots."""
    buckets: list[list[tuple[int, int, int]]] = [[]]
    at = 0
    for index, t in enumerate(ours):
        if at + t.nbytes > slot_bytes and buckets[-1]:
            buckets.append([])
            at = 0
        buckets[-1].append((index, at, t.nbytes))
        at += (t.nbytes + 63) // 64 * 64
    return buckets


def measure(
    ctx: Any,
    count: int,
    sizes: list[tuple[int, ...]],
    offsets: list[int],
    ours: list[torch.Tensor],
    args: argparse.Namespace,
) -> dict[str, list[float]]:
    """Every row's times (ms) with ``count`` consumer processes."""
    pipes: list[Connection] = []
    procs = []
    segments: list[SharedMemory] = []
    slots: list[SharedMemory] = []
    # A slot holds at least the largest tensor (this probe does not split tensors).
    slot_bytes = max(args.bucket_mib << 20, max(t.nbytes for t in ours))
    for _ in range(count):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=consumer, args=(there, sizes, slot_bytes))
        proc.start()
        pipes.append(here)
        procs.append(proc)
    try:
        targets = []
        for pipe in pipes:
            segments.append(SharedMemory(name=pipe.recv()))
            targets.append(views(segments[-1].buf, sizes, offsets))
        private = [[torch.zeros_like(t) for t in ours] for _ in range(count)]  # resident
        slots = [SharedMemory(create=True, size=slot_bytes) for _ in range(2)]
        for pipe in pipes:
            pipe.send(("slots", [s.name for s in slots]))
            assert pipe.recv() == "ok"
        slot_views = [torch.frombuffer(s.buf, dtype=torch.uint8) for s in slots]
        buckets = buckets_of(ours, slot_bytes)
        sequence = [0]

        def limit() -> None:
            for dst in private:
                for d, s in zip(dst, ours, strict=True):
                    d.copy_(s)

        def direct() -> None:
            sequence[0] += 1
            for dst in targets:
                for d, s in zip(dst, ours, strict=True):
                    d.copy_(s)
            for pipe in pipes:
                pipe.send(("push", sequence[0]))
            for pipe in pipes:
                assert pipe.recv() == sequence[0]

        def staged() -> None:
            waiting = [0, 0]
            for k, items in enumerate(buckets):
                slot = k % 2
                for _ in range(waiting[slot]):  # the slot's previous bucket read by all
                    for pipe in pipes:
                        pipe.recv()
                for index, off, n in items:
                    slot_views[slot][off : off + n].copy_(ours[index].view(-1).view(torch.uint8))
                for pipe in pipes:
                    pipe.send(("bucket", slot, items))
                waiting[slot] = 1
            for slot in (0, 1):
                for _ in range(waiting[slot]):
                    for pipe in pipes:
                        pipe.recv()

        out = {
            "memcpy_limit": timed(limit, args.repeats),
            "direct_write": timed(direct, args.repeats),
            "staged": timed(staged, args.repeats),
        }
        for d, s in zip(targets[0], ours, strict=True):  # the last push landed
            assert torch.equal(d, s)
        slot_views.clear()  # drop the views before the segments close
        targets.clear()
        return out
    finally:
        for pipe in pipes:
            pipe.send(("stop",))
        for proc in procs:
            proc.join(30)
        for segment in segments:
            segment.close()
        for slot_segment in slots:
            slot_segment.close()
            slot_segment.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--consumers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out")
    args = parser.parse_args()
    sizes = shapes(args.hidden, args.layers, args.vocab)
    offsets, _ = layout(sizes)
    ours = [torch.randn(s) for s in sizes]
    nbytes = sum(t.nbytes for t in ours)
    result: dict[str, Any] = {
        "tensors": len(sizes),
        "bytes": nbytes,
        "torch_threads": torch.get_num_threads(),
        "rows": {},
    }
    ctx = mp.get_context("spawn")
    for count in args.consumers:
        for name, times in measure(ctx, count, sizes, offsets, ours, args).items():
            result["rows"][f"{name}/{count}"] = {
                "median_ms": statistics.median(times),
                "min_ms": min(times),
                "max_ms": max(times),
            }
    print(f"{'row':<20} {'median ms':>10} {'min':>8} {'max':>8} {'x limit':>8}")
    for key, row in result["rows"].items():
        name, count = key.split("/")
        limit_ms = result["rows"][f"memcpy_limit/{count}"]["median_ms"]
        row["x_limit"] = limit_ms / row["median_ms"]
        print(
            f"{key:<20} {row['median_ms']:>10.1f} {row['min_ms']:>8.1f} "
            f"{row['max_ms']:>8.1f} {row['x_limit']:>8.2f}"
        )
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
