"""KVLayout: the explicit, versioned description of a KV transfer payload.

Prefill and decode must agree on it exactly; block ids may differ (decode chose them).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch

# Bump when the payload's axis order or meaning changes; peers with different versions refuse
# to talk instead of silently scattering garbage into the KV cache.
KV_LAYOUT_VERSION = 1

# Wire codes for dtypes. Codes are part of the header format: never renumber, only append.
DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float8_e4m3fn": 4,
    "float8_e5m2": 5,
    "float64": 6,
}
DTYPE_NAMES: dict[int, str] = {code: name for name, code in DTYPE_CODES.items()}


class LayoutMismatchError(ValueError):
    """Two KV layouts (or a layout and a tensor) disagree; the message names every field."""


@dataclass(frozen=True)
class KVLayout:
    """Payload = one contiguous tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`.

    Axis 1 is K (0) and V (1). `num_blocks` varies per transfer; everything here is fixed per
    model and must match on both ends of a channel. Immutable, so any thread may share it.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"
    version: int = KV_LAYOUT_VERSION

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_CODES:
            raise ValueError(
                f"KVLayout.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_CODES)}"
            )
        if self.version != KV_LAYOUT_VERSION:
            raise ValueError(
                f"KVLayout.version {self.version} is not supported by this build "
                f"(supports {KV_LAYOUT_VERSION})"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype]

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block adds to the payload (K and V, all layers)."""
        return math.prod(self.payload_shape(1)) * self.element_size

    def payload_shape(self, num_blocks: int) -> tuple[int, ...]:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def payload_nbytes(self, num_blocks: int) -> int:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        return num_blocks * self.bytes_per_block

    def check_compatible(
        self, other: KVLayout, *, self_name: str = "local", other_name: str = "peer"
    ) -> None:
        """Raise LayoutMismatchError naming every field where `other` differs from this layout."""
        diffs = [
            f"{f.name} ({self_name}={getattr(self, f.name)!r}, "
            f"{other_name}={getattr(other, f.name)!r})"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise LayoutMismatchError("KV layout mismatch: " + "; ".join(diffs))

    def check_tensor(self, kv: torch.Tensor) -> int:
        """Validate a payload tensor against this layout and return its num_blocks.

        Contiguity is required rather than fixed up: a hidden `.contiguous()` would copy the
        whole KV of a request on the caller's thread.
        """
        if not isinstance(kv, torch.Tensor):
            raise ValueError(f"KV payload must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dim() != 6:
            raise ValueError(
                f"KV payload must have 6 dims [num_layers, 2, num_blocks, block_size, "
                f"num_kv_heads, head_dim], got shape {tuple(kv.shape)}"
            )
        num_blocks = kv.shape[2]
        expected = self.payload_shape(num_blocks)
        if tuple(kv.shape) != expected:
            raise ValueError(
                f"KV payload shape {tuple(kv.shape)} does not match layout {expected} "
                f"(num_layers={self.num_layers}, block_size={self.block_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim})"
            )
        if kv.dtype != self.torch_dtype:
            raise ValueError(
                f"KV payload dtype {kv.dtype} does not match layout dtype {self.dtype}"
            )
        if not kv.is_contiguous():
            raise ValueError("KV payload must be contiguous (gather blocks into one tensor first)")
        return num_blocks

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, int | str]) -> KVLayout:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown KVLayout fields from peer: {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]
