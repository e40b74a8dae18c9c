"""One rank's engine: device, communication, sharded model, KV cache, forward and sampling."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tpserve.attention.factory import create_backend
from tpserve.config import ModelConfig, resolve_dtype
from tpserve.engine_config import DEFAULT_CPU_KV_TOKENS, EngineConfig
from tpserve.distributed.comm import init_process_groups
from tpserve.distributed.info import set_tp_info
from tpserve.distributed.nodes import NodeGroup, NodeLayout
from tpserve.engine.batch import build_forward_inputs, lora_batch, one_token_rows, upload
from tpserve.engine.cuda_graph import CUDAGraphRunner
from tpserve.engine.logit_edits import PenaltyState
from tpserve.engine.side_copies import SideCopies
from tpserve.engine.sampler import Sampler, SamplingBatch
from tpserve.forward import ForwardContext, SequenceInput, resolve_future_tokens
from tpserve.kernels import use_triton
from tpserve.kvcache.pool import KVCachePool, kv_cache_dtype
from tpserve.layers.linear import ParallelLinear
from tpserve.layers.moe import StackedExperts, holds_whole_experts
from tpserve.engine.lora_slots import LoadedAdapter, LoRASlots
from tpserve.models.adapters import attach_lora, clear_slot, install_adapter, read_adapter, read_adapter_config
from tpserve.models.decoder import CausalLM
from tpserve.models.loader import load_model_weights, quantize_model
from tpserve.quant.config import resolve_quantization
from tpserve.sampling_params import SamplingParams
from tpserve.structured import mask as grammar_mask

logger = logging.getLogger(__name__)



DEFAULT_WARM_UP_TOKENS = 8192  # the largest warm-up prefill without chunked prefill


def prefill_warm_up_sizes(largest: int, top_k: int | None, row_bounds: tuple[int, ...] = ()) -> list[int]:
    """Prompt lengths whose prefills compile every variant Triton makes of tpserve's prefill kernels: it
    specializes integer arguments (token and row counts) on divisibility by 16, so an even and an odd count, and
    a mixture-of-experts layer's grouped GEMM has a tile per bucket of tokens x top k rows, up to each of
    ``row_bounds`` (``kernels.moe.tile_row_bounds``) and past the last."""
    sizes = {largest, largest - 1}
    if top_k is not None:
        for rows in row_bounds:
            sizes |= {rows // top_k, rows // top_k - 1}
    return sorted(t for t in sizes if 2 <= t <= largest)


@dataclass(eq=False)
class LaunchedStep:
    """A step's sampled tokens (and, when asked, log-probabilities), copied to the host in the background."""

    host: dict[str, torch.Tensor]
    done: torch.cuda.Event | None
    _tokens: list[int] | None = None

    def result(self) -> list[int]:
        """The tokens by row, once the device has them."""
        if self._tokens is None:
            if self.done is not None:
                self.done.synchronize()
            self._tokens = self.host["tokens"].tolist()
        return self._tokens

    def logprobs(self, prefix: str = "") -> tuple[list[float], list[list[int]], list[list[float]]] | None:
        """(sampled token's logprob, top ids, top logprobs) per row; call after ``result``. With
        ``prefix="prompt_"``: per extra logits row (``SequenceInput.extra_logits``), for its target."""
        if prefix + "logprobs" not in self.host:
            return None
        return tuple(self.host[prefix + name].tolist() for name in ("logprobs", "top_ids", "top_logprobs"))

    def ranks(self, prefix: str = "") -> list[int]:
        """Each row's sampled token's rank in the vocabulary (``prefix="prompt_"``: each extra logits row's
        target's); call after ``result``, where ``logprobs`` gives values."""
        return self.host[prefix + "ranks"].tolist()

    def pooled(self) -> list[bytes]:
        """The pooled sequences' hidden states as little-endian float32 bytes, in batch order; call after ``result``."""
        pooled = self.host.get("pooled")
        return [] if pooled is None else [row.numpy().astype("<f4").tobytes() for row in pooled]


@dataclass
class PromptLogprobs:
    """What a step's extra logits rows predict: ``targets`` [E] (on the device), and how many of the
    most likely tokens to return at each."""

    targets: torch.Tensor
    top: int


# A forward's logits and the final hidden states of its pooled sequences (``SequenceInput.pooled``; None: none)
Forwarded = tuple[torch.Tensor, torch.Tensor | None]


