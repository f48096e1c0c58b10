"""Which event loop asyncrefit's own entry points run on."""

from __future__ import annotations

from typing import Any


def backend_options() -> dict[str, Any]:
    """``anyio.run`` options: uvloop where it is installed, plain asyncio otherwise."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}
