"""On the GPU: overlap scheduling and CUDA graphs change no greedy output (bf16, FlashInfer)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_overlap_and_graphs_do_not_change_outputs(tmp_path):
    pytest.importorskip("flashinfer")
    from tpserve import LLM, SamplingParams
    from tpserve.tiny import make_tiny_model

    model = make_tiny_model(str(tmp_path / "m"), "qwen3", hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128)
    prompts = [[3 + i, 4 + i, 5 + i] * (1 + i % 5) for i in range(24)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=8 + i, ignore_eos=True) for i in range(24)]
    results = {}
    for overlap in (False, True):
        for graph_bs in (0, 32):
            llm = LLM(model, device="cuda", dtype="bfloat16", disable_overlap=not overlap, cuda_graph_max_bs=graph_bs)
            results[(overlap, graph_bs)] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            llm.close()
    base = results[(False, 0)]
    for key, tokens in results.items():
        assert [len(t) for t in tokens] == [8 + i for i in range(24)], key
        same = sum(a == b for a, b in zip(tokens, base))
        assert same >= 23, f"{key}: only {same}/24 requests identical to overlap off, graphs off"


@pytest.mark.parametrize("graphs", [0, 16], ids=["eager", "graphs"])
def test_launch_does_not_wait_for_the_device(tmp_path, graphs):
    """Overlap scheduling needs ``Engine.launch`` to enqueue a step without waiting for the step
    in flight. With the device kept busy by a long sleep kernel, a decode step's launch
    (attention planning, input copies, graph replay or eager kernels, sampling, result copies)
    must return long before the sleep ends. A blocking copy anywhere on that path (FlashInfer's
    graph planner used to make one) waits for the sleep instead."""
    pytest.importorskip("flashinfer")
    import time

    from tpserve.engine_config import EngineConfig
    from tpserve.engine.engine import Engine
    from tpserve.engine.sampler import SamplingBatch
    from tpserve.forward import SequenceInput
    from tpserve.kvcache.pool import PageAllocator
    from tpserve.sampling_params import SamplingParams
    from tpserve.tiny import make_tiny_model

    model = make_tiny_model(str(tmp_path / "m"), "qwen3", hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128)
    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", cuda_graph_max_bs=graphs,
                                 max_total_tokens=4096, page_size=16))
    allocator = PageAllocator(engine.num_pages)
    seqs = [SequenceInput([5 + i], 40 + i, allocator.allocate(3)) for i in range(3)]

    def sampling() -> SamplingBatch:  # built per step, as the scheduler does (its copies count)
        params = [SamplingParams(temperature=0.7)] * 3
        return SamplingBatch.build(params, [0, 1, 2], [0, 0, 0], engine.model_config.vocab_size, engine.device)

    engine.launch(seqs, sampling()).result()  # compiled, planned once

    start = time.perf_counter()
    torch.cuda._sleep(2_000_000_000)  # about a second of device time
    handle = engine.launch(seqs, sampling())
    launched = time.perf_counter() - start
    handle.result()
    finished = time.perf_counter() - start
    assert finished > 0.3, f"the sleep kernel was too short to test anything ({finished:.3f} s)"
    assert launched < 0.25 * finished, f"launch took {launched:.3f} s of a {finished:.3f} s device step: it waited"
