"""The seam between vLLM releases (``asyncrefit.vllm._compat``), without an engine.

The CPU tests run vLLM 0.32; 0.26 (the GPU machine's) lacks the weight-version label
and declares ``trainer_send_weights`` abstract. The engine calls must then leave the
label out, and asyncrefit's weight-transfer engine must be instantiable either way.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest

from asyncrefit.vllm import _compat, _ops

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm")
    from asyncrefit.vllm.worker import ChannelWeightTransferEngine

pytestmark = pytest.mark.timeout(60)


class FakeAsyncLLM:
    """Records the engine calls the ops make; ``update_weight_version`` only where the
    release has labels."""

    vllm_config = None

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    async def finish_weight_update(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("finish_weight_update", args, kwargs))

    async def update_weight_version(self, label: str) -> None:
        self.calls.append(("update_weight_version", (label,), {}))

    async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("collective_rpc", (method, *args), kwargs))


def test_the_installed_vllm_has_weight_version_labels() -> None:
    found = _compat.features()
    assert found.weight_versions  # 0.32: finish_weight_update(weight_version=)
    assert found.version.startswith("0.")


@pytest.mark.parametrize("labels", [True, False])
async def test_finish_sets_the_label_only_where_vllm_has_one(
    labels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_ops, "features", lambda: _compat.Features("x", weight_versions=labels))
    engine = FakeAsyncLLM()
    ops = _ops._AsyncLLMOps(engine, "abort")
    await ops.finish("7")
    await ops.set_label("incomplete-7")
    await ops.shutdown()
    if labels:
        assert engine.calls[:2] == [
            ("finish_weight_update", (), {"weight_version": "7"}),
            ("update_weight_version", ("incomplete-7",), {}),
        ]
    else:  # 0.26: finish_weight_update() takes no version, and there is no label to set
        assert engine.calls[:1] == [("finish_weight_update", (), {})]
        assert all(name != "update_weight_version" for name, _, _ in engine.calls)
    assert engine.calls[-1] == ("collective_rpc", ("asyncrefit_shutdown",), {})


def test_the_weight_transfer_engine_is_concrete_on_every_release() -> None:
    # vLLM 0.26 declares trainer_send_weights abstract: the class defines it itself.
    assert "trainer_send_weights" in vars(ChannelWeightTransferEngine)
    assert not inspect.isabstract(ChannelWeightTransferEngine)
    with pytest.raises(NotImplementedError, match="RefitCoordinator"):
        ChannelWeightTransferEngine.trainer_send_weights(iter(()), {})
