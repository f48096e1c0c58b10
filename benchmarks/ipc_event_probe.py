"""Can a consumer record an IPC event the producer waits on, and what if it dies?

    python3 benchmarks/ipc_event_probe.py    # on a GPU machine; one JSON line per case

The consumer (another process) queues ~1.5 s of copies, records an interprocess event
(its own, or the producer's), and in the ``_killed`` cases is SIGKILLed; the producer's
stream waits on the event and is polled for 15 s (``producer_wait_done_s: null``: it
never completed).
"""

import json
import multiprocessing as mp
import os
import signal
import sys
import time

import torch


def consumer(mode, q_in, q_out):
    torch.cuda.init()
    s = torch.cuda.current_stream()
    if mode.startswith("consumer_created"):
        ev = torch.cuda.Event(interprocess=True)
        q_out.put(bytes(ev.ipc_handle()))
    else:
        h = q_in.get()
        ev = torch.cuda.Event.from_ipc_handle(0, h)
    q_in.get()  # go
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(1500):  # ~1.5 s of copies queued on the stream
        b.copy_(a)
    print("consumer: queued", flush=True, file=sys.stderr)
    ev.record(s)
    print("consumer: recorded", flush=True, file=sys.stderr)
    q_out.put("recorded")
    if mode.endswith("killed"):
        time.sleep(0.2)  # let the queue's feeder send; the copies are still queued
        os.kill(os.getpid(), signal.SIGKILL)
    s.synchronize()
    q_out.put("done")
    q_in.get()


def run(mode):
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(mode, q_in, q_out))
    p.start()
    if mode.startswith("consumer_created"):
        ev = torch.cuda.Event.from_ipc_handle(0, q_out.get())
    else:
        ev = torch.cuda.Event(interprocess=True)
        q_in.put(bytes(ev.ipc_handle()))
    q_in.put("go")
    assert q_out.get(timeout=30) == "recorded"
    t0 = time.perf_counter()
    s = torch.cuda.Stream()
    s.wait_event(ev)
    x = torch.ones(1, device="cuda")
    with torch.cuda.stream(s):
        x.add_(1)
    done_at = None
    while time.perf_counter() - t0 < 15:
        if s.query():
            done_at = time.perf_counter() - t0
            break
        time.sleep(0.005)
    if not mode.endswith("killed"):
        q_in.put("bye")
    p.join(10)
    if p.is_alive():
        p.kill()
    return {
        "mode": mode,
        "producer_wait_done_s": done_at,
        "x": float(x.item()) if done_at else None,
    }


if __name__ == "__main__":
    torch.cuda.init()
    for m in (
        "consumer_created",
        "producer_created",
        "consumer_created_killed",
        "producer_created_killed",
    ):
        try:
            print(json.dumps(run(m)), flush=True)
        except Exception as exc:
            print(json.dumps({"mode": m, "error": repr(exc)}), flush=True)
