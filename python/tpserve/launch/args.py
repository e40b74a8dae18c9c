"""Command-line arguments of ``tpserve`` / ``python -m tpserve``."""

from __future__ import annotations

import argparse
import json
import os
import socket
from dataclasses import dataclass, field, fields
from collections.abc import Mapping
from typing import Any

from tpserve.config import DTYPE_ALIASES, ModelConfig
from tpserve.engine_config import (
    CHOICES, KV_CACHE_DTYPE_ALIASES, MAX_DIST_TIMEOUT_S, EngineConfig, check_can_start, check_nodes,
)
from tpserve.distributed.control import TOKEN_ENV, read_token
from tpserve.distributed.nodes import split_addr
from tpserve.pooling import ModelHead, model_head, task_problem
from tpserve.quant.config import QUANTIZATION_CHOICES
from tpserve.sampling_defaults import load_sampling_defaults
from tpserve.sampling_params import SEED_LIMIT
from tpserve.parsers.reasoning import REASONING_PARSERS
from tpserve.parsers.tool_calls import TOOL_CALL_PARSERS, detect_tool_parser
from tpserve.launch.tls import TLSFiles
from tpserve.launch.vllm_flags import add_vllm_flags, check_vllm_flags, task_problem_of_flags
from tpserve.launch.argtypes import (
    HelpFormatter, OneLineParser, fraction, human_int_at_least, int_at_least, json_object_arg, json_strings_arg, lora_module_arg, number,
    port, positive,
)
from tpserve.router.policy import LOAD_BALANCE_METHODS
from tpserve.tokenizer.loader import (
    check_chat_template, has_tokenizer_files, load_tokenizer, missing_tokenizer_message,
)
from tpserve.tokenizer.prepare import RESERVED_TEMPLATE_KWARGS

DEFAULT_SCHEDULER_ENTRY = "tpserve.scheduler.process:run_scheduler"
DEMO_MODEL_NAME = "tpserve-tiny-random"
API_KEY_ENV = "TPSERVE_API_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerArgs:
    """Everything the server needs: the engine's config plus the frontend's settings."""

    engine: EngineConfig
    served_model_name: str  # the first --served-model-name (the name responses carry)
    context_len: int  # prompt + completion tokens of one request
    vocab_size: int
    host: str = "127.0.0.1"
    port: int = 8000  # 0: pick a free port (logged)
    shell: bool = False
    num_tokenizers: int = 1
    api_key: str | None = None
    log_level: str = "info"
    log_file: str | None = None  # every process logs here instead of stderr (the shell sets it)
    demo_model: bool = False  # serving the built-in tiny random-weight model
    startup_warnings: tuple[str, ...] = ()  # found while parsing, logged once logging is set up
    scheduler_entry: str = DEFAULT_SCHEDULER_ENTRY  # "module:function" run once per TP rank (tests set another)
    model_aliases: tuple[str, ...] = ()  # the other --served-model-name values
    chat_template: str | None = None  # --chat-template's text (None: the model's own)
    trust_request_chat_template: bool = False  # a request's own chat_template is rendered (else a 400)
    default_chat_template_kwargs: dict[str, Any] | None = None  # under each request's chat_template_kwargs
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's: tool_choice "none" renders no tools
    tool_call_parser: str | None = None  # resolved from --tool-call-parser (auto: from the template)
    reasoning_parser: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: every request's logprobs name their tokens "token_id:N"
    enable_force_include_usage: bool = False  # vLLM's: every stream ends with its usage chunk
    enable_server_load_tracking: bool = False  # vLLM's: GET /load counts the calls in flight
    root_path: str = ""  # vLLM's (uvicorn's): the path prefix a proxy serves the API under
    tls: TLSFiles | None = None  # HTTPS (--ssl-certfile ...); None: plain HTTP
    enable_ssl_refresh: bool = False  # re-read the TLS files when they change
    allowed_origins: tuple[str, ...] = ()  # CORS: none (browsers on other origins are refused)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_request_bytes: int = 16 << 20
    max_sequences_per_request: int = 256  # prompts x n of one API call
    head: ModelHead = ModelHead()  # the model's hidden size and classes (pooled requests' answers)
    health_timeout: float = 60.0  # /health is 503 when a rank's (or tokenizer's) loop stalls this long
    request_timeout: float | None = None  # seconds one API call may take (None: no limit)
    load_balance_method: str = "cache_aware"  # how the router picks a data-parallel replica
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: POST /v1/load_lora_adapter and /v1/unload_lora_adapter are served
    allow_runtime_lora_updating: bool = False
    # sampling fields a request leaves unset get these (--generation-config: the model's generation_config.json)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def model_dir(self) -> str:
        return self.engine.model