@dataclass
class PreparedStep:
    """A step whose host work is done and whose uploads are enqueued (``Engine.prepare``)."""

    run: Callable[[torch.Tensor | None], Forwarded]  # the previous step's samples -> logits (and pooled rows)
    has_futures: bool  # its tokens include placeholders for the previous step's samples
    sampling: SamplingBatch
    top_logprobs: int | None
    prompt_logprobs: PromptLogprobs | None = None
    # speculative decoding: the extra logits rows sampled (each draft's position), after the sequences' rows, and
    # with prompt log-probabilities in the same step the extra rows those are
    draft_rows: torch.Tensor | None = None
    prompt_rows: torch.Tensor | None = None


@dataclass
class PendingSample:
    """A step whose forward is enqueued and whose sampling waits for ``Engine.sample``."""

    logits: torch.Tensor  # [B (+ D), vocab]: the sequences' last tokens (then the draft positions')
    sampling: SamplingBatch
    top_logprobs: int | None
    prompt_logits: torch.Tensor | None = None  # [E, vocab]: the extra rows
    prompt_logprobs: PromptLogprobs | None = None
    pooled: torch.Tensor | None = None  # [P, hidden]: the hidden states of the pooled sequences


def compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int, ranks: bool = False
) -> dict[str, torch.Tensor]:
    """Log-probabilities under the model (raw logits, before temperature and filters); ``ranks``: also each
    token's rank among the vocabulary (1: the most likely; tied tokens all take the worse rank, as vLLM counts them)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top_logprobs, top_ids = logprobs.topk(top_n, dim=-1)  # top_n 0 gives empty [B, 0] tensors
    chosen = logprobs.gather(1, tokens[:, None])
    out = {"logprobs": chosen.squeeze(1), "top_ids": top_ids, "top_logprobs": top_logprobs}
    if ranks:
        out["ranks"] = (logprobs >= chosen).sum(dim=1)
    return out


def resolve_device(device: str | None, rank: int, first_gpu: int = 0) -> torch.device:
    """``rank``: the local rank on its node; its GPU is ``cuda:first_gpu + rank`` (a data-parallel
    replica's ranks start at its own first GPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device cuda was asked for but CUDA is not available")
        index = first_gpu + rank
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"tp rank {rank} needs cuda:{index} but only {torch.cuda.device_count()} GPUs are visible")
        return torch.device(f"cuda:{index}")
    return torch.device("cpu")


