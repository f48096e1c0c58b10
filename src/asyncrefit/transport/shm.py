"""The shared-memory transport: CPU buckets in POSIX shared memory (``/dev/shm``).

The trainer packs a bucket into a slot, a named segment it created; the handle is the
segment's name plus the bucket's layout. A worker maps the segment once and keeps the
mapping for later pushes (slots are reused), copies out of it, and drops its views
before it acknowledges.

Segments are unlinked by :meth:`SharedMemoryExporter.close`, which the coordinator
calls on every exit path. Segment names carry the creating process's pid, so segments
left by a process that was killed (no ``close`` could run) are swept by the next
exporter created on the machine: see :func:`sweep_stale_segments`.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .._exceptions import TransportError
from ._base import Handle

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket
    from .._device import DeviceId

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "asyncrefit"
#: The names :func:`segment_name` makes: pid, token, generation, index. A handle naming
#: anything else (an absolute path, ``..``, a subdirectory) is refused.
_NAME_RE = re.compile(rf"{PREFIX}-([0-9]+)-([0-9a-f]+)-([0-9]+)-([0-9]+)")
_NAME_FORM = f"{PREFIX}-<pid>-<token>-<generation>-<index>"
_PAGE = mmap.PAGESIZE
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShmHandle(Handle):
    """A bucket in the shared-memory segment ``segment`` (a name under /dev/shm).

    Only names of the form :func:`segment_name` makes are opened: a worker refuses any
    other (an absolute path, ``..``, a link), so a handle cannot make it map a file.
    """

    kind: ClassVar[str] = "shm"
    segment: str


def _path(name: str) -> str:
    """The path of segment ``name``: only names of this library's form, under SHM_DIR."""
    if not _NAME_RE.fullmatch(name):
        raise TransportError(f"{name!r} is not a segment name ({_NAME_FORM})")
    return os.path.join(SHM_DIR, name)