def runtime_updating_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING as vLLM reads it (its envs.py): "1" or "true", any case."""
    return environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


def _default(name: str, cls: type = EngineConfig) -> Any:
    """A field's default: the CLI's defaults are those of EngineConfig and ServerArgs."""
    return next(f.default for f in fields(cls) if f.name == name)


def dtype_arg(text: str) -> str:
    """--dtype (of the server and of tpserve plan): auto, a dtype, or vLLM's spelling of one."""
    value = DTYPE_ALIASES.get(text, text)
    if value not in ("auto", *CHOICES["dtype"]):
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose auto, {', '.join(CHOICES['dtype'])}, or half, float, bf16)"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="tpserve",
        description="Serve an LLM with tensor parallelism behind an OpenAI-compatible HTTP API "
        "(or an interactive shell with --shell). Runs offline.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # --mem would otherwise silently mean --mem-fraction
        epilog="To choose --tp-size and --dp-size for a model and a machine before launching: "
        "python -m tpserve plan --help. To answer a file of OpenAI batch requests offline: "
        "python -m tpserve run-batch --help. A pasted `vllm serve MODEL ...` line runs as `tpserve serve MODEL ...`.",
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model", "--model-path", dest="model", default=None,
        help="local model directory, or a Hugging Face id (org/name) already in the local HF "
        "cache; default: a built-in tiny random-weight demo model",
    )
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) in the API; requests may use any, responses carry the first "
                       "(default: the model directory's name, or the Hugging Face id)")
    model.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="Jinja chat template to use instead of the model's own: a file, or the template "
                       "itself (text with {{ or {%%}, as vLLM takes it)")
    model.add_argument("--trust-request-chat-template", action="store_true",
                       help="render a request's own chat_template (vLLM's field; a 400 without this flag): the "
                       "template runs in Jinja's sandbox in the tokenizer workers, so only for trusted clients")
    model.add_argument("--default-chat-template-kwargs", type=json_object_arg, default=None, metavar="JSON",
                       help="chat template arguments every chat gets unless its request's chat_template_kwargs "
                       "set them (vLLM's and SGLang's flag), e.g. '{\"enable_thinking\": false}' to switch Qwen3's "
                       "thinking off by default; a request's reasoning_effort still switches it")
    model.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help="a chat with tool_choice \"none\" renders its prompt without the tools (vLLM's flag; "
                       "default: the tools are in the prompt, the model told not to call them)")
    model.add_argument("--tool-call-parser", choices=["auto", "none", *TOOL_CALL_PARSERS], default="auto",
                       help="how the model writes tool calls: hermes (Qwen2.5/Qwen3 <tool_call> JSON), "
                       "qwen3_coder (Qwen3-Coder's <function=...> XML, values typed by the tools' schemas), "
                       "llama3_json (Llama 3.1 JSON), mistral ([TOOL_CALLS] and a JSON array), pythonic (Llama "
                       "3.2/4 and Gemma 3 with vLLM's pythonic templates, ToolACE: [f(a=1), g(b=\"x\")]), granite "
                       "(Granite 3.x: <|tool_call|> and a JSON array), phi4_mini_json (Phi-4-mini with vLLM's "
                       "template: functools[...]); auto: from the chat template (<function= in it: qwen3_coder; "
                       "<|tool_call|>: granite; <tool_call>: hermes; [TOOL_CALLS]: mistral; functools[: "
                       "phi4_mini_json; [func_name1(: pythonic; <|python_tag|>, or tools with \"parameters\": "
                       "llama3_json; else none), none: no tool parsing (tool_choice required or named still work)")
    model.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                       help="split <think>...</think> into reasoning_content (qwen3, deepseek_r1), or Granite "
                       "3.2+'s 'Here is my thought process:' ... 'Here is my response:' (granite); default: reasoning "
                       "stays in content")
    model.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                       help="default sampling parameters for requests that leave them unset: auto takes "
                       "temperature, top_p, top_k, min_p and repetition_penalty from the model's "
                       "generation_config.json (Qwen3's: 0.6, 0.95, 20), and its max_new_tokens as a cap on "
                       "every request's max_tokens; DIR from DIR/generation_config.json, "
                       "vllm none (OpenAI's defaults: temperature 1, no top-p/top-k); default: auto")
    model.add_argument("--override-generation-config", type=json_object_arg, default=None, metavar="JSON",
                       help="default sampling parameters over --generation-config's, e.g. "
                       "'{\"temperature\": 0.5}' (the same five names and max_new_tokens; null drops one)")
    model.add_argument("--speculative-config", type=json_object_arg, default=None, metavar="JSON",
                       help="speculative decoding, as vLLM's flag: '{\"method\": \"ngram\", "
                       "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' drafts "
                       "the tokens that followed the latest earlier occurrence of a request's last 2-4 tokens and "
                       "checks them in one step (the same output, in fewer steps where text repeats its context); "
                       "optional disable_by_batch_size: no drafts while more requests run. A step with drafts is "
                       "waited for before the next is planned (overlap scheduling stays on for steps without)")
    model.add_argument("--hf-overrides", type=json_object_arg, default=None, metavar="JSON",
                       help="config.json keys to replace (top-level), as vLLM's flag; e.g. Qwen3-Reranker as the "
                       "cross-encoder it is: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                       "\"classifier_from_token\": [\"no\", \"yes\"]}' (its score: the softmax of the two tokens' "
                       "logits, yes)")
    model.add_argument("--load-format", choices=CHOICES["load_format"], default=_default("load_format"),
                       help="weights: safetensors files, or dummy (random, for benchmarks)")
    model.add_argument("--dtype", type=dtype_arg, default="auto",
                       help="compute dtype: auto (the checkpoint's dtype on GPU, float32 on CPU), float32, "
                       "bfloat16, float16 (also spelled half, float, bf16)")
    model.add_argument("--quantization", "-q", choices=QUANTIZATION_CHOICES, default=_default("quantization"),
                       help="fp8: quantize an unquantized checkpoint's linear weights (MoE experts too) to FP8 (e4m3, one scale "
                       "per 128x128 block) at load time. FP8 checkpoints (quantization_config in config.json) "
                       "are read as such without it; compressed-tensors (as vLLM takes it) only names an "
                       "llm-compressor checkpoint's format")
    model.add_argument("--lora-modules", nargs="+", type=lora_module_arg, default=(), metavar="NAME=PATH",
                       help="LoRA adapters (PEFT checkpoints) served beside the model, as vLLM's: a request whose "
                       "model is NAME runs with that adapter (chat, completions, responses); /v1/models lists them. "
                       "All are loaded at start; adapters and the base model share batches (CUDA graphs run only "
                       "batches without an adapter)")
    model.add_argument("--max-lora-rank", type=int_at_least(1), default=_default("max_lora_rank"),
                       help="the largest adapter rank served (each adapted layer holds this many rows an adapter)")
    model.add_argument("--enable-lora", action="store_true",
                       help="give the layers LoRA adapter slots (--max-loras) for adapters loaded at run time; the "
                       "--lora-modules adapters are served with or without it")
    model.add_argument("--max-loras", type=int_at_least(1), default=_default("max_loras"),
                       help="adapter slots in each adapted layer, as vLLM's: how many adapters one batch may use. Any "
                       "number are loaded (each in host memory); a request waits for a slot its adapter may take "
                       "(one no running request uses), and requests behind it go on")
    model.add_argument("--allow-runtime-lora-updating", action="store_true",
                       default=runtime_updating_allowed(),
                       help="serve vLLM's POST /v1/load_lora_adapter ({\"lora_name\", \"lora_path\"}: a PEFT "
                       "directory on the server) and /v1/unload_lora_adapter ({\"lora_name\"}), as vLLM does where "
                       "the environment sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (which turns this on); implies "
                       "--enable-lora. An unloaded adapter's requests "
                       "finish with it. Only for trusted clients: they name files on the server")
    model.add_argument("--max-model-len", "--context-length", dest="max_model_len", type=human_int_at_least(2),
                       default=None,
                       help="context limit (prompt + completion tokens), at most the model's; default: the "
                       "model's context length (max_position_embeddings, extended by YaRN or linear rope scaling); "
                       "vLLM's 32k (32,000) and 32K (32,768) are taken too")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM/SGLang compatibility and ignored: tpserve runs no code from "
                       "model repositories (only the architectures it implements)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--tp-size", "--tensor-parallel-size", "--tp", "-tp", dest="tp_size",
                        type=int_at_least(1), default=_default("tp_size"),
                        help="tensor-parallel size: number of GPUs (processes) the model is split over")
    engine.add_argument("--dp-size", "--data-parallel-size", "--dp", "-dp", dest="dp_size", type=int_at_least(1),
                        default=_default("dp_size"),
                        help="data-parallel replicas: independent TP groups (each --tp-size GPUs, its own "
                        "KV cache) behind one API server; replica d uses GPUs d*tp .. d*tp+tp-1")
    engine.add_argument("--expert-parallel", "--enable-expert-parallel", dest="expert_parallel", action="store_true",
                        help="mixture-of-experts models: put num_experts / --tp-size whole experts on each rank "
                        "instead of a slice of every expert's intermediate dim (attention and dense layers stay "
                        "tensor-parallel; one all-reduce per layer either way). Serves sizes that cannot cut "
                        "the experts, e.g. Qwen3-30B-A3B-FP8 at --tp-size 4 or Qwen3-235B-A22B-FP8 at 8, whose "
                        "FP8 blocks a cut would split. No effect on dense models")
    engine.add_argument("--load-balance-method", choices=LOAD_BALANCE_METHODS,
                        default=_default("load_balance_method", ServerArgs),
                        help="with --dp-size > 1, where each request goes: minimum_tokens (the replica "
                        "with the least outstanding tokens) or cache_aware (the same, counting the "
                        "prompt prefix a replica likely has cached as work it need not do)")
    engine.add_argument("--device", choices=["auto", *CHOICES["device"]], default="auto",
                        help="auto: cuda when available, else cpu")
    engine.add_argument("--max-running-requests", type=int_at_least(1), default=_default("max_running_requests"),
                        help="most requests decoded together")
    engine.add_argument("--page-size", type=int_at_least(1), default=_default("page_size"),
                        help="tokens per KV-cache page")
    engine.add_argument("--kv-cache-dtype", choices=CHOICES["kv_cache_dtype"], default=_default("kv_cache_dtype"),
                        type=lambda value: KV_CACHE_DTYPE_ALIASES.get(value, value),
                        help="KV-cache storage: auto (the compute dtype) or fp8_e4m3 (float8 e4m3 with a scale "
                        "of 1: half the bytes of bf16, so twice the tokens; read back in the compute dtype; vLLM's "
                        "fp8 is the same)")
    engine.add_argument("--mem-fraction", "--gpu-memory-utilization", "--mem-fraction-static",
                        dest="mem_fraction", type=fraction, default=_default("mem_fraction"),
                        help="share of each GPU's total memory tpserve may fill: the KV cache gets what is "
                        "left of it after the weights (and whatever else already uses the GPU)")
    engine.add_argument("--max-total-tokens", type=int_at_least(2), default=None,
                        help="KV-cache size in tokens (default: from --mem-fraction on GPU, "
                        "32768 on CPU)")
    engine.add_argument("--seed", type=number(int, lambda v: 0 <= v < SEED_LIMIT, "in [0, 2**63)"),
                        default=_default("seed"), help="seed of --load-format dummy's random weights (a request without a seed samples with a "
                        "random one)")
    engine.add_argument("--chunked-prefill-size", "--max-prefill-tokens", type=int,
                        default=_default("chunked_prefill_size"),
                        help="prefill tokens per step; longer prompts are split (<= 0: no chunking)")
    engine.add_argument("--mixed-prefill-tokens", type=int_at_least(0), default=_default("mixed_prefill_tokens"),
                        help="most prefill tokens a step that also decodes may carry; a step with more "
                             "prefill work runs it without the decodes, which wait one step (0: prefills "
                             "never share a step with decodes; --chunked-prefill-size: always mix)")
    engine.add_argument("--cache", "--prefix-cache", choices=CHOICES["cache"], default=_default("cache"),
                        help="prefix cache: radix (shared prefixes reuse KV pages) or naive (none)")
    engine.add_argument("--schedule-policy", choices=CHOICES["schedule_policy"], default=_default("schedule_policy"),
                        help="admission order: fcfs; lpm (longest cached prefix first); or priority (vLLM's: "
                             "requests' priority field, lowest first, then arrival; a running request of a higher "
                             "value is preempted first). Under fcfs and lpm a request's priority must be 0")
    engine.add_argument("--attention-backend", choices=CHOICES["attention_backend"],
                        default=_default("attention_backend"),
                        help="auto: flashinfer on CUDA in bfloat16/float16 when installed, else torch "
                        "(flashinfer takes no float32)")
    engine.add_argument("--decode-attention", choices=CHOICES["decode_attention"],
                        default=_default("decode_attention"),
                        help="decode kernel of the flashinfer backend: auto (on Hopper GPUs: XQA for an FP8 KV "
                        "cache, the decode wrapper where the model has sliding windows or an attention soft-cap; for bfloat16/float16 pages the Triton kernel up to 32 sequences a step and the "
                        "decode wrapper above; elsewhere FlashInfer's decode wrapper), flashinfer (always the "
                        "decode wrapper), xqa (always XQA; Hopper only), or triton (always tpserve's split-KV "
                        "Triton kernel; bfloat16/float16 pages)")
    engine.add_argument("--cuda-graph-max-bs", type=int_at_least(0), default=_default("cuda_graph_max_bs"),
                        help="largest decode batch captured in a CUDA graph, in rows: a sequence's speculative "
                        "verify step takes 1 + its drafts (0: no CUDA graphs)")
    engine.add_argument("--grammar-threads", type=int_at_least(0), default=_default("grammar_threads"),
                        help="most threads filling one step's grammar masks (structured output); a "
                        "thread per 64 constrained requests (0: auto, half the CPUs, at most 8)")
    engine.add_argument("--grammar-compile-timeout", type=positive, default=_default("grammar_compile_timeout"),
                        help="seconds a structured-output request waits for its JSON schema, regex or grammar to "
                        "compile; then it fails with a 400 naming this flag (the compile itself cannot be stopped)")
    engine.add_argument("--all-reduce", choices=CHOICES["all_reduce"], default=_default("all_reduce"),
                        help="TP all-reduce on GPU: auto (one-shot/two-shot kernels through peer GPU "
                             "memory for small messages, NCCL for large; NCCL only across nodes), nccl, "
                             "one kernel for every message that fits the peer buffer, or fused (auto, with "
                             "the all-reduce, residual add and RMSNorm in one kernel where they meet)")
    engine.add_argument("--disable-overlap", action="store_true",
                        help="do not overlap scheduling of the next step with the running one")
    engine.add_argument("--debug-check-invariants", action="store_true",
                        help="check every step that all TP ranks agree and that every KV page is "
                        "accounted for (slow; debugging)")
    nodes = p.add_argument_group("multi-node tensor parallelism (every node runs tpserve with the same flags "
                                 f"but --node-rank, and the same {TOKEN_ENV} in its environment)")
    nodes.add_argument("--nnodes", type=int_at_least(1), default=_default("nnodes"),
                       help="nodes the --tp-size ranks are spread over (--tp-size / --nnodes ranks, and GPUs, "
                       "a node)")
    nodes.add_argument("--node-rank", type=int_at_least(0), default=_default("node_rank"),
                       help="this node's index: 0 runs the HTTP server and ranks 0.., the others only their "
                       "ranks (no HTTP)")
    nodes.add_argument("--dist-init-addr", "--dist-init-address", dest="dist_init_addr", default=None,
                       metavar="HOST:PORT",
                       help="node 0's address on the network the nodes share: rank 0 serves the rendezvous "
                       "there and its message broadcast on a free port of that interface")
    dist_timeout = number(float, lambda v: 0 < v <= MAX_DIST_TIMEOUT_S, f"in (0, {MAX_DIST_TIMEOUT_S:,}] seconds")
    nodes.add_argument("--dist-timeout", type=dist_timeout, default=_default("dist_timeout"),
                       help="seconds a node may take to join, or be silent (heartbeats, collectives), before "
                       "every process of the job stops naming it")
    server = p.add_argument_group("server")
    server.add_argument("--host", default=_default("host", ServerArgs), help="HTTP bind address")
    server.add_argument("--port", type=port, default=_default("port", ServerArgs), help="HTTP port (0: any free port)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, /classify, "
                        "/score, /rerank, /v2/rerank, /flush_cache and /reset_prefix_cache (not /health, /ping, "
                        f"/metrics, /version) (env {API_KEY_ENV})")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="every request's logprobs name their tokens 'token_id:N' (as the request field of that "
                        "name asks for one request; vLLM's flag)")
    server.add_argument("--enable-force-include-usage", action="store_true",
                        help="every streamed answer ends with its usage, asked for or not (vLLM's flag)")
    server.add_argument("--root-path", default="",
                        help="the path prefix a reverse proxy serves the API under (uvicorn's root_path; vLLM's flag); "
                        "default: none")
    tls = p.add_argument_group("TLS (vLLM's flags)", "serve HTTPS (uvicorn's TLS)")
    tls.add_argument("--ssl-certfile", default=None, help="the server's certificate (PEM; the chain after it); turns "
                     "HTTPS on")
    tls.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM), unless --ssl-certfile "
                     "holds it")
    tls.add_argument("--ssl-ca-certs", default=None, help="the CA certificates client certificates are checked against")
    tls.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=0, help="client certificates: 0 not asked for (default), 1 checked when "
                     "given, 2 required (needs --ssl-ca-certs)")
    tls.add_argument("--ssl-ciphers", default=None, help="the TLS cipher list (OpenSSL's syntax; default: uvicorn's)")
    tls.add_argument("--enable-ssl-refresh", action="store_true", help="re-read the certificate, key and CA files "
                     "when they change (checked every second): a renewed certificate is served without a restart")
    server.add_argument("--allowed-origins", type=json_strings_arg, default=(), metavar="JSON",
                        help="CORS: the browser origins allowed to call the API, e.g. '[\"https://app.example\"]' "
                        "or '[\"*\"]' (vLLM's flag; vLLM allows every origin by default, tpserve none)")
    server.add_argument("--allowed-methods", type=json_strings_arg, default=("*",), metavar="JSON",
                        help="CORS: the methods allowed to those origins (default: '[\"*\"]')")
    server.add_argument("--allowed-headers", type=json_strings_arg, default=("*",), metavar="JSON",
                        help="CORS: the request headers allowed to those origins (default: '[\"*\"]')")
    server.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let those origins send credentials (cookies, Authorization)")
    server.add_argument("--max-request-bytes", type=int_at_least(1024), default=_default("max_request_bytes", ServerArgs),
                        help="largest request body in bytes; larger ones get 413 before they are read")
    server.add_argument("--max-sequences-per-request", type=int_at_least(1),
                        default=_default("max_sequences_per_request", ServerArgs),
                        help="most sequences (prompts x n) one API call may start")
    server.add_argument("--health-timeout", type=positive, default=_default("health_timeout", ServerArgs),
                        help="seconds a scheduler rank, a tokenizer or the detokenizer may go without finishing a "
                        "loop iteration before /health answers 503 naming it (a stuck or stopped process)")
    server.add_argument("--request-timeout", type=positive, default=None,
                        help="seconds one API call may take; then it is aborted with a 504 (default: no limit)")
    server.add_argument("--num-tokenizers", type=int_at_least(1), default=_default("num_tokenizers", ServerArgs),
                        help="tokenizer worker processes")
    server.add_argument("--shell", action="store_true",
                        help="chat in the terminal instead of serving HTTP")
    server.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=_default("log_level", ServerArgs), help="logging level")
    add_vllm_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse and validate; a bad value exits with a usage error that names it."""
    return parse_with(build_parser(), argv)[0]


def parse_with(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[ServerArgs, argparse.Namespace]:
    """``parse_args`` with ``build_parser``'s parser grown by a command's own flags, found in the namespace."""
    ns = parser.parse_args(argv)
    try:
        return _to_server_args(ns), ns
    except (ModelNotFound, ValueError, KeyError, OSError) as e:
        parser.error(str(e))  # exits with status 2


class ModelNotFound(ValueError):
    """--model (LLM's model) is no local directory and no Hugging Face id in the local cache."""


def resolve_model_dir(model: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """The local directory holding ``model``'s files (a directory, or a Hugging Face id already in
    the local cache: ``cache_dir``, else the default one, at ``revision``). tpserve never downloads anything."""
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded)
    if os.path.exists(expanded):
        raise ModelNotFound(f"model path {model!r} is not a directory")
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelNotFound(f"model {model!r} is not a local directory (nor a Hugging Face id like 'org/name')")
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except Exception as e:  # LocalEntryNotFoundError, or an invalid repo id
        raise ModelNotFound(
            f"model {model!r} is not a local directory and is not in the local Hugging Face "
            f"cache ({cache_dir or constants.HF_HUB_CACHE}); tpserve runs offline and never downloads. Download it "
            f"where there is internet (e.g. `hf download {model}`) into that cache, "
            f"or pass the model's local directory ({type(e).__name__})"
        ) from e


def _tokenizer_dir(ns: argparse.Namespace) -> str:
    try:
        return resolve_model_dir(ns.tokenizer, ns.revision, ns.download_dir)
    except ModelNotFound as e:
        raise ValueError(f"--tokenizer: {e}") from None


def _to_server_args(ns: argparse.Namespace) -> ServerArgs:
    vllm_warnings = check_vllm_flags(ns)
    demo = ns.model is None
    if demo:
        from tpserve.tiny import default_tiny_model_dir

        model_dir = default_tiny_model_dir()
    else:
        model_dir = resolve_model_dir(ns.model, ns.revision, ns.download_dir)
    if ns.tokenizer is not None and _tokenizer_dir(ns) != model_dir:
        raise ValueError(f"--tokenizer {ns.tokenizer}: tpserve reads the tokenizer from the model's own files "
                         "(copy the tokenizer files into the model directory)")
    names = _served_names(ns, model_dir)
    if (clash := next(((n, path) for n, path in ns.lora_modules if n in names), None)) is not None:  # the model
        raise ValueError(f"--lora-modules {clash[0]}={clash[1]}: {clash[0]!r} is the served model's name (a request "
                         "naming it would run the adapter, the model unreachable); give the adapter another name")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"--model: {model_dir} has no config.json")
    if not has_tokenizer_files(model_dir):  # the server and the shell tokenize and detokenize
        raise ValueError(f"--model: {missing_tokenizer_message(model_dir)}; copy the model's tokenizer files there")
    model_config = ModelConfig.from_pretrained(model_dir, ns.hf_overrides)
    flags_problem = task_problem_of_flags(ns, generates=model_config.lm_head, embeds=not model_config.labels,
                                          classifies=bool(model_config.labels),
                                          scores=model_head(model_config).unserved("score") is None)
    if flags_problem is not None:
        raise ValueError(flags_problem)
    load_tokenizer(model_dir)  # a damaged file: named here, not in a child process's log (--shell) after start
    engine = _from_flags(
        EngineConfig, ns,
        model=model_dir,
        device=None if ns.device == "auto" else ns.device,
        dtype=None if ns.dtype == "auto" else ns.dtype,
        dist_init_addr=_dist_init_addr(ns),
        hf_overrides=None if ns.hf_overrides is None else json.dumps(ns.hf_overrides),
        speculative_config=None if ns.speculative_config is None else json.dumps(ns.speculative_config),
        enable_lora=ns.enable_lora or ns.allow_runtime_lora_updating,
    )
    check_can_start(engine, model_config, cli=True)
    if ns.shell and ns.dp_size > 1:
        raise ValueError("--shell runs one replica: drop --dp-size")
    if ns.shell and (problem := task_problem(model_config, None, None)) is not None:  # it chats: it generates
        raise ValueError(f"--shell chats with the model, but {problem}")
    if ns.shell and engine.node_rank > 0:  # it ran headless, the flag quietly ignored
        raise ValueError(f"--shell runs on node 0; --node-rank {engine.node_rank} only runs its ranks: drop --shell")
    chat_template = _chat_template_flag(ns.chat_template) if ns.chat_template else None
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(ns.default_chat_template_kwargs or {}))
    if reserved:
        raise ValueError(f"--default-chat-template-kwargs may not set {', '.join(reserved)}: a request gives them")
    context = ns.max_model_len or model_config.context_length  # a request can be no longer than the KV cache holds
    tool_parser = ns.tool_call_parser
    if tool_parser == "auto":
        tool_parser = detect_tool_parser(chat_template or _model_chat_template(model_dir))
    sampling_defaults = load_sampling_defaults(model_dir, ns.generation_config, ns.override_generation_config)
    return _from_flags(
        ServerArgs, ns,
        engine=engine,
        sampling_defaults=sampling_defaults,
        served_model_name=names[0],
        model_aliases=tuple(n for n in names[1:] if n != names[0]),
        chat_template=chat_template,
        tool_call_parser=None if tool_parser == "none" else tool_parser,
        context_len=min(context, ns.max_total_tokens or context),
        startup_warnings=vllm_warnings + (
            (f"--max-total-tokens {ns.max_total_tokens} is below the context length {context}: requests are limited "
             f"to {ns.max_total_tokens} tokens",) if ns.max_total_tokens is not None and ns.max_total_tokens < context
            else ()),
        vocab_size=model_config.vocab_size,
        head=model_head(model_config),
        api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None,
        demo_model=demo,
        tls=_tls_files(ns),
    )


