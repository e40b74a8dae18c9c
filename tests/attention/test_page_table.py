"""The dense page table that XQA and the Triton decode kernel read (``attention/page_table.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from tpserve.attention.page_table import dense_page_table
from tpserve.forward import SequenceInput


def test_rows_hold_each_sequences_pages_and_length():
    seqs = [SequenceInput([7], 0, [5]), SequenceInput([8], 16, [3, 9]), SequenceInput([9], 40, [4, 6, 2, 11])]
    table, lens = dense_page_table(seqs, page_size=16)
    assert lens.tolist() == [1, 17, 41]
    # 41 tokens need 3 pages: the table is as wide as the longest sequence needs, not its whole page list.
    assert table.tolist() == [[5, 0, 0], [3, 9, 0], [4, 6, 2]]
    assert table.dtype.name == lens.dtype.name == "int32"


def test_padding_rows_are_one_token_on_the_scratch_page():
    table, lens = dense_page_table([SequenceInput([1], 20, [7, 8])], page_size=16, pad_to=4)
    assert lens.tolist() == [21, 1, 1, 1]
    assert table.tolist() == [[7, 8], [0, 0], [0, 0], [0, 0]]
    table, lens = dense_page_table([], page_size=16, pad_to=2)  # a graph captured on padding alone
    assert (table.tolist(), lens.tolist()) == ([[0], [0]], [1, 1])


def test_short_page_table_is_an_error():
    with pytest.raises(ValueError, match="too short for 17 tokens"):
        dense_page_table([SequenceInput([1], 16, [3])], page_size=16)


def test_random_batches_against_a_row_by_row_table():
    """Random batches (page lists longer than needed, padding rows) against the table written one
    row at a time."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        batch, pad_to = int(rng.integers(0, 9)), int(rng.integers(0, 12))
        if batch == pad_to == 0:
            continue
        seqs = []
        for _ in range(batch):
            length = int(rng.integers(1, 100))
            pages = -(-length // 16) + int(rng.integers(0, 3))
            seqs.append(SequenceInput([1], length - 1, rng.integers(1, 999, pages).tolist()))
        table, lens = dense_page_table(seqs, page_size=16, pad_to=pad_to)
        rows = max(batch, pad_to)
        expected_lens = [s.seq_len for s in seqs] + [1] * (rows - batch)
        width = max(-(-n // 16) for n in expected_lens)
        expected = np.zeros((rows, width), dtype=np.int32)
        for row, seq in enumerate(seqs):
            n = -(-seq.seq_len // 16)
            expected[row, :n] = seq.page_table[:n]
        assert lens.tolist() == expected_lens
        assert np.array_equal(table, expected)
