"""Command-line arguments of ``tpserve`` / ``python -m tpserve``."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from tpserve.config import EngineConfig, ModelConfig, check_can_start
from tpserve.launch.model_path import ModelNotFound, resolve_model_dir

DEFAULT_SCHEDULER_ENTRY = "tpserve.scheduler.process:run_scheduler"
DEMO_MODEL_NAME = "tpserve-tiny-random"
API_KEY_ENV = "TPSERVE_API_KEY"
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerArgs:
    """Everything the server needs: the engine's config plus the frontend's settings."""

    engine: EngineConfig
    served_model_name: str
    context_len: int  # prompt + completion tokens of one request
    vocab_size: int
    host: str = "127.0.0.1"
    port: int = 8000  # 0: pick a free port (logged)
    shell: bool = False
    num_tokenizers: int = 1
    api_key: str | None = None
    log_level: str = "info"
    demo_model: bool = False  # serving the built-in tiny random-weight model
    scheduler_entry: str = DEFAULT_SCHEDULER_ENTRY  # "module:function" run once per TP rank

    @property
    def model_dir(self) -> str:
        return self.engine.model


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text!r}")
        return value

    return parse


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" unless the help already explains the default or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tpserve",
        description="Serve an LLM with tensor parallelism behind an OpenAI-compatible HTTP API "
        "(or an interactive shell with --shell). Runs offline.",
        formatter_class=_HelpFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model", "--model-path", dest="model", default=None,
        help="local model directory, or a Hugging Face id (org/name) already in the local HF "
        "cache; default: a built-in tiny random-weight demo model",
    )
    model.add_argument("--served-model-name", default=None,
                       help="model name in the API (default: the --model value)")
    model.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default="auto",
                       help="weights: safetensors files, or dummy (random, for benchmarks)")
    model.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                       default="auto", help="compute dtype; auto: checkpoint dtype on GPU, "
                       "float32 on CPU")
    model.add_argument("--max-model-len", type=_int_at_least(2), default=None,
                       help="context limit (prompt + completion tokens); default: the model's "
                       "context length (max_position_embeddings, extended by YaRN or linear rope scaling)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--tp-size", "--tensor-parallel-size", "--tp", dest="tp_size",
                        type=_int_at_least(1), default=1,
                        help="tensor-parallel size: number of GPUs (processes) the model is split over")
    engine.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="auto: cuda when available, else cpu")
    engine.add_argument("--max-running-requests", type=_int_at_least(1), default=256,
                        help="most requests decoded together")
    engine.add_argument("--page-size", type=_int_at_least(1), default=16,
                        help="tokens per KV-cache page")
    engine.add_argument("--mem-fraction", type=_fraction, default=0.85,
                        help="fraction of free GPU memory used for the KV cache")
    engine.add_argument("--max-total-tokens", type=_int_at_least(1), default=None,
                        help="KV-cache size in tokens (default: from --mem-fraction on GPU, "
                        "32768 on CPU)")
    engine.add_argument("--seed", type=_int_at_least(0), default=0, help="engine random seed")
    engine.add_argument("--chunked-prefill-size", "--max-prefill-tokens", type=int, default=8192,
                        help="prefill tokens per step; longer prompts are split (<= 0: no chunking)")
    engine.add_argument("--mixed-prefill-tokens", type=_int_at_least(0), default=0,
                        help="most prefill tokens a step that also decodes may carry; a step with more "
                             "prefill work runs it without the decodes, which wait one step (0: prefills "
                             "never share a step with decodes; --chunked-prefill-size: always mix)")
    engine.add_argument("--cache", "--prefix-cache", choices=["radix", "naive"], default="radix",
                        help="prefix cache: radix (shared prefixes reuse KV pages) or naive (none)")
    engine.add_argument("--schedule-policy", choices=["fcfs", "lpm"], default="fcfs",
                        help="admission order: fcfs, or lpm (longest cached prefix first)")
    engine.add_argument("--attention-backend", choices=["auto", "flashinfer", "torch"], default="auto",
                        help="auto: flashinfer on CUDA in bfloat16/float16 when installed, else torch "
                        "(flashinfer takes no float32)")
    engine.add_argument("--cuda-graph-max-bs", type=_int_at_least(0), default=256,
                        help="largest decode batch captured in a CUDA graph (0: no CUDA graphs)")
    engine.add_argument("--all-reduce", choices=["auto", "nccl", "one_shot", "two_shot"], default="auto",
                        help="TP all-reduce on GPU: auto (one-shot/two-shot kernels through peer GPU "
                             "memory for small messages, NCCL for large), nccl, or one kernel for every "
                             "message that fits the peer buffer")
    engine.add_argument("--disable-overlap", action="store_true",
                        help="do not overlap scheduling of the next step with the running one")
    engine.add_argument("--debug-check-invariants", action="store_true",
                        help="check every step that all TP ranks agree and that every KV page is "
                        "accounted for (slow; debugging)")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    server.add_argument("--port", type=_port, default=8000, help="HTTP port (0: any free port)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* and /flush_cache "
                        f"(env {API_KEY_ENV})")
    server.add_argument("--num-tokenizers", type=_int_at_least(1), default=1,
                        help="tokenizer worker processes")
    server.add_argument("--shell", action="store_true",
                        help="chat in the terminal instead of serving HTTP")
    server.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="logging level")
    # For tests: run another scheduler entry point ("module:function").
    server.add_argument("--scheduler-entry", default=DEFAULT_SCHEDULER_ENTRY, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse and validate; a bad value exits with a usage error that names it."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return _to_server_args(ns)
    except (ModelNotFound, ValueError, KeyError, OSError) as e:
        parser.error(str(e))  # exits with status 2


def _to_server_args(ns: argparse.Namespace) -> ServerArgs:
    demo = ns.model is None
    if demo:
        from tpserve.tiny import default_tiny_model_dir

        model_dir = default_tiny_model_dir()
        name = ns.served_model_name or DEMO_MODEL_NAME
    else:
        model_dir = resolve_model_dir(ns.model)
        name = ns.served_model_name or ns.model
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"--model: {model_dir} has no config.json")
    model_config = ModelConfig.from_pretrained(model_dir)
    engine = EngineConfig(
        model=model_dir,
        tp_size=ns.tp_size,
        device=None if ns.device == "auto" else ns.device,
        dtype=None if ns.dtype == "auto" else ns.dtype,
        load_format=ns.load_format,
        page_size=ns.page_size,
        max_total_tokens=ns.max_total_tokens,
        mem_fraction=ns.mem_fraction,
        max_running_requests=ns.max_running_requests,
        max_model_len=ns.max_model_len,
        seed=ns.seed,
        chunked_prefill_size=ns.chunked_prefill_size,
        mixed_prefill_tokens=ns.mixed_prefill_tokens,
        cache=ns.cache,
        schedule_policy=ns.schedule_policy,
        attention_backend=ns.attention_backend,
        cuda_graph_max_bs=ns.cuda_graph_max_bs,
        disable_overlap=ns.disable_overlap,
        all_reduce=ns.all_reduce,
        debug_check_ranks=ns.debug_check_invariants,
        extra={"log_level": ns.log_level},
    )
    check_can_start(engine, model_config, cli=True)
    if ":" not in ns.scheduler_entry:
        raise ValueError(f"--scheduler-entry must be module:function, got {ns.scheduler_entry!r}")
    return ServerArgs(
        engine=engine,
        served_model_name=name,
        context_len=ns.max_model_len or model_config.context_length,
        vocab_size=model_config.vocab_size,
        host=ns.host,
        port=ns.port,
        shell=ns.shell,
        num_tokenizers=ns.num_tokenizers,
        api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None,
        log_level=ns.log_level,
        demo_model=demo,
        scheduler_entry=ns.scheduler_entry,
    )
