"""Step inputs built without Python loops over tokens, FlashInfer's page-table layout, CUDA-graph
batch sizes and attention backend selection: the CPU-checkable parts of the GPU path."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
import torch
from tpserve.attention.factory import create_backend, resolve_backend_name
from tpserve.attention.flashinfer_backend import paged_layout
from tpserve.engine.batch import build_forward_inputs, build_host_batch, one_token_rows
from tpserve.engine.cuda_graph import capture_sizes
from tpserve.forward import SequenceInput
from tpserve.kvcache.pool import KVCachePool


def reference_inputs(seqs: list[SequenceInput], page_size: int) -> tuple[list[int], ...]:
    ids, positions, slots, last = [], [], [], []
    for seq in seqs:
        ids.extend(seq.token_ids)
        for pos in range(seq.prefix_len, seq.seq_len):
            positions.append(pos)
            slots.append(seq.page_table[pos // page_size] * page_size + pos % page_size)
        last.append(len(ids) - 1)
    return ids, positions, slots, last


def random_seqs(rng: random.Random, page_size: int) -> list[SequenceInput]:
    seqs = []
    decode = rng.random() < 0.3  # one token a sequence: no head-row indices
    for _ in range(rng.randint(1, 6)):
        prefix, new = rng.randint(0, 40), 1 if decode else rng.randint(1, 30)
        pages = -(-(prefix + new) // page_size) + rng.randint(0, 3)  # tables may be longer
        seqs.append(SequenceInput([rng.randrange(100) for _ in range(new)], prefix, rng.sample(range(1, 500), pages)))
    return seqs


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_forward_inputs_match_per_token_reference(page_size):
    rng = random.Random(page_size)
    for _ in range(50):
        seqs = random_seqs(rng, page_size)
        inputs = build_forward_inputs(seqs, page_size, torch.device("cpu"), None)
        got = [t.tolist() for t in (inputs.input_ids, inputs.positions, inputs.out_slots)]
        expected = list(reference_inputs(seqs, page_size))
        if inputs.last_indices is None:  # decode: every token is a head row, in order
            assert expected[3] == list(range(len(seqs))) and all(len(s.token_ids) == 1 for s in seqs)
        else:
            got.append(inputs.last_indices.tolist())
            assert expected[3] != list(range(len(expected[0])))
        assert got == expected[: len(got)]


def test_forward_inputs_errors():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="too short for 20 tokens"):
        build_forward_inputs([SequenceInput([1] * 4, 16, [1])], 16, cpu, None)
    with pytest.raises(ValueError, match="at least one new token"):
        build_forward_inputs([SequenceInput([], 3, [1])], 16, cpu, None)
    with pytest.raises(ValueError, match="at least one sequence"):
        build_forward_inputs([], 16, cpu, None)


def test_paged_layout_and_padding():
    seqs = [SequenceInput([1, 2, 3], 14, [7, 9, 11]), SequenceInput([4], 0, [5, 6])]
    layout = paged_layout(seqs, 16, pad_to=4)
    assert layout.kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert layout.kv_indices.tolist() == [7, 9, 5, 0, 0]  # padding rows read the scratch page
    assert layout.last_page_len.tolist() == [1, 1, 1, 1]
    assert layout.qo_indptr.tolist() == [0, 3, 4, 5, 6]
    assert layout.kv_indptr.dtype == torch.int32 and layout.kv_indices.dtype == torch.int32
    with pytest.raises(ValueError, match="too short"):
        paged_layout([SequenceInput([1], 16, [3])], 16)


def test_capture_sizes():
    assert capture_sizes(0) == []
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and all(b - a == 8 for a, b in pairwise(sizes[4:]))


def test_backend_selection_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_backend_name("auto", cpu) == "torch"
    assert resolve_backend_name("flashinfer", cpu) == "flashinfer"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("xformers", cpu)
    pool = KVCachePool(1, 4, 16, 2, 128, torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_backend("flashinfer", pool, 4, 2, 128, cpu)


@pytest.mark.parametrize("lengths", [[1], [3], [1, 1, 1], [2, 5], [7, 1, 1, 4]])
def test_forward_inputs_start_16_byte_aligned(lengths):
    """Triton compiles one kernel variant per pointer alignment: whatever the token count, every
    index array must start aligned, or a new count would stall a step on a compile."""
    seqs = [SequenceInput(list(range(n)), 0, [1]) for n in lengths]
    inputs = build_forward_inputs(seqs, 16, torch.device("cpu"), None)
    assert (inputs.last_indices is None) == all(n == 1 for n in lengths)
    for tensor in (inputs.input_ids, inputs.positions, inputs.out_slots, inputs.last_indices):
        assert tensor is None or tensor.data_ptr() % 16 == 0


def test_one_token_rows_of_a_drafted_step():
    seqs = [SequenceInput([5, 6, 7], 14, [7, 9], extra_logits=2), SequenceInput([8], 3, [5]),
            SequenceInput([1, 2], 30, [4, 6], extra_logits=1)]
    rows = one_token_rows(seqs, 3)
    assert [(r.token_ids, r.prefix_len, r.page_table) for r in rows.seqs] == [
        ([5], 14, [7, 9]), ([6], 15, [7, 9]), ([7], 16, [7, 9]), ([8], 3, [5]), ([1], 30, [4, 6]), ([2], 31, [4, 6])]
    # the LM head rows the chunked step would give, in its order: last tokens, then the drafts' positions
    assert rows.order.tolist() == build_host_batch(seqs, 16).last_indices.tolist() == [2, 3, 5, 0, 1, 4]
    # each row's KV slot is the one the chunked step writes for that token
    assert build_host_batch(rows.seqs, 16).tokens.tolist() == build_host_batch(seqs, 16).tokens.tolist()
    assert one_token_rows(seqs, 2) is None  # a sequence of more rows than the graphs were built for
    assert one_token_rows(seqs, 1) is None  # no speculation
    assert one_token_rows([SequenceInput([5, 6, 7], 14, [7, 9], extra_logits=1)], 3) is None  # a token without logits
    assert one_token_rows([SequenceInput([5], 14, [7, 9])], 3) is None  # a plain decode batch: the graphs take it
    assert one_token_rows([SequenceInput([5, 6], 14, [7, 9], extra_logits=1, pooled=True)], 3) is None


def test_a_drafted_step_as_one_token_rows_gives_the_chunked_logits(qwen3_dir):
    from engine_scenario import drafted_step_logits
    from tpserve.engine.engine import Engine
    from tpserve.engine_config import EngineConfig

    engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", dtype="float32", max_total_tokens=1024, page_size=4))
    _, as_rows, chunked = drafted_step_logits(engine, [4, 0, 2, 1])
    assert as_rows.shape == chunked.shape == (4 + 7, engine.model_config.vocab_size)
    torch.testing.assert_close(as_rows, chunked, rtol=1e-4, atol=1e-4)