class _Segment:
    """One mapped segment and its flat ``uint8`` tensor.

    Views of ``tensor`` keep the mapping alive on their own (``torch.frombuffer``
    holds the buffer), so a segment may be unlinked while views are still in use.
    """

    __slots__ = ("mapping", "name", "size", "tensor")

    def __init__(self, name: str, size: int, mapping: mmap.mmap) -> None:
        import torch

        self.name = name
        self.size = size
        self.mapping: mmap.mmap | None = mapping
        self.tensor: torch.Tensor | None = torch.frombuffer(mapping, dtype=torch.uint8)

    @classmethod
    def create(cls, name: str, size: int) -> _Segment:
        try:
            fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise TransportError(f"cannot create shared memory segment {name!r}: {exc}") from exc
        try:
            # Reserve the pages now: a full /dev/shm then fails here with ENOSPC,
            # instead of killing the process with SIGBUS in the middle of a push.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as exc:
            os.close(fd)
            _unlink(name)
            raise TransportError(
                f"cannot allocate {size} bytes of shared memory for {name!r}: {exc}"
            ) from exc
        os.close(fd)
        return cls(name, size, mapping)

    @classmethod
    def open(cls, name: str) -> _Segment:
        try:
            # Not through a link: /dev/shm is writable by every user of the machine.
            fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise TransportError(f"cannot open shared memory segment {name!r}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except (OSError, ValueError) as exc:  # ValueError: an empty segment
            raise TransportError(f"cannot map shared memory segment {name!r}: {exc}") from exc
        finally:
            os.close(fd)
        return cls(name, size, mapping)

    def close(self) -> None:
        # Drop our references only: ``torch.frombuffer`` keeps the mmap object alive
        # but holds no buffer export, so ``mmap.close()`` would succeed under views
        # still in use and leave them pointing at unmapped memory (a crash at the next
        # read). The mapping goes with the last tensor viewing it.
        self.tensor = None
        self.mapping = None


def segment_name(token: str, generation: int, index: int) -> str:
    """The name of a segment this process creates: its pid lets a sweep find orphans."""
    return f"{PREFIX}-{os.getpid()}-{token}-{generation}-{index}"


def segment_pid(name: str) -> int | None:
    """The pid of the process that created segment ``name`` (``None``: not our form)."""
    match = _NAME_RE.fullmatch(name)
    return int(match.group(1)) if match is not None else None


def _unlink(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` lives (a zombie, exited but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: trust the signal probe


def sweep_stale_segments() -> list[str]:
    """Unlink asyncrefit segments whose creating process no longer exists.

    Returns the names removed. Only names of this library's own pattern are touched.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        match = _NAME_RE.fullmatch(name)
        if match and not _pid_alive(int(match.group(1))):
            _unlink(name)
            removed.append(name)
    if removed:
        logger.info("removed %d stale shared memory segments", len(removed))
    return removed


def list_segments() -> list[str]:
    """Names of every asyncrefit segment under /dev/shm (for tests and diagnostics)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX + "-"))
    except OSError:
        return []


class SharedMemoryExporter:
    """Trainer-side slots in shared memory.

    Resource handling: :meth:`allocate` creates (or keeps) the segments, :meth:`close`
    unmaps and unlinks every one of them; both are idempotent. A failed allocation
    unlinks what it created before raising :class:`TransportError`.
    """

    kind = "shm"

    def __init__(self) -> None:
        sweep_stale_segments()
        self._token = secrets.token_hex(4)
        self._generation = 0
        self._segments: list[_Segment] = []

    def __repr__(self) -> str:
        sizes = sum(s.size for s in self._segments)
        return f"<SharedMemoryExporter slots={len(self._segments)} bytes={sizes}>"

    @property
    def segment_names(self) -> list[str]:
        return [s.name for s in self._segments]

    def allocate(self, slots: int, slot_bytes: int) -> None:
        size = max(_PAGE, -(-slot_bytes // _PAGE) * _PAGE)
        if len(self._segments) == slots and all(s.size == size for s in self._segments):
            return
        self.close()
        self._generation += 1
        try:
            for i in range(slots):
                name = segment_name(self._token, self._generation, i)
                self._segments.append(_Segment.create(name, size))
        except BaseException:
            self.close()
            raise

    def buffer(self, slot: int) -> torch.Tensor:
        tensor = self._segments[slot].tensor
        assert tensor is not None
        return tensor

    def seal(self, slot: int) -> None:
        # Stores by this process are visible to every process mapping the segment as
        # soon as the copy returns (the same physical pages): nothing to flush.
        pass

    def handle(self, slot: int, bucket: Bucket, device: DeviceId) -> ShmHandle:
        return ShmHandle(
            device=device,
            bucket=bucket.index,
            nbytes=bucket.nbytes,
            entries=bucket.entries,
            segment=self._segments[slot].name,
        )

    def close(self) -> None:
        segments, self._segments = self._segments, []
        for seg in segments:
            seg.close()
            _unlink(seg.name)


class SharedMemoryImporter:
    """Worker-side mappings of shared-memory segments, cached by name.

    A segment is mapped (its pages faulted in once) the first time a handle names it,
    and stays mapped across pushes: every segment a source uses, however many (a
    :class:`~asyncrefit.SharedParameterTrainer` has one per bucket), is read from its
    cached mapping from then on. There is no fixed cap that a large plan would cycle
    through, re-mapping every segment at every push.

    Resource handling: a name carries its exporter (pid and token) and the exporter's
    generation, which grows whenever it re-allocates. The first handle of a newer
    generation drops that exporter's older mappings; the first handle of an exporter
    not seen before drops the mappings whose names were unlinked (closed exporters').
    :meth:`close` drops every mapping. Callers must drop their slices of the returned
    tensor before acknowledging a bucket.
    """

    def __init__(self) -> None:
        self._cache: dict[str, _Segment] = {}
        self._newest: dict[tuple[int, str], int] = {}  # exporter -> newest generation

    def __len__(self) -> int:
        return len(self._cache)

    def __repr__(self) -> str:
        return f"<SharedMemoryImporter mapped={len(self._cache)}>"

    def open(self, handle: Handle) -> torch.Tensor:
        if not isinstance(handle, ShmHandle):
            raise TransportError(f"shared memory cannot open a {handle.kind!r} handle")
        if not _NAME_RE.fullmatch(handle.segment):
            raise TransportError(
                f"the handle of bucket {handle.bucket} names segment {handle.segment!r}, "
                f"which is not a segment name ({_NAME_FORM} under {SHM_DIR})"
            )
        seg = self._cache.get(handle.segment)
        if seg is None:
            self._forget_stale(handle.segment)
            seg = self._cache[handle.segment] = _Segment.open(handle.segment)
        if seg.size < handle.nbytes or seg.tensor is None:
            raise TransportError(
                f"segment {handle.segment!r} holds {seg.size} bytes, "
                f"bucket {handle.bucket} needs {handle.nbytes}"
            )
        return seg.tensor

    def _forget_stale(self, name: str) -> None:
        """Before mapping ``name``: drop the mappings that no handle will name again."""
        owner, generation = _owner(name)
        newest = self._newest.get(owner)
        if newest is None:  # a new exporter; closed ones unlinked their names
            stale = [n for n in self._cache if not os.path.exists(os.path.join(SHM_DIR, n))]
        elif generation > newest:  # this exporter re-allocated
            stale = [n for n in self._cache if _owner(n)[0] == owner and _owner(n)[1] < generation]
        else:
            stale = []
        for n in stale:
            self._cache.pop(n).close()
        if newest is None or generation > newest:
            self._newest[owner] = generation
        if stale:
            held = {_owner(n)[0] for n in self._cache} | {owner}
            self._newest = {o: g for o, g in self._newest.items() if o in held}

    def finish(self, handle: Handle) -> bytes:
        return b""  # CPU copies are complete when copy_ returns

    def settle(self) -> None:
        pass

    def close(self) -> None:
        cache, self._cache = self._cache, {}
        self._newest = {}
        for seg in cache.values():
            seg.close()


def _owner(name: str) -> tuple[tuple[int, str], int]:
    """The exporter (pid, token) and generation in a segment name of our form."""
    match = _NAME_RE.fullmatch(name)
    assert match is not None, name
    return (int(match.group(1)), match.group(2)), int(match.group(3))