class Engine:
    def __init__(self, config: EngineConfig, rank: int = 0, nodes: NodeGroup | None = None) -> None:
        """``nodes``: the multi-node group this rank joined (``NodeGroup.join``); None on one node."""
        self.config = config
        self.tp = set_tp_info(rank, config.tp_size, config.expert_parallel)  # before any layer is built
        layout = NodeLayout.of(config)
        self.device = resolve_device(config.device, layout.local_rank(rank), config.dp_rank * layout.ranks_per_node)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif layout.ranks_per_node * config.dp_size > 1:  # ranks (of every replica) share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // (layout.ranks_per_node * config.dp_size)))
        self.model_config = config.load_model_config()
        self.model_config.check_tp_size(config.tp_size, expert_parallel=config.expert_parallel)
        self.max_model_len = config.max_model_len or self.model_config.context_length
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        if config.tp_size > 1 and config.dist_init_addr is None:
            raise ValueError("tp_size > 1 needs dist_init_addr (tcp://host:port chosen by the parent)")
        if config.nnodes > 1 and nodes is None:
            raise ValueError("a multi-node rank's engine needs the NodeGroup it joined")
        all_reduce = "nccl" if config.nnodes > 1 else config.all_reduce  # peer GPU memory stays on one node
        self.comm, self.cpu_group = init_process_groups(
            rank, config.tp_size, config.dist_init_addr or "", self.device, self.dtype, all_reduce,
            store=nodes and nodes.store, timeout_s=nodes and nodes.startup_timeout_s,
        )

        self.quantization = resolve_quantization(config.quantization, self.model_config.quantization)
        with torch.device("meta"):
            self.model = CausalLM(self.model_config, self.comm, self.max_model_len)
        if self.quantization is not None:
            quantize_model(self.model, self.quantization)
        load_model_weights(
            self.model, config.model, config.load_format, self.device, self.dtype, config.seed, show_progress=rank == 0
        )
        self.model.eval()
        self.loras = LoRASlots(config.lora_slots)
        self.lora_layers = (attach_lora(self.model, config.lora_slots, config.max_lora_rank, self.device, self.dtype)
                            if config.lora_slots else {})
        for name, path in config.lora_modules:
            self.load_lora(name, path)
        if self.device.type == "cuda" and self.quantization is not None:
            self._warm_up_fp8_gemms()  # before the KV cache takes the free memory
        if nodes is not None:  # nodes load at their own pace; the collectives below have a deadline
            nodes.barrier("loaded")

        attn = self.model.model.layers[0].self_attn
        self.num_kv_heads, self.num_heads = attn.num_kv_heads, attn.num_heads
        self.page_size = config.page_size
        self.num_pages = self._count_pages()
        head_dim = self.model_config.head_dim
        self.kv_pool = KVCachePool(
            self.model_config.num_hidden_layers, self.num_pages, self.page_size, self.num_kv_heads, head_dim,
            kv_cache_dtype(config.kv_cache_dtype, self.dtype), self.device, compute_dtype=self.dtype,
        )
        self.rows_per_sequence = 1 + config.speculative_tokens  # of a decode batch (engine/batch.py one_token_rows)
        self.attention = create_backend(
            config.attention_backend, self.kv_pool, self.num_heads, self.num_kv_heads, head_dim, self.device,
            self._fused_rope_store(), config.decode_attention, scale=self.model_config.attention_scale,
            layer_windows=self.model_config.windows_within(self.max_model_len),
            softcap=self.model_config.attn_logit_softcapping, rows_per_sequence=self.rows_per_sequence,
        )
        self.sampler = Sampler()
        self.penalty_state = PenaltyState(self.model_config.vocab_size, self.device)
        self.copies = SideCopies(self.device) if self.device.type == "cuda" else None
        self.graph_runner = self._capture_cuda_graphs()
        if self.device.type == "cuda":
            if use_triton(self.device):
                self._warm_up_prefill()
            self._warm_up_sampler()
        self._last_tokens: torch.Tensor | None = None  # the last launched step's samples
        self._mask_device: torch.Tensor | None = None  # grammar masks on the device (GPU)
        if rank == 0:
            logger.info(
                "engine ready: %s on %s, %s%s, tp %d%s, %s, %d KV pages of %d tokens, CUDA graphs %s",
                self.model_config.architecture, self.device, self.dtype, self._quantization_note(), config.tp_size,
                " (expert parallel: whole experts per rank)" if holds_whole_experts(self.model) else "",
                self.attention.describe(), self.num_pages - 1, self.page_size,
                f"up to batch {self.graph_runner.max_batch_size}" if self.graph_runner else "off",
            )
            if self.model_config.labels:
                logger.info("a sequence classifier of %d class(es) %s: it serves classification only",
                            len(self.model_config.labels), list(self.model_config.labels[:8]))
            elif not self.model_config.lm_head:
                logger.info("the checkpoint has no LM head: it serves embeddings only")

    def load_lora(self, name: str, path: str) -> LoadedAdapter:
        """Read a PEFT adapter's shard into host memory (a ValueError says why it cannot be served)."""
        self.loras.check_new(name)
        config = read_adapter_config(path, self.config.max_lora_rank)
        weights = read_adapter(self.lora_layers, path, config, pin=self.device.type == "cuda")
        return self.loras.add(name, path, weights)

    def place_lora(self, slot: int, adapter: LoadedAdapter) -> None:
        """Give ``adapter`` ``slot`` (``loras.slot_for``'s), copying it in unless the slot holds it already."""
        if self.loras.place(slot, adapter):
            install_adapter(self.lora_layers, slot, adapter.weights)

    def release_lora_slot(self, slot: int) -> None:
        """An unloaded adapter's slot, used by no request any more, is zeroed and free again."""
        clear_slot(self.lora_layers, slot)
        self.loras.release(slot)

    def _quantization_note(self) -> str:
        quant = self.quantization
        if quant is None:
            return ""
        gemms = sorted({m.fp8_backend for m in self.model.modules() if getattr(m, "weight_scale_inv", None) is not None})
        source = "checkpoint" if quant.prequantized else "quantized at load"
        form = f"FP8 GEMM {'/'.join(gemms)}" if gemms else "dequantized for this device"
        experts = [m for m in self.model.modules() if isinstance(m, StackedExperts)]
        if any(m.scales() is not None for m in experts):
            rows = ", a scale a row" if any(m.row_scales for m in experts) else ""
            form += f"; experts FP8{rows} (CUDA GEMV at one token, Triton above)"
        elif any(m.dequantized for m in experts):
            form += f"; experts dequantized to {str(self.dtype).removeprefix('torch.')}"
        scales = f"scales per {quant.scales}" if quant.row_scales else f"blocks {quant.block_size[0]}x{quant.block_size[1]}"
        return f", {quant.method} weights ({source}, {scales}, {form})"

    def _fused_rope_store(self) -> bool:
        """Whether layers take qkv to q and the KV cache in one Triton kernel (kernels.rope_store)."""
        if not use_triton(self.device):
            return False
        from tpserve.kernels import rope_store

        return rope_store.supported(self.model_config.head_dim, self.model.rotary.cos_sin_cache)

    def _capture_cuda_graphs(self) -> CUDAGraphRunner | None:
        # a drafted step's rows: up to 1 + drafts a sequence
        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_running_requests * self.rows_per_sequence)
        if self.device.type != "cuda" or max_bs <= 0 or not self.attention.supports_cuda_graphs:
            return None
        runner = CUDAGraphRunner(
            self.model, self.attention, self.page_size, self.max_model_len, max_bs, self.device, self.copies
        )
        runner.capture()
        return runner

    def _warm_up_fp8_gemms(self) -> None:
        """Compile FlashInfer's FP8 GEMMs for every prefill size now, not while serving (a machine's
        first launch: 105 s at Qwen3-8B on an H200, then 0.1 s; docs/benchmarks.md, FP8)."""
        from tpserve.kernels import fp8_linear

        start = time.perf_counter()
        max_tokens = max(self.config.chunked_prefill_size, self.config.max_running_requests)
        layers = [m for m in self.model.modules() if isinstance(m, ParallelLinear)]
        runs = fp8_linear.warm_up(layers, max_tokens, show_progress=self.tp.rank == 0)
        if runs == 0:
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        if self.tp.rank == 0:
            logger.info("FP8 GEMMs warmed up to %d tokens (%d runs) in %.1f s", max_tokens, runs, time.perf_counter() - start)

    def _warm_up_prefill(self) -> list[int]:
        """Compile the prefill steps' Triton kernels now, not on the first requests (on a machine's first start;
        Triton keeps them on disk): one prompt of each of ``prefill_warm_up_sizes`` tokens, on pages no request
        holds yet. Qwen3-30B-A3B's workload A on an H200 paid a compile inside a 3,563-token step (902 ms against
        ~170; session 30). Returns the sizes run."""
        start = time.perf_counter()
        largest = self.config.chunked_prefill_size if self.config.chunked_prefill_size > 0 else DEFAULT_WARM_UP_TOKENS
        largest = min(largest, (self.num_pages - 1) * self.page_size, self.max_model_len)
        moe = self.model_config.moe
        if moe is None:
            sizes = prefill_warm_up_sizes(largest, None)
        else:
            from tpserve.kernels.moe import tile_row_bounds  # Triton's: imported where the engine runs Triton kernels

            sizes = prefill_warm_up_sizes(largest, moe.top_k, tile_row_bounds())
        for tokens in sizes:
            pages = list(range(1, -(-tokens // self.page_size) + 1))  # page 0 is the scratch page
            self.forward([SequenceInput([0] * tokens, 0, pages)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.tp.rank == 0:
            logger.info("prefill kernels warmed up at %s tokens in %.1f s", sizes, time.perf_counter() - start)
        return sizes

    def _warm_up_sampler(self) -> None:
        """Compile the sampler's and grammar mask's kernels now, not on the first requests, on logits
        laid out as the LM head returns them (rows padded at TP > 1) and as logit edits do (float32)."""
        vocab = self.model_config.vocab_size
        padded = self.model.lm_head.weight.shape[0] * self.config.tp_size
        raw = torch.zeros((2, padded), dtype=self.dtype, device=self.device)[:, :vocab]
        edited = torch.zeros((2, vocab), dtype=torch.float32, device=self.device)
        allow_all = torch.full((2, -(-vocab // 32)), -1, dtype=torch.int32, device=self.device)
        for logits in (raw, edited):
            for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                           SamplingParams(temperature=1.0, top_k=2, top_p=0.9)):
                batch = SamplingBatch.build([params] * 2, [0, 1], [0, 0], vocab, self.device)
                self.sampler(logits, batch)
                if self.sampler.fuses_mask(logits, batch):
                    self.sampler(logits, batch, allow_all)  # the variant reading grammar masks
            grammar_mask.warm_up(logits)
        torch.cuda.synchronize(self.device)

    def _count_pages(self) -> int:
        cfg = self.model_config
        page_bytes = KVCachePool.bytes_per_page(
            cfg.num_hidden_layers, self.page_size, self.num_kv_heads, cfg.head_dim,
            kv_cache_dtype(self.config.kv_cache_dtype, self.dtype),
        )
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1.0 - self.config.mem_fraction) * total
            pages = int(budget // page_bytes)
            if self.config.max_total_tokens is not None:
                pages = min(pages, -(-self.config.max_total_tokens // self.page_size))
        else:
            tokens = self.config.max_total_tokens or DEFAULT_CPU_KV_TOKENS
            pages = -(-tokens // self.page_size)
        pages += 1  # the scratch page
        if self.cpu_group is not None:  # every rank must have the same pool size
            count = torch.tensor([pages], dtype=torch.int64)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=self.cpu_group)
            pages = int(count.item())
        if pages < 2:
            raise RuntimeError(f"no memory left for the KV cache ({page_bytes} bytes per page)")
        return pages

    @torch.inference_mode()
    def forward(self, seqs: list[SequenceInput], previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One step over prefills and decodes alike: [B, vocab] float logits (overwritten by the next
        CUDA graph replay). A token id -(r + 1) stands for row r of ``previous_tokens`` (the last
        step's samples, still on the device): overlap scheduling plans a step before it knows them."""
        return self._prepare_forward(seqs)(previous_tokens)[0]

    def _prepare_forward(self, seqs: list[SequenceInput]) -> Callable[[torch.Tensor | None], Forwarded]:
        """``forward``'s host work and uploads; the returned function resolves the placeholder
        tokens and runs the model."""
        if self.graph_runner is not None:
            if self.graph_runner.can_run(seqs):
                replay = self.graph_runner.prepare(seqs)
                return lambda previous_tokens: (replay(previous_tokens), None)
            # a drafted step (speculative decoding's verify) in a decode graph, a row a token, rather than eagerly
            rows = one_token_rows(seqs, self.rows_per_sequence)
            if rows is not None and self.graph_runner.can_run(rows.seqs):
                replay, order = self.graph_runner.prepare(rows.seqs), upload(torch.from_numpy(rows.order), self.device)
                return lambda previous_tokens: (replay(previous_tokens)[order], None)
        meta = self.attention.prepare(seqs, self.device)
        inputs = build_forward_inputs(seqs, self.page_size, self.device, meta)
        lora = lora_batch(seqs, self.device)

        def run(previous_tokens: torch.Tensor | None) -> Forwarded:
            if previous_tokens is not None:
                inputs.input_ids = resolve_future_tokens(inputs.input_ids, previous_tokens)
            ctx = ForwardContext(inputs, self.attention, lora=lora)
            return self.model(ctx), ctx.pooled

        return run

    @torch.inference_mode()
    def prepare(
        self, seqs: list[SequenceInput], sampling: SamplingBatch, top_logprobs: int | None = None,
        prompt_targets: list[int] | None = None, prompt_top: int = 0, draft_rows: list[int] | None = None,
    ) -> PreparedStep:
        """A step's host work and uploads (overlapping the device's previous forward); ``start`` runs
        it. With ``top_logprobs`` (not None) it also returns every row's log-probabilities; with
        ``prompt_targets``, the token each extra logits row (``SequenceInput.extra_logits``, in order)
        predicts, those tokens' log-probabilities and the ``prompt_top`` most likely at each row. ``draft_rows``:
        the extra rows to sample too (speculative decoding's draft positions; ``sampling`` has a row for each,
        after the sequences'), the others being the prompt targets'."""
        has_futures = any(t < 0 for s in seqs for t in s.token_ids[:1])
        prompt = None
        if prompt_targets:
            prompt = PromptLogprobs(upload(torch.tensor(prompt_targets, dtype=torch.int64), self.device), prompt_top)
        drafts = prompt_rows = None
        if draft_rows:
            drafts = upload(torch.tensor(draft_rows, dtype=torch.int64), self.device)
            if prompt_targets:
                others = sorted(set(range(len(draft_rows) + len(prompt_targets))) - set(draft_rows))
                prompt_rows = upload(torch.tensor(others, dtype=torch.int64), self.device)
        return PreparedStep(self._prepare_forward(seqs), has_futures, sampling, top_logprobs, prompt, drafts,
                            prompt_rows)

    @torch.inference_mode()
    def start(self, step: PreparedStep) -> PendingSample:
        """Enqueue a prepared step's forward (reading the last sampled step's tokens); ``sample``
        follows at once or, with grammar masks, once they are filled (they need the previous step's
        tokens, which the host learns while this forward runs)."""
        logits, pooled = step.run(self._last_tokens if step.has_futures else None)
        if step.prompt_logprobs is None and step.draft_rows is None:
            return PendingSample(logits, step.sampling, step.top_logprobs, pooled=pooled)
        extra = (0 if step.prompt_logprobs is None else step.prompt_logprobs.targets.numel()) + (
            0 if step.draft_rows is None else step.draft_rows.numel())
        rows = logits.shape[0] - extra
        if step.draft_rows is None:
            sampled, prompt_logits = logits[:rows], logits[rows:]
        elif step.prompt_rows is None:  # every extra row is a draft's
            sampled, prompt_logits = logits, None
        else:
            extras = logits[rows:]
            sampled = torch.cat([logits[:rows], extras[step.draft_rows]])
            prompt_logits = extras[step.prompt_rows]
        return PendingSample(sampled, step.sampling, step.top_logprobs, prompt_logits, step.prompt_logprobs, pooled)

    def launch(self, seqs: list[SequenceInput], sampling: SamplingBatch) -> LaunchedStep:
        """``prepare``, ``start`` and ``sample`` one step (no log-probabilities)."""
        return self.sample(self.start(self.prepare(seqs, sampling)))

    @torch.inference_mode()
    def sample(self, pending: PendingSample, mask: torch.Tensor | None = None) -> LaunchedStep:
        """Edit the logits (penalties, bias, bans, then the grammar ``mask``: [B, ceil(V / 32)] int32
        in xgrammar's packed layout, on the host, pinned on a GPU), sample, and copy the tokens to
        the host in the background. Before the next forward (a graph replay overwrites the logits)."""
        logits, sampling, edits = pending.logits, pending.sampling, pending.sampling.edits
        edited = logits if edits is None else self.penalty_state.apply(logits, edits)
        bitmask = None
        if mask is not None:
            bitmask = self._mask_on_device(mask)
            if not self.sampler.fuses_mask(edited, sampling):
                if edited is logits and pending.top_logprobs is not None:
                    edited = logits.clone()  # log-probabilities are the model's, before the mask
                grammar_mask.apply_bitmask(edited, bitmask)
                bitmask = None
        tokens = self.sampler(edited, sampling, bitmask)
        self.penalty_state.record(tokens, edits)
        self._last_tokens = tokens
        outputs = {"tokens": tokens}
        if pending.top_logprobs is not None:  # before the next graph replay overwrites the logits
            outputs.update(compute_logprobs(logits, tokens, pending.top_logprobs, ranks=True))
        if pending.prompt_logprobs is not None:
            asked = pending.prompt_logprobs
            prompt = compute_logprobs(pending.prompt_logits, asked.targets, asked.top, ranks=True)
            outputs.update({"prompt_" + name: value for name, value in prompt.items()})
        if pending.pooled is not None:
            outputs["pooled"] = pending.pooled.float()
        if self.copies is None:
            return LaunchedStep(outputs, None)
        return LaunchedStep(*self.copies.download(outputs))

    def _mask_on_device(self, mask: torch.Tensor) -> torch.Tensor:
        """The bitmask where the logits are; on a GPU uploaded without blocking into a buffer reused
        every step (stream order keeps an upload after the previous step's use)."""
        if self.device.type != "cuda":
            return mask
        batch, words = mask.shape
        if self._mask_device is None or self._mask_device.shape[0] < batch:
            self._mask_device = torch.empty((max(batch, 64), words), dtype=torch.int32, device=self.device)
        bitmask = self._mask_device[:batch]
        bitmask.copy_(mask, non_blocking=True)
        return bitmask

    def shutdown(self) -> None:
        """Release the device memory (graphs, KV cache, weights) and the process groups."""
        self.graph_runner = None
        self.copies = None  # the side streams and their upload buffers
        self.kv_pool.k.clear()
        self.kv_pool.v.clear()
        self.model = None  # type: ignore[assignment]
        self._last_tokens = None
        close = getattr(self.comm, "close", None)
        if close is not None:  # the peer buffers go before the process group they were mapped through
            close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
