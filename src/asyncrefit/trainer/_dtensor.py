"""A sharded trainer rank as a trainer source: DTensor parameters gathered bucket by bucket."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ._gather import gather_into, gather_rows_into
from ._local import LocalTrainer, NamesLike, TensorsLike
from ._slices import Lazy, Piece, is_plain, view_of

if TYPE_CHECKING:
    import torch

    from .._core._plan import Bucket
    from .._device import DeviceId
    from ..transport._base import Exporter


def _default_name() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return f"rank-{dist.get_rank()}"
    return "trainer"


class DTensorSource(LocalTrainer):
    """One rank of a sharded trainer (FSDP2 ``fully_shard``, tensor parallel, 2-D meshes).

    Make one on every rank, over the rank's own module (or mapping of parameters):
    parameters that are ``DTensor``\\ s (``Shard(d)`` or ``Replicate`` on any mesh
    dimension) are described by their global shape and gathered at export time, plain
    tensors are copied as :class:`~asyncrefit.LocalTrainer` copies them. Give the
    coordinator every rank's source (in-process, through
    :func:`~asyncrefit.trainer.serve_rank` / :class:`~asyncrefit.trainer.RankSource`
    for other processes, or the Ray mixin): the coordinator then drives every rank
    through every bucket in plan order, including ranks whose device serves no worker,
    which is what makes the ranks' all-gathers meet.

    Each bucket's parameters are gathered in plan order straight into the bucket's
    staging slot, cast to the engine's dtype on the way (shards are cast before they
    travel). A tensor whose layout cannot be gathered in place (uneven shards, a
    dimension other than 0, a 2-D mesh) goes through one temporary of about its size:
    a rank needs at most the budget plus about the largest tensor of extra memory.
    A part of a tensor (rows, when it is larger than a bucket) and a checkpoint tensor
    that is a slice of a trainer tensor (one expert of a transformers model's fused
    expert tensor) gather only the rows of dimension 0 they read: over ``Shard(0)``
    the ranks holding them broadcast just those rows (straight into the slot, or into
    a temporary of those rows that the next slice of the same rows reuses).
    On a mesh of one rank (a trainer of one process) nothing is gathered: each
    parameter is cast as it is copied into the slot, on the CPU or the GPU. Gathers
    run in a worker thread, off the event loop.

    ``timeout`` bounds each collective: a rank that died or hangs mid-gather makes the
    others fail with :class:`~asyncrefit.PackError` within it. Keep it below the
    coordinator's ``timeout``. Other arguments are :class:`~asyncrefit.LocalTrainer`'s.

    Resource handling and error handling: as :class:`~asyncrefit.LocalTrainer`; a
    placement that cannot be gathered (``Partial``, strided shards) is a
    :class:`~asyncrefit.PackError` naming the parameter.
    """

    _gathers = True
    _writes_direct = False  # every rank gathers each bucket: staged only

    def __init__(
        self,
        parameters: TensorsLike,
        *,
        exporter: Exporter | None = None,
        devices: Iterable[DeviceId | str] | None = None,
        node: str | None = None,
        name: str | None = None,
        names: NamesLike | None = None,
        timeout: float = 60.0,
        checkpoint_names: bool = True,
    ) -> None:
        super().__init__(
            parameters,
            exporter=exporter,
            devices=devices,
            node=node,
            name=name if name is not None else _default_name(),
            names=names,
            checkpoint_names=checkpoint_names,
        )
        self._timeout = timeout
        # The rows of a sharded tensor gathered last, while a bucket is packed:
        # ((id, lo, hi, dtype), the tensor, the rows).
        self._rows: tuple[tuple[int, int, int, Any], Any, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"<DTensorSource {self._name!r} node={self._node} exporter={self._exporter!r}>"

    def _fill(self, bucket: Bucket, buffer: torch.Tensor) -> list[torch.Tensor]:
        try:
            return super()._fill(bucket, buffer)
        finally:
            self._rows = None  # the rows gathered last are not kept between buckets

    def _copy_into(self, dst: torch.Tensor, tensor: torch.Tensor | Lazy, name: str) -> None:
        if isinstance(tensor, Lazy):
            tensor.copy_into(
                dst, lambda out, source, piece: self._copy_piece(out, source, piece, name)
            )
        else:
            gather_into(tensor, dst, timeout=self._timeout, name=repr(name))

    def _copy_piece(self, out: torch.Tensor, source: Any, piece: Piece, name: str) -> None:
        """Write ``piece`` of ``source`` into ``out``: gather only the rows it reads.

        Rows read as they are go straight into ``out``; otherwise they are gathered
        into a temporary, kept until the next piece that reads other rows (so that one
        expert's ``w1`` and ``w3`` of a fused ``gate_up`` gather its rows once).
        """
        import torch

        if is_plain(source):
            out.copy_(view_of(source, piece))
            return
        if not piece.source_shape:  # a scalar: gather it whole
            whole = torch.empty((), dtype=out.dtype, device=out.device)
            gather_into(source, whole, timeout=self._timeout, name=repr(name))
            out.copy_(whole)
            return
        lo, hi = piece.rows()
        if piece == Piece.of(piece.source, piece.source_shape).narrow(lo, hi):
            if out.is_contiguous():
                gather_rows_into(source, lo, hi, out, timeout=self._timeout, name=repr(name))
                return
        key = (id(source), lo, hi, out.dtype)
        rows = self._rows
        if rows is None or rows[0] != key or rows[1] is not source:
            self._rows = None
            temp = torch.empty(
                (hi - lo, *piece.source_shape[1:]), dtype=out.dtype, device=out.device
            )
            gather_rows_into(source, lo, hi, temp, timeout=self._timeout, name=repr(name))
            rows = self._rows = (key, source, temp)
        out.copy_(view_of(rows[2], piece.within(lo)))
