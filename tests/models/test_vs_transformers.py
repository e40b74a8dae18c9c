"""The engine against transformers, float32 on the CPU: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from reference import hf_greedy, hf_logits
from tpserve import LLM, SamplingParams
from tpserve.engine_config import EngineConfig
from tpserve.forward import SequenceInput
from tpserve.engine.engine import Engine
from tpserve.kvcache.pool import PageAllocator

ARCHS = [
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True, "num_shards": 3}),
    ("qwen2", {"sliding_window": 8}),  # layer 0 attends to the whole context, layer 1 within 8 tokens
    ("llama", {}),  # with llama3 rope scaling
    ("mistral", {"num_kv_heads": 1, "sliding_window": 8}),  # every layer within 8 tokens
    ("qwen3_moe", {"num_layers": 3}),  # 8 experts, top-2, layer 0 dense (mlp_only_layers)
    ("qwen3_moe", {"num_experts_per_tok": 3, "norm_topk_prob": False, "mlp_only_layers": ()}),
    # a gated shared expert beside the routed ones, q/k/v biases, layer 0 dense, the top k not renormalised
    ("qwen2_moe", {"num_layers": 3, "norm_topk_prob": False}),
    ("mixtral", {}),  # every layer sparse, Mixtral's checkpoint names (block_sparse_moe, w1/w3/w2)
    ("olmoe", {"norm_topk_prob": False}),  # every layer sparse, q/k RMSNorms over the whole projections, the top k not renormalised
    # Granite 3's embedding, residual, attention and logits scalars; tied embeddings as Granite 3's
    ("granite", {"tie_word_embeddings": True}),
    ("phi3", {}),  # q/k/v and gate/up fused in the checkpoint, split before sharding
    # (1 + weight) and sandwich norms, GELU, sqrt(hidden) embedding, query_pre_attn_scalar, local (a window of 16
    # tokens) and global rotary (linear scaling), head_dim 32 of hidden 64 / 4 heads, tied embeddings as Gemma 3's
    ("gemma3_text", {"num_kv_heads": 1, "head_dim": 32, "tie_word_embeddings": True}),
    # Gemma 3's layer without q/k norms or a local rotary; local layers within 8 tokens; attention scores soft-capped at
    # 10 (transformers' eager attention), logits at 5
    ("gemma2", {"head_dim": 32}),
]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 137))]


def teacher_forced_logits(engine: Engine, ids: list[int], prefill: int) -> torch.Tensor:
    """Prefill ids[:prefill] then decode the rest one token per step (paged decode path),
    alongside a second, unrelated sequence so every step is a real batch."""
    allocator = PageAllocator(engine.num_pages)
    pages = allocator.allocate(-(-len(ids) // engine.page_size))
    other = [3, 1, 4, 1, 5, 9, 2, 6]
    other_pages = allocator.allocate(-(-(len(other) + len(ids)) // engine.page_size))
    rows = [engine.forward([SequenceInput(ids[:prefill], 0, pages), SequenceInput(other, 0, other_pages)])[0]]
    for pos in range(prefill, len(ids) - 1):
        step = [SequenceInput([ids[pos]], pos, pages), SequenceInput([7], len(other) + pos - prefill, other_pages)]
        rows.append(engine.forward(step)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("arch,kwargs", ARCHS, ids=lambda v: str(v))
def test_logits_and_greedy_match_transformers(tiny_model_factory, arch, kwargs):
    model_dir = tiny_model_factory(arch, **kwargs)
    engine = Engine(EngineConfig(model=model_dir, device="cpu", page_size=4))
    ids = list(range(30, 70))
    ours = teacher_forced_logits(engine, ids, prefill=9)
    ref = hf_logits(model_dir, ids)[8 : len(ids) - 1]
    err = (ours - ref).abs().max().item()
    print(f"{arch} {kwargs}: max logit error {err:.2e}")
    assert err < 1e-4, f"max logit error {err}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))

    llm = LLM(model_dir, device="cpu", page_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(model_dir, prompt, 16)
        assert out.finish_reason == "length"
    assert len({tuple(o.token_ids) for o in outs}) == len(outs), "the tiny model should not be degenerate"


@pytest.mark.parametrize(
    "tp_size,arch,kwargs,engine",
    [
        (2, "qwen3", {"vocab_size": 643}, {}),  # vocabulary split with padding
        (4, "qwen3", {"vocab_size": 643}, {}),  # 2 KV heads replicated over 4 ranks
        (2, "llama", {"num_shards": 2}, {}),
        (2, "qwen3_moe", {"num_layers": 3}, {}),
        (4, "qwen3_moe", {"num_layers": 3}, {}),
        # whole experts per rank (4, then 2 of 8); test_fp8 serves a width that TP cannot cut
        (2, "qwen3_moe", {"num_layers": 3}, {"expert_parallel": True}),
        (4, "qwen3_moe", {"num_layers": 3}, {"expert_parallel": True}),
        (2, "qwen2_moe", {"num_layers": 3, "norm_topk_prob": False}, {}),  # the shared expert split like a dense MLP
        (2, "qwen2_moe", {"num_layers": 3, "norm_topk_prob": False}, {"expert_parallel": True}),
        (2, "mixtral", {}, {}),
        (2, "mixtral", {}, {"expert_parallel": True}),
        (2, "olmoe", {"norm_topk_prob": False}, {}),  # the q/k norms' sums of squares all-reduced
        (4, "olmoe", {"norm_topk_prob": False}, {}),  # and the 2 KV heads' counted once though each is on 2 ranks
        (2, "olmoe", {"norm_topk_prob": False}, {"expert_parallel": True}),
        (2, "granite", {"tie_word_embeddings": True}, {}),  # the residual multiplier in each rank's o/down shard
        # each rank's rows of the fused q/k/v, the one KV head replicated, every layer within 8 tokens
        (2, "phi3", {"num_kv_heads": 1, "sliding_window": 8}, {}),
        # the sandwich norms' all-reduces before each norm, the one KV head replicated
        (2, "gemma3_text", {"num_kv_heads": 1, "head_dim": 32, "tie_word_embeddings": True}, {}),
        # a KV head a rank; the logits soft-capped after the all-gather of a vocabulary split with padding
        (2, "gemma2", {"head_dim": 32, "vocab_size": 643}, {}),
    ],
    ids=str,
)
def test_tensor_parallel_matches_transformers(tiny_model_factory, tp_size, arch, kwargs, engine):
    model_dir = tiny_model_factory(arch, **kwargs)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    with LLM(model_dir, tp_size=tp_size, device="cpu", page_size=8, **engine) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        sampled_tp = llm.generate(PROMPTS, sampled, use_tqdm=False)
    err = 0.0
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(model_dir, prompt, 12)
        ref = torch.log_softmax(hf_logits(model_dir, prompt + out.token_ids)[len(prompt) - 1 : -1], dim=-1)
        ref_chosen = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        err = max(err, (torch.tensor(out.token_logprobs) - ref_chosen).abs().max().item())
    print(f"tp {tp_size} {arch} {kwargs} {engine}: max log-probability error {err:.2e}")
    assert err < 1e-4, f"max log-probability error {err}"
    with LLM(model_dir, device="cpu", page_size=8) as single:
        sampled_one = single.generate(PROMPTS, sampled, use_tqdm=False)
    assert [o.token_ids for o in sampled_tp] == [o.token_ids for o in sampled_one]
