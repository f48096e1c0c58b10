"""The shared-memory transport: segments, cached mappings, stale-segment sweeping."""

from __future__ import annotations

import mmap
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from asyncrefit import ParamSpec, TransportError, cpu_device
from asyncrefit._core._plan import Bucket
from asyncrefit.planning import plan_buckets
from asyncrefit.transport.shm import (
    SHM_DIR,
    SharedMemoryExporter,
    SharedMemoryImporter,
    ShmHandle,
    list_segments,
    sweep_stale_segments,
)

DEV = cpu_device(0)
PAGE = mmap.PAGESIZE


def a_bucket(nbytes: int = 64) -> Bucket:
    plan = plan_buckets([ParamSpec(name="w", shape=(nbytes,), dtype="uint8")], 1 << 20)
    return plan.buckets[0]


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def dead_pid() -> int:
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout)


@pytest.fixture
def importer() -> Iterator[SharedMemoryImporter]:
    imp = SharedMemoryImporter()
    try:
        yield imp
    finally:
        imp.close()


# --- exporter ------------------------------------------------------------------------------


def test_allocate_creates_named_segments(exporter: SharedMemoryExporter) -> None:
    exporter.allocate(3, 1000)
    names = exporter.segment_names
    assert len(names) == 3 and len(set(names)) == 3
    assert set(names) <= set(list_segments())
    for i, name in enumerate(names):
        assert name.startswith(f"asyncrefit-{os.getpid()}-")
        assert name.endswith(f"-{i}")
        assert os.stat(os.path.join(SHM_DIR, name)).st_size == PAGE  # rounded up to a page
        buf = exporter.buffer(i)
        assert buf.dtype == torch.uint8 and buf.numel() == PAGE


def test_allocate_sizes_round_to_pages(exporter: SharedMemoryExporter) -> None:
    exporter.allocate(1, PAGE + 1)
    (name,) = exporter.segment_names
    assert os.stat(os.path.join(SHM_DIR, name)).st_size == 2 * PAGE
    assert exporter.buffer(0).numel() == 2 * PAGE