def _tls_files(ns: argparse.Namespace) -> TLSFiles | None:
    """--ssl-* as one TLSFiles, checked (the files load); None without --ssl-certfile / --ssl-keyfile."""
    if ns.ssl_certfile is None and ns.ssl_keyfile is None:
        given = [flag for flag, value in (("--ssl-ca-certs", ns.ssl_ca_certs), ("--ssl-ciphers", ns.ssl_ciphers),
                                          ("--enable-ssl-refresh", ns.enable_ssl_refresh),
                                          ("--ssl-cert-reqs", ns.ssl_cert_reqs != 0)) if value]
        if given:
            raise ValueError(f"{', '.join(given)} without --ssl-certfile: HTTPS is off")
        return None
    if ns.ssl_certfile is None:
        raise ValueError("--ssl-keyfile needs --ssl-certfile, the certificate it is the key of")
    files = TLSFiles(ns.ssl_certfile, ns.ssl_keyfile, ns.ssl_ca_certs, ns.ssl_cert_reqs, ns.ssl_ciphers)
    files.check()
    return files


def _from_flags(cls: type, ns: argparse.Namespace, **computed: Any) -> Any:
    """``cls`` from the flags named as its fields, and ``computed`` for the other fields."""
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)} | computed)


def _dist_init_addr(ns: argparse.Namespace) -> str | None:
    """--dist-init-addr as a tcp:// URL; every multi-node flag (the token too) is checked before
    anything starts."""
    check_nodes(ns.tp_size, ns.nnodes, ns.node_rank, ns.dist_init_addr, cli=True, dp_size=ns.dp_size,
                all_reduce=ns.all_reduce)
    addr = None
    if ns.dist_init_addr is not None:
        try:
            host, port = split_addr(ns.dist_init_addr)
        except ValueError as e:
            raise ValueError(f"--dist-init-addr: {e}") from None
        try:
            socket.getaddrinfo(host, port)
        except OSError as e:  # the ranks would fail to listen or connect after start-up
            raise ValueError(f"--dist-init-addr {ns.dist_init_addr}: cannot resolve {host!r} ({e})") from None
        addr = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
    if ns.nnodes > 1:
        read_token()
    return addr


