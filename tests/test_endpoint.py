"""The worker-side endpoint: dispatch, validation before any write, version state, sinks.

Driven with real sinks (the parameter sink of the local and Ray backends, the vLLM
reload sink over a stand-in model) and real shared-memory handles.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import pytest
import torch

from asyncrefit import ParamSpec, cpu_device
from asyncrefit._wire._messages import (
    Aborted,
    AbortUpdate,
    BeginUpdate,
    CommitUpdate,
    DeviceReply,
    Digest,
    Done,
    ErrorReply,
    Forward,
    GetSpecs,
    GetVersion,
    LoadBucket,
    ReleaseHandles,
    ReportDevice,
    Shutdown,
    SpecsReply,
    VersionReply,
)
from asyncrefit._worker._endpoint import Endpoint
from asyncrefit._worker._layout import Declared
from asyncrefit._worker._receiver import ParameterSink
from asyncrefit.abc import BucketAck
from asyncrefit.planning import plan_buckets
from asyncrefit.transport import Handle, Importer, SharedMemoryExporter, SharedMemoryImporter
from asyncrefit.vllm import _reload
from asyncrefit.vllm._sink import ReloadSink

from .test_receiver import pack, same_bits, specs_of

pytestmark = pytest.mark.timeout(60)

DEV = cpu_device(0, node="node-e")
OTHER = cpu_device(1, node="node-e")


class RecordingSink(ParameterSink):
    """The parameter sink, recording which hook ran (in order) and what was validated."""

    def __init__(self, parameters: Mapping[str, torch.Tensor]) -> None:
        super().__init__(parameters)
        self.calls: list[str] = []

    def begin(self, version: int) -> None:
        self.calls.append(f"begin {version}")
        super().begin(version)

    def receiving(self, bucket: int) -> None:
        self.calls.append(f"receiving {bucket}")

    def opening(self, handle: Handle) -> None:
        self.calls.append(f"opening {handle.bucket}")
        super().opening(handle)

    def write(
        self,
        bucket: int,
        handle: Handle,
        buffer: torch.Tensor,
        importer: Importer,
        writing: Callable[[], None],
    ) -> bytes:
        self.calls.append(f"write {bucket}")
        return super().write(bucket, handle, buffer, importer, writing)

    def commit(self, version: int, buckets: int) -> bool:
        self.calls.append(f"commit {version}")
        return super().commit(version, buckets)

    def abort(self, version: int) -> None:
        self.calls.append(f"abort {version}")

    def aborted(self, complete: int | None, written: bool) -> Done:
        self.calls.append(f"aborted {complete} {written}")
        return super().aborted(complete, written)

    def release(self) -> None:
        self.calls.append("release")
        super().release()


@pytest.fixture
def importer() -> Iterator[SharedMemoryImporter]:
    imp = SharedMemoryImporter()
    try:
        yield imp
    finally:
        imp.close()


def buckets(
    exporter: SharedMemoryExporter, source: Mapping[str, torch.Tensor], budget: int
) -> list[tuple[Handle, ...]]:
    """Pack ``source`` into buckets of at most ``budget`` bytes; each bucket's handles
    for OTHER and DEV (in that order)."""
    plan = plan_buckets(specs_of(source), budget)
    exporter.allocate(len(plan.buckets), plan.max_bucket_bytes)
    out: list[tuple[Handle, ...]] = []
    for b in plan.buckets:
        pack(exporter, b.index, b, source)
        out.append((exporter.handle(b.index, b, OTHER), exporter.handle(b.index, b, DEV)))
    return out


def tensors(scale: float) -> dict[str, torch.Tensor]:
    return {
        "a": torch.full((16,), 1.0 * scale),
        "b": torch.full((3, 4), 2.0 * scale),
        "c": torch.arange(5, dtype=torch.int32) * int(scale),
    }


def snapshot(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in params.items()}


def unchanged(params: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]) -> bool:
    return all(same_bits(t, before[n]) for n, t in params.items())


# --- dispatch ----------------------------------------------------------------------------


def test_every_request_is_dispatched(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    params = tensors(0)
    sink = RecordingSink(params)
    endpoint = Endpoint(sink, DEV, importers={"shm": importer})
    try:
        assert endpoint.handle(ReportDevice()) == DeviceReply(device=DEV)
        assert endpoint.handle(GetSpecs()) == SpecsReply(
            specs=(
                ParamSpec(name="a", shape=(16,), dtype="float32", parts=True),
                ParamSpec(name="b", shape=(3, 4), dtype="float32", parts=True),
                ParamSpec(name="c", shape=(5,), dtype="int32", parts=True),
            )
        )
        assert endpoint.handle(GetVersion()) == VersionReply(version=None)
        source = tensors(3)
        handles = buckets(exporter, source, 512)
        assert len(handles) == 2
        assert endpoint.handle(BeginUpdate(version=7)) == Done()
        acks = [
            endpoint.handle(LoadBucket(version=7, bucket=i, handles=h))
            for i, h in enumerate(handles)
        ]
        assert [type(a) for a in acks] == [BucketAck, BucketAck]
        assert [a.bucket for a in acks if isinstance(a, BucketAck)] == [0, 1]
        assert sum(a.nbytes for a in acks if isinstance(a, BucketAck)) == 16 * 4 + 12 * 4 + 5 * 4
        assert all(a.copied == b"" for a in acks if isinstance(a, BucketAck))
        assert endpoint.handle(CommitUpdate(version=7, buckets=2)) == Done()
        assert endpoint.handle(GetVersion()) == VersionReply(version=7)
        for n, t in source.items():
            assert same_bits(params[n], t), n
        assert endpoint.handle(AbortUpdate(version=7)) == Done()  # nothing pending: a no-op
        assert endpoint.handle(GetVersion()) == VersionReply(version=7)
        assert len(importer) == 2
        assert endpoint.handle(ReleaseHandles()) == Done()
        assert len(importer) == 0 and not sink._prepared
        assert sink.calls == [
            "begin 7",
            "receiving 0",
            "opening 0",
            "write 0",
            "receiving 1",
            "opening 1",
            "write 1",
            "commit 7",
            "abort 7",
            "aborted 7 False",
            "release",
        ]
        # What a backend serves itself is not the endpoint's: refused, never raised.
        for other in (Digest(), Forward(inputs=1), Shutdown(), "garbage"):
            reply = endpoint.handle(other)
            assert reply == ErrorReply(
                type="TypeError", message=f"unknown request {type(other).__name__}"
            )
    finally:
        endpoint.close()


def test_a_failure_is_an_error_reply_with_its_type_and_message(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    endpoint = Endpoint(ParameterSink(tensors(0)), DEV, importers={"shm": importer})
    try:
        handles = buckets(exporter, tensors(1), 1 << 20)[0]
        endpoint.handle(BeginUpdate(version=1))
        reply = endpoint.handle(LoadBucket(version=1, bucket=0, handles=handles[:1]))
        assert reply == ErrorReply(
            type="TransportError",
            message=f"no handle for device {DEV} (offered: {OTHER})",
        )
    finally:
        endpoint.close()


# --- validation before the first write ------------------------------------------------


BAD_ENTRIES: dict[str, Callable[[Handle], Handle]] = {
    "unknown name": lambda h: replace(
        h, entries=(h.entries[0], replace(h.entries[1], name="ghost"), h.entries[2])
    ),
    "wrong shape": lambda h: replace(
        h, entries=(h.entries[0], replace(h.entries[1], shape=(4, 3)), h.entries[2])
    ),
    "wrong dtype": lambda h: replace(
        h, entries=(h.entries[0], replace(h.entries[1], dtype="int32"), h.entries[2])
    ),
    "short span": lambda h: replace(
        h,
        entries=(
            h.entries[0],
            replace(h.entries[1], nbytes=h.entries[1].nbytes - 4),
            h.entries[2],
        ),
    ),
    "overlap": lambda h: replace(
        h,
        entries=(h.entries[0], replace(h.entries[1], offset=h.entries[0].offset), h.entries[2]),
    ),
    "past the buffer": lambda h: replace(
        h,
        nbytes=1 << 30,
        entries=(h.entries[0], replace(h.entries[1], offset=1 << 29), h.entries[2]),
    ),
}


@pytest.mark.parametrize("defect", sorted(BAD_ENTRIES))
def test_a_bad_entry_in_the_middle_of_a_handle_writes_nothing(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter, defect: str
) -> None:
    params = tensors(0)
    sink = RecordingSink(params)
    endpoint = Endpoint(sink, DEV, importers={"shm": importer})
    try:
        endpoint.begin(1)
        endpoint.load(1, 0, buckets(exporter, tensors(1), 1 << 20)[0])
        endpoint.commit(1, 1)
        before = snapshot(params)
        good = buckets(exporter, tensors(5), 1 << 20)[0]
        bad = tuple(BAD_ENTRIES[defect](h) for h in good)
        assert [e.name for e in good[1].entries] == ["a", "b", "c"]
        endpoint.begin(2)
        sink.calls.clear()
        reply = endpoint.handle(LoadBucket(version=2, bucket=0, handles=bad))
        assert isinstance(reply, ErrorReply) and reply.type == "TransportError", reply
        assert "bucket 0" in reply.message
        assert unchanged(params, before)
        assert not any(c.startswith("write") for c in sink.calls), sink.calls
        assert endpoint.state.dirty is False
        assert endpoint.handle(AbortUpdate(version=2)) == Done()
        assert endpoint.version == 1  # nothing was written: version 1 still whole
    finally:
        endpoint.close()


def test_a_handle_is_validated_once_and_checked_against_each_buffer(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[int] = []
    real = Declared.check

    def counting(self: Declared, handle: Handle) -> None:
        checked.append(handle.bucket)
        real(self, handle)

    monkeypatch.setattr(Declared, "check", counting)
    params = tensors(0)
    endpoint = Endpoint(ParameterSink(params), DEV, importers={"shm": importer})
    try:
        for version in (1, 2, 3):
            handles = buckets(exporter, tensors(version), 512)
            endpoint.begin(version)
            for i, h in enumerate(handles):
                endpoint.load(version, i, h)
            endpoint.commit(version, len(handles))
            for n, t in tensors(version).items():
                assert same_bits(params[n], t), n
        assert checked == [0, 1]  # equal handles at every push: checked once
        # The same handle opened to a smaller buffer (a re-allocated segment) is refused.
        handles = buckets(exporter, tensors(4), 512)
        small = replace(handles[0][1], nbytes=1 << 20)
        endpoint.begin(4)
        before = snapshot(params)
        reply = endpoint.handle(LoadBucket(version=4, bucket=0, handles=(small,)))
        assert isinstance(reply, ErrorReply) and "byte" in reply.message, reply
        assert unchanged(params, before) and endpoint.state.dirty is False
    finally:
        endpoint.close()


# --- version state -------------------------------------------------------------------


def test_version_state_errors(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    params = tensors(0)
    endpoint = Endpoint(ParameterSink(params), DEV, importers={"shm": importer})
    try:
        handles = buckets(exporter, tensors(2), 1 << 20)[0]
        reply = endpoint.handle(LoadBucket(version=1, bucket=0, handles=handles))
        assert reply == ErrorReply(
            type="UpdateStateError",
            message="bucket of version 1 arrived, but the worker is receiving nothing",
        )
        assert len(importer) == 0  # refused before anything was opened
        endpoint.handle(BeginUpdate(version=2))
        reply = endpoint.handle(LoadBucket(version=1, bucket=0, handles=handles))
        assert isinstance(reply, ErrorReply) and "receiving 2" in reply.message
        reply = endpoint.handle(CommitUpdate(version=2, buckets=1))
        assert reply == ErrorReply(
            type="UpdateStateError", message="version 2 committed with 0 of 1 buckets loaded"
        )
        reply = endpoint.handle(CommitUpdate(version=3, buckets=0))
        assert isinstance(reply, ErrorReply) and reply.type == "UpdateStateError"
        assert isinstance(
            endpoint.handle(LoadBucket(version=2, bucket=0, handles=handles)), BucketAck
        )
        assert endpoint.version is None  # written, not committed
        assert endpoint.handle(AbortUpdate(version=9)) == Done()  # not this one: ignored
        assert endpoint.state.pending == 2
        assert endpoint.handle(CommitUpdate(version=2, buckets=1)) == Done()
        assert endpoint.version == 2
        # A begin over a pending version aborts it: written, so no version is whole.
        endpoint.handle(BeginUpdate(version=3))
        endpoint.handle(LoadBucket(version=3, bucket=0, handles=handles))
        endpoint.handle(BeginUpdate(version=4))
        assert endpoint.version is None and endpoint.state.pending == 4
    finally:
        endpoint.close()


def test_a_bad_checksum_of_a_parameter_copy_leaves_the_version_incomplete(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter
) -> None:
    endpoint = Endpoint(ParameterSink(tensors(0)), DEV, importers={"shm": importer})
    try:
        handles = buckets(exporter, tensors(2), 1 << 20)[0]
        endpoint.begin(1)
        endpoint.load(1, 0, handles)
        endpoint.commit(1, 1)
        endpoint.begin(2)
        wrong = tuple(replace(h, checksum=12345) for h in handles)
        reply = endpoint.handle(LoadBucket(version=2, bucket=0, handles=wrong))
        assert isinstance(reply, ErrorReply) and reply.type == "IntegrityError", reply
        assert endpoint.state.dirty and endpoint.version is None  # verified after the copy
    finally:
        endpoint.close()


# --- the vLLM reload sink, over a stand-in model -------------------------------------------


class _Model:
    """What the reload sink needs of a vLLM model: ``load_weights``."""

    def __init__(self) -> None:
        self.loaded: list[list[tuple[str, torch.Tensor]]] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.loaded.append(weights)


class _Target:
    def __init__(self, specs: tuple[ParamSpec, ...]) -> None:
        self.model: Any = _Model()
        self.model_config: Any = None
        self.vllm_config: Any = None
        self.device: Any = torch.device("cpu")
        self.specs = specs


@pytest.fixture
def reload_sink(monkeypatch: pytest.MonkeyPatch) -> ReloadSink:
    with warnings.catch_warnings():  # vLLM warns at import; the sink's loads import it
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm.model_executor.model_loader.mtp_validation")
    specs = tuple(specs_of(tensors(0)))
    target = _Target(specs)
    monkeypatch.setattr("asyncrefit.vllm._sink.checkpoint_specs", lambda config: specs)
    # No vLLM model: its review finds no layer to renew.
    monkeypatch.setattr(_reload, "review", lambda model: _reload.Review())
    return ReloadSink(target)


def test_the_reload_sink_refuses_outside_a_reload_and_feeds_copies_inside(
    exporter: SharedMemoryExporter, importer: SharedMemoryImporter, reload_sink: ReloadSink
) -> None:
    endpoint: Endpoint[Aborted] = Endpoint(reload_sink, DEV, importers={"shm": importer})
    model = reload_sink._target.model
    try:
        source = tensors(3)
        handles = buckets(exporter, source, 512)
        reply = endpoint.handle(BeginUpdate(version=1))
        assert reply == ErrorReply(
            type="UpdateStateError", message="version 1 begun outside a weight update"
        )
        assert endpoint.state.pending is None
        reload_sink.open = True  # what start() does (vLLM's update opened) ...
        reload_sink.reloading = True  # ... and the begin (its reload opened: faked here)
        assert endpoint.handle(BeginUpdate(version=1)) == Done()
        reload_sink.reloading = False
        reply = endpoint.handle(LoadBucket(version=1, bucket=0, handles=handles[0]))
        assert reply == ErrorReply(
            type="UpdateStateError", message="bucket 0 arrived outside a staged weight update"
        )
        reload_sink.reloading = True
        # A bad name in the middle is refused before the model sees any tensor.
        ghost = tuple(
            replace(h, entries=(h.entries[0], replace(h.entries[1], name="ghost")))
            if len(h.entries) > 1
            else h
            for h in handles[0]
        )
        assert len(ghost[1].entries) == 2
        reply = endpoint.handle(LoadBucket(version=1, bucket=0, handles=ghost))
        assert reply == ErrorReply(
            type="TransportError",
            message="bucket 0 names 'ghost', which the model does not load",
        )
        wrong = tuple(replace(h, checksum=7) for h in handles[0])
        reply = endpoint.handle(LoadBucket(version=1, bucket=0, handles=wrong))
        assert isinstance(reply, ErrorReply) and reply.type == "IntegrityError"
        assert not model.loaded and endpoint.state.dirty is False  # checked before loading
        for i, h in enumerate(handles):
            ack = endpoint.handle(LoadBucket(version=1, bucket=i, handles=h))
            assert isinstance(ack, BucketAck) and ack.copied == b"", ack
        fed = dict(w for batch in model.loaded for w in batch)
        assert sorted(fed) == ["a", "b", "c"]
        opened = [importer.open(h[1]) for h in handles]
        for n, t in source.items():
            assert same_bits(fed[n], t), n
            # Copies of the trainer's buffer, not views of it.
            assert all(
                fed[n].untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                for b in opened
            )
        del opened
        # The commit is checked and kept: the version is complete once finalized.
        assert endpoint.handle(CommitUpdate(version=1, buckets=2)) == Done()
        assert endpoint.version is None and endpoint.state.pending == 1
        endpoint.complete(1, 2)
        assert endpoint.version == 1
    finally:
        endpoint.close()


def test_the_reload_sink_answers_an_abort_with_what_it_holds(
    exporter: SharedMemoryExporter,
    importer: SharedMemoryImporter,
    reload_sink: ReloadSink,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ended: list[bool] = []

    def end_reload() -> None:  # what it does to the sink; vLLM's reload is not open
        ended.append(True)
        reload_sink.reloading = False

    monkeypatch.setattr(reload_sink, "end_reload", end_reload)
    endpoint: Endpoint[Aborted] = Endpoint(reload_sink, DEV, importers={"shm": importer})
    try:
        handles = buckets(exporter, tensors(3), 1 << 20)[0]
        reload_sink.open = True  # vLLM's update is open
        reload_sink.reloading = True
        endpoint.handle(BeginUpdate(version=1))
        assert endpoint.handle(AbortUpdate(version=1)) == Aborted(version=None, written=False)
        assert ended == [True]
        reload_sink.reloading = True
        endpoint.handle(BeginUpdate(version=2))
        endpoint.handle(LoadBucket(version=2, bucket=0, handles=handles))
        assert endpoint.handle(AbortUpdate(version=2)) == Aborted(version=None, written=True)
        assert ended == [True, True]
        reload_sink.reloading = False  # the reload has ended: nothing to end again
        assert endpoint.handle(AbortUpdate(version=2)) == Aborted(version=None, written=False)
        assert ended == [True, True]
    finally:
        endpoint.close()