def test_reallocate_same_size_keeps_segments(exporter: SharedMemoryExporter) -> None:
    exporter.allocate(2, 100)
    names = exporter.segment_names
    exporter.buffer(1)[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    exporter.allocate(2, 200)  # the same page size
    assert exporter.segment_names == names
    assert exporter.buffer(1)[:4].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize(("slots", "slot_bytes"), [(2, PAGE + 1), (3, 100), (1, 100)])
def test_reallocate_other_shape_replaces_segments(
    exporter: SharedMemoryExporter, slots: int, slot_bytes: int
) -> None:
    exporter.allocate(2, 100)
    old = exporter.segment_names
    exporter.allocate(slots, slot_bytes)
    new = exporter.segment_names
    assert len(new) == slots
    assert not set(old) & set(new)
    assert not any(exists(n) for n in old)
    assert all(exists(n) for n in new)
    assert set(list_segments()) & set(old) == set()


def test_a_view_outliving_close_still_reads_its_bytes() -> None:
    """Closing drops the mapping only with its last view: a view kept by a caller (a
    zero-copy parameter, a cached pack view) never points at unmapped memory."""
    ex = SharedMemoryExporter()
    ex.allocate(1, 4096)
    view = ex.buffer(0)[:8]
    view.fill_(7)
    ex.close()
    assert view.tolist() == [7] * 8  # crashed (segfault) when close() unmapped it
    view += 1
    assert view.tolist() == [8] * 8


def test_close_unlinks_and_is_idempotent() -> None:
    ex = SharedMemoryExporter()
    try:
        ex.allocate(2, 100)
        names = ex.segment_names
        assert all(exists(n) for n in names)
    finally:
        ex.close()
    assert ex.segment_names == []
    assert not any(exists(n) for n in names)
    assert not set(names) & set(list_segments())
    ex.close()
    ex.close()
    assert ex.segment_names == []


def test_handle_names_segment_and_layout(exporter: SharedMemoryExporter) -> None:
    exporter.allocate(2, 100)
    bucket = a_bucket(64)
    h = exporter.handle(1, bucket, DEV)
    assert isinstance(h, ShmHandle)
    assert h.kind == "shm"
    assert (h.segment, h.device, h.bucket, h.nbytes) == (exporter.segment_names[1], DEV, 0, 64)
    assert h.entries == bucket.entries


# --- importer ------------------------------------------------------------------------------


def test_importer_caches_and_sees_exporter_writes(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    exporter.allocate(1, 100)
    handle = exporter.handle(0, a_bucket(), DEV)
    t1 = importer.open(handle)
    t2 = importer.open(handle)
    assert len(importer) == 1
    assert t1.data_ptr() == t2.data_ptr()
    assert t1.numel() == PAGE
    exporter.buffer(0)[10:13] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    assert t2[10:13].tolist() == [7, 8, 9]
    exporter.buffer(0)[10] = 42
    assert int(t1[10]) == 42
    del t1, t2


def test_importer_keeps_every_segment_of_a_generation_mapped(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    exporter.allocate(40, 100)  # more segments than any small cache would hold
    handles = [exporter.handle(i, a_bucket(), DEV) for i in range(40)]
    first = [importer.open(h).data_ptr() for h in handles]
    assert len(importer) == 40
    # With the names unlinked, only cached mappings can still be opened: all of them are.
    names = exporter.segment_names
    for name in names:
        os.unlink(os.path.join(SHM_DIR, name))
    try:
        for _ in range(2):
            assert [importer.open(h).data_ptr() for h in handles] == first
        assert len(importer) == 40
    finally:
        for name in names:  # let the exporter's close unlink them again
            open(os.path.join(SHM_DIR, name), "wb").close()


def test_importer_drops_mappings_of_an_older_generation(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    exporter.allocate(3, 100)
    for i in range(3):
        importer.open(exporter.handle(i, a_bucket(), DEV))
    assert len(importer) == 3
    exporter.allocate(2, 2 * PAGE)  # re-allocated: a new generation of names
    new = exporter.handle(0, a_bucket(), DEV)
    assert importer.open(new).numel() == 2 * PAGE
    assert len(importer) == 1  # the three old mappings went with the first new handle
    importer.open(exporter.handle(1, a_bucket(), DEV))
    assert len(importer) == 2


def test_importer_drops_unlinked_mappings_when_a_new_exporter_appears(
    importer: SharedMemoryImporter,
) -> None:
    old, live, new = SharedMemoryExporter(), SharedMemoryExporter(), SharedMemoryExporter()
    try:
        for ex in (old, live, new):
            ex.allocate(2, 100)
        for ex in (old, live):
            for i in range(2):
                importer.open(ex.handle(i, a_bucket(), DEV))
        assert len(importer) == 4
        old.close()  # its names are unlinked; the worker's mappings pin the memory
        assert len(importer) == 4
        importer.open(new.handle(0, a_bucket(), DEV))
        assert len(importer) == 3  # live's two and new's one
        importer.open(live.handle(1, a_bucket(), DEV))
        assert len(importer) == 3
    finally:
        for ex in (old, live, new):
            ex.close()


def test_importer_close_drops_mappings(exporter: SharedMemoryExporter) -> None:
    exporter.allocate(1, 100)
    handle = exporter.handle(0, a_bucket(), DEV)
    imp = SharedMemoryImporter()
    imp.open(handle)
    assert len(imp) == 1
    imp.close()
    imp.close()
    assert len(imp) == 0
    exporter.close()
    with pytest.raises(TransportError):
        imp.open(handle)  # not cached any more, and gone


def test_importer_missing_segment_raises(importer: SharedMemoryImporter) -> None:
    bucket = a_bucket()
    handle = ShmHandle(
        device=DEV,
        bucket=0,
        nbytes=bucket.nbytes,
        entries=bucket.entries,
        segment=f"asyncrefit-{os.getpid()}-00000000-9-9",
    )
    with pytest.raises(TransportError, match="asyncrefit-"):
        importer.open(handle)
    assert len(importer) == 0


def test_importer_too_small_segment_raises(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    exporter.allocate(1, 100)
    bucket = a_bucket(2 * PAGE)
    handle = exporter.handle(0, bucket, DEV)
    assert handle.nbytes == 2 * PAGE
    with pytest.raises(TransportError, match=f"holds {PAGE} bytes, bucket 0 needs {2 * PAGE}"):
        importer.open(handle)
    ok = exporter.handle(0, a_bucket(PAGE), DEV)
    assert importer.open(ok).numel() == PAGE


def test_importer_empty_segment_raises_transport_error(importer: SharedMemoryImporter) -> None:
    name = f"asyncrefit-{os.getpid()}-0e0e0e0e-1-0"
    path = os.path.join(SHM_DIR, name)
    open(path, "wb").close()
    try:
        bucket = a_bucket(16)
        handle = ShmHandle(device=DEV, bucket=0, nbytes=16, entries=bucket.entries, segment=name)
        with pytest.raises(TransportError):
            importer.open(handle)
    finally:
        os.unlink(path)


@pytest.fixture
def victim(tmp_path: pathlib.Path) -> pathlib.Path:
    """A file outside /dev/shm that no handle may reach."""
    path = tmp_path / "victim"
    path.write_bytes(b"precious" * PAGE)
    return path


def mapped(path: pathlib.Path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(str(path)) for line in f)


@pytest.mark.parametrize(
    "kind", ["absolute", "dotdot", "inside-dotdot", "subdir", "newline", "foreign", "empty"]
)
def test_importer_refuses_names_the_exporter_does_not_make(
    importer: SharedMemoryImporter, victim: pathlib.Path, kind: str
) -> None:
    ours = f"asyncrefit-{os.getpid()}-00ff00ff-1-0"
    name = {
        "absolute": str(victim),
        "dotdot": os.path.relpath(victim, SHM_DIR),
        "inside-dotdot": f"{ours}/../{os.path.relpath(victim, SHM_DIR)}",
        "subdir": f"{ours}/x",
        "newline": ours + "\n",
        "foreign": "somebody-elses-segment",
        "empty": "",
    }[kind]
    before = victim.read_bytes(), victim.stat().st_mtime_ns
    handle = ShmHandle(device=DEV, bucket=3, nbytes=16, entries=a_bucket(16).entries, segment=name)
    with pytest.raises(TransportError, match=r"bucket 3 names segment .*not a segment name"):
        importer.open(handle)
    assert len(importer) == 0
    assert not mapped(victim)
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before


def test_importer_does_not_follow_a_link_with_a_segment_name(
    importer: SharedMemoryImporter, victim: pathlib.Path
) -> None:
    # /dev/shm is writable by everyone: a link there with a well-formed name must not
    # lead a worker to map another file.
    name = f"asyncrefit-{os.getpid()}-00ff00ff-1-0"
    link = os.path.join(SHM_DIR, name)
    os.symlink(victim, link)
    try:
        handle = ShmHandle(
            device=DEV, bucket=0, nbytes=16, entries=a_bucket(16).entries, segment=name
        )
        with pytest.raises(TransportError, match="cannot open"):
            importer.open(handle)
        assert not mapped(victim)
    finally:
        os.unlink(link)


def test_importer_rejects_foreign_handle(importer: SharedMemoryImporter) -> None:
    from asyncrefit.transport import Handle

    with pytest.raises(TransportError, match="cannot open a 'abstract' handle"):
        importer.open(Handle(device=DEV, bucket=0, nbytes=0, entries=()))


# --- sweeping ------------------------------------------------------------------------------


def test_sweep_removes_segments_of_dead_processes(exporter: SharedMemoryExporter) -> None:
    exporter.allocate(1, 100)
    (live,) = exporter.segment_names
    pid = dead_pid()
    stale = f"asyncrefit-{pid}-deadbeef-1-0"
    odd = f"asyncrefit-{pid}-not-ours"  # not this library's pattern: never touched
    for name in (stale, odd):
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x")
    try:
        assert stale in list_segments()
        removed = sweep_stale_segments()
        assert not exists(stale)
        assert live not in removed
        assert exists(live)
        assert exists(odd)
        assert odd not in removed
    finally:
        for name in (stale, odd):
            if exists(name):
                os.unlink(os.path.join(SHM_DIR, name))


def test_new_exporter_sweeps_stale_segments() -> None:
    stale = f"asyncrefit-{dead_pid()}-deadbeef-3-1"
    path = os.path.join(SHM_DIR, stale)
    open(path, "wb").close()
    try:
        ex = SharedMemoryExporter()
        ex.close()
        assert not exists(stale)
    finally:
        if exists(stale):
            os.unlink(path)
