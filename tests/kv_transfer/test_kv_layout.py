"""KVLayout: payload geometry, compatibility errors that name fields, tensor validation."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import KVLayout, LayoutMismatchError

LAYOUT = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, block_size=16, dtype="bfloat16")


def test_payload_shape_and_bytes_follow_the_documented_axis_order():
    assert LAYOUT.payload_shape(5) == (3, 2, 5, 16, 4, 8)
    assert LAYOUT.bytes_per_block == 3 * 2 * 16 * 4 * 8 * 2
    assert LAYOUT.payload_nbytes(5) == 5 * LAYOUT.bytes_per_block
    assert LAYOUT.payload_nbytes(0) == 0
    assert LAYOUT.torch_dtype == torch.bfloat16


def test_check_compatible_names_each_mismatching_field_and_only_those():
    other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=32, dtype="bfloat16")
    with pytest.raises(LayoutMismatchError) as err:
        LAYOUT.check_compatible(other)
    assert str(err.value) == (
        "KV layout mismatch: num_kv_heads (local=4, peer=2); block_size (local=16, peer=32)"
    )
    LAYOUT.check_compatible(KVLayout.from_dict(LAYOUT.to_dict()))  # equal: no error


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"head_dim": 2.0}, "head_dim must be a positive int"),
        ({"dtype": "int8"}, "not supported"),
        ({"version": 2}, "version 2 is not supported"),
    ],
)
def test_invalid_layouts_are_refused(kwargs, message):
    base = dict(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
    with pytest.raises(ValueError, match=message):
        KVLayout(**{**base, **kwargs})


def test_check_tensor_returns_num_blocks_or_explains_the_problem():
    kv = torch.zeros(LAYOUT.payload_shape(7), dtype=torch.bfloat16)
    assert LAYOUT.check_tensor(kv) == 7
    with pytest.raises(ValueError, match=r"shape \(3, 2, 7, 16, 4, 4\) does not match"):
        LAYOUT.check_tensor(torch.zeros(3, 2, 7, 16, 4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        LAYOUT.check_tensor(kv.float())
    with pytest.raises(ValueError, match="contiguous"):
        LAYOUT.check_tensor(kv.transpose(0, 1).contiguous().transpose(0, 1))
