"""StepInputs packs a step's int lists and padded tables into one buffer and hands back views
of it; on a CPU device the buffer is a new host tensor the lists were written into. (The pinned copy to a GPU is
checked by the gpu-marked test.)"""

from __future__ import annotations

import pytest
import torch

from engine.step_inputs import StepInputs, Table


def test_lists_and_tables_come_back_as_views_of_one_buffer():
    ids, table, lens = StepInputs(torch.device("cpu")).pack(
        [[5, 6, 7], Table([[1, 2], [3], []], width=3), [9, 8, 7]])
    assert ids.tolist() == [5, 6, 7]
    assert table.tolist() == [[1, 2, 0], [3, 0, 0], [0, 0, 0]]
    assert lens.tolist() == [9, 8, 7]
    assert ids.dtype == table.dtype == torch.long
    assert table.is_contiguous() and ids.untyped_storage().data_ptr() == \
        table.untyped_storage().data_ptr()


def test_a_table_pads_rows_and_cuts_blocks_past_its_width():
    (table,) = StepInputs(torch.device("cpu")).pack(
        [Table([[4, 5, 6, 7], [8]], width=2, fill=-1, num_rows=4)])
    assert table.tolist() == [[4, 5], [8, -1], [-1, -1], [-1, -1]]


def test_packing_into_a_given_buffer_writes_it_in_place():
    out = torch.full((10,), 99, dtype=torch.long)
    a, b = StepInputs(torch.device("cpu")).pack([[1, 2], Table([[3, 4]], width=3)], out=out)
    assert out.tolist() == [1, 2, 3, 4, 0, 99, 99, 99, 99, 99]
    assert a.data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match="do not fit"):
        StepInputs(torch.device("cpu")).pack([list(range(11))], out=out)


@pytest.mark.gpu
def test_pinned_copies_to_the_gpu_arrive_whole_step_after_step():
    inputs = StepInputs(torch.device("cuda"))
    for step in range(6):  # the two pinned buffers take turns, and grow
        values = list(range(step, step + 1000 * (step + 1)))
        got, table = inputs.pack([values, Table([[step, 1], [2]], width=3, num_rows=3)])
        assert got.is_cuda and got.tolist() == values
        assert table.tolist() == [[step, 1, 0], [2, 0, 0], [0, 0, 0]]


def test_float_settings_and_empty_parts_pack_in_the_buffers_dtype():
    temps, empty, table = StepInputs(torch.device("cpu"), torch.float64).pack(
        [[0.7, 1.0], [], Table([[0.5]], width=2, fill=-1.0, num_rows=2)])
    assert temps.dtype == torch.float64 and temps.tolist() == [0.7, 1.0]
    assert empty.numel() == 0
    assert table.tolist() == [[0.5, -1.0], [-1.0, -1.0]]
