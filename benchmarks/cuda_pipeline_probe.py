"""Where the limit of a refit on one GPU is, measured without the library.

    python3 benchmarks/cuda_pipeline_probe.py [--bytes 13476000000] [--slot-mib 1024 2048]

The set is moved as flat buckets of ``--slot-mib`` through two slots, as a push
does, in these ways (median of ``--repeats`` runs, ms):

- ``two_copy_limit``: one process packs each bucket into a slot and copies it out,
  bucket after bucket, on one stream (the figure RESULTS.md's refit rows divide by);
- ``one_process_pipelined``: one process packs on one stream and copies out on
  another, ordered by events: what one CUDA context can overlap;
- ``two_process_device_ordered``: a producer process packs into two shared slots, a
  consumer process copies out; the GPU orders them by interprocess events (the
  consumer waits for the pack, the repack of a slot waits for the consumer's copy);
  the hosts pass only a few bytes per bucket over a pipe. This is a device-ordered
  push with nothing of the library in it;
- ``two_process_host_acked``: the same, but the consumer acknowledges a bucket only
  once its copy finished (a host synchronize) and the producer repacks a slot only
  after that acknowledgement: a push with host acknowledgements and nothing else;
- ``two_process_unordered``: both processes copy their own bytes at the same time,
  unordered: what the GPU gives two contexts at once.

One JSON object is printed (and written to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing  # registers the CUDA tensor reductions the pipe uses

MIB = 2**20


def buckets(total: int, slot: int) -> list[tuple[int, int]]:
    return [(o, min(slot, total - o)) for o in range(0, total, slot)]


def median_ms(fn: Callable[[], float], repeats: int) -> float:
    fn()  # warm up
    return statistics.median(fn() * 1e3 for _ in range(repeats))


def one_process(total: int, slot_bytes: int, repeats: int) -> dict[str, float]:
    src = torch.empty(total, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    slots = [torch.empty(slot_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    plan = buckets(total, slot_bytes)

    def serial() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for k, (o, n) in enumerate(plan):
            s = slots[k % 2]
            s[:n].copy_(src[o : o + n])
            dst[o : o + n].copy_(s[:n])
        torch.cuda.synchronize()
        return time.perf_counter() - t

    pack_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    packed = [torch.cuda.Event() for _ in range(2)]
    copied = [torch.cuda.Event() for _ in range(2)]

    def pipelined() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for k, (o, n) in enumerate(plan):
            i = k % 2
            if k >= 2:
                pack_stream.wait_event(copied[i])
            with torch.cuda.stream(pack_stream):
                slots[i][:n].copy_(src[o : o + n])
            packed[i].record(pack_stream)
            copy_stream.wait_event(packed[i])
            with torch.cuda.stream(copy_stream):
                dst[o : o + n].copy_(slots[i][:n])
            copied[i].record(copy_stream)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    out = {
        "two_copy_limit": median_ms(serial, repeats),
        "one_process_pipelined": median_ms(pipelined, repeats),
    }
    return out  # the buffers go with this frame: main empties the cache


def consumer(conn: Connection, total: int) -> None:
    """The consumer process: copies each bucket out of the shared slots as told."""
    torch.cuda.init()
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    copied = [torch.cuda.Event(interprocess=True) for _ in range(2)]
    conn.send([bytes(e.ipc_handle()) for e in copied])
    slots, packed_handles = conn.recv()
    packed = [torch.cuda.Event.from_ipc_handle(0, h) for h in packed_handles]
    stream = torch.cuda.Stream()
    own = torch.empty_like(dst)
    while True:
        what = conn.recv()
        if what is None:
            break
        mode, plan = what
        if mode == "unordered":
            with torch.cuda.stream(stream):
                for o, n in plan:  # its own bytes: another context's copies at once
                    dst[o : o + n].copy_(own[o : o + n])
            stream.synchronize()
            conn.send("done")
            continue
        for k, (o, n) in enumerate(plan):
            conn.recv()  # bucket k was packed (device ordered) or is complete (host acked)
            i = k % 2
            if mode == "device":
                stream.wait_event(packed[i])
            with torch.cuda.stream(stream):
                dst[o : o + n].copy_(slots[i][:n])
            if mode == "device":
                copied[i].record(stream)
            else:
                stream.synchronize()
            conn.send(k)
        stream.synchronize()
        conn.send("done")
    del slots
    conn.send("closed")


def two_process(total: int, slot_bytes: int, repeats: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(there, total))
    proc.start()
    try:
        src = torch.empty(total, dtype=torch.uint8, device="cuda")
        own = torch.empty_like(src)
        slots = [torch.empty(slot_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        packed = [torch.cuda.Event(interprocess=True) for _ in range(2)]
        copied = [torch.cuda.Event.from_ipc_handle(0, h) for h in here.recv()]
        here.send((slots, [bytes(e.ipc_handle()) for e in packed]))
        stream = torch.cuda.Stream()
        plan = buckets(total, slot_bytes)

        def ordered(mode: str) -> float:
            torch.cuda.synchronize()
            here.send((mode, plan))
            t = time.perf_counter()
            acks = 0
            for k, (o, n) in enumerate(plan):
                i = k % 2
                if k >= 2:
                    assert here.recv() == k - 2  # the consumer's copy of k-2 is queued/done
                    acks += 1
                    if mode == "device":
                        stream.wait_event(copied[i])
                with torch.cuda.stream(stream):
                    slots[i][:n].copy_(src[o : o + n])
                if mode == "device":
                    packed[i].record(stream)
                else:
                    stream.synchronize()
                here.send(k)
            while acks < len(plan):
                here.recv()
                acks += 1
            assert here.recv() == "done"
            return time.perf_counter() - t

        def unordered() -> float:
            torch.cuda.synchronize()
            here.send(("unordered", plan))
            t = time.perf_counter()
            with torch.cuda.stream(stream):
                for o, n in plan:
                    own[o : o + n].copy_(src[o : o + n])
            stream.synchronize()
            assert here.recv() == "done"
            return time.perf_counter() - t

        out = {
            "two_process_device_ordered": median_ms(lambda: ordered("device"), repeats),
            "two_process_host_acked": median_ms(lambda: ordered("host"), repeats),
            "two_process_unordered": median_ms(unordered, repeats),
        }
        here.send(None)
        assert here.recv() == "closed"
        return out
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=13_476_000_000)  # Llama-2-7B in bf16
    parser.add_argument("--slot-mib", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    total = args.bytes // 4096 * 4096
    rows: list[dict[str, Any]] = []
    for slot_mib in args.slot_mib:
        row: dict[str, Any] = {"slot_mib": slot_mib, "buckets": len(buckets(total, slot_mib * MIB))}
        row.update(one_process(total, slot_mib * MIB, args.repeats))
        torch.cuda.empty_cache()
        row.update(two_process(total, slot_mib * MIB, args.repeats))
        limit = row["two_copy_limit"]
        row["x_limit"] = {
            k: round(limit / v, 3)
            for k, v in row.items()
            if isinstance(v, float) and k != "x_limit"
        }
        rows.append(row)
    result = {
        "device": torch.cuda.get_device_name(),
        "bytes": total,
        "repeats": args.repeats,
        "rows": rows,
        "date": time.strftime("%Y-%m-%d"),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
