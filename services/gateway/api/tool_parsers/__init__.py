"""Tool-call formats by family name, as --tool-call-parser selects them."""

from __future__ import annotations

from services.gateway.api.tool_parsers.base import ToolFormat
from services.gateway.api.tool_parsers.hermes import HermesFormat

FORMATS: dict[str, type] = {"hermes": HermesFormat}
OFF = "none"


def tool_format(name: str) -> ToolFormat | None:
    """The format called `name`; None for "none" (tool calling off). ValueError otherwise."""
    if name == OFF:
        return None
    if name not in FORMATS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join([*FORMATS, OFF])}, "
                         f"got {name!r}")
    return FORMATS[name]()