def _read_template(path: str, what: str = "--chat-template") -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what}: {path} is not UTF-8 text") from None


def _chat_template_flag(value: str) -> str:
    """--chat-template's template (a file's text, or the value itself when it is no file and holds Jinja), compiled
    as transformers compiles it for each chat request."""
    inline = not os.path.exists(os.path.expanduser(value)) and ("{{" in value or "{%" in value)
    text = value if inline else _read_template(value)
    check_chat_template(text, "--chat-template" if inline else f"--chat-template: {value}")
    return text


def _served_names(ns: argparse.Namespace, model_dir: str) -> list[str]:
    """--served-model-name's names; by default the model's directory name (a path is not shown to
    clients) or its Hugging Face id."""
    if ns.served_model_name:
        if not all(name.strip() for name in ns.served_model_name):
            raise ValueError("--served-model-name: a name must not be empty")
        return ns.served_model_name
    if ns.model is None:
        return [DEMO_MODEL_NAME]
    return [os.path.basename(model_dir) if os.path.isdir(os.path.expanduser(ns.model)) else ns.model]


def _model_chat_template(model_dir: str) -> str | None:
    """The model's chat template text (tokenizer_config.json or chat_template.jinja), if any."""
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        return _read_template(jinja, "--model")
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = "\n".join(t.get("template", "") for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else None
