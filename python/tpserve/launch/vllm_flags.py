"""vLLM's command line, as users paste it (``vllm serve MODEL --max-num-seqs 256 --enforce-eager ...``): its flags
that name a tpserve setting act on it, flags for what tpserve always does are taken as said, flags with no effect
here are taken with a warning, and flags for features tpserve does not serve are a clear error naming them (rather
than argparse's "unrecognized arguments"). Flags vLLM shares with tpserve's own names (``--tensor-parallel-size``,
``--gpu-memory-utilization``, ...) are spelled beside those (``launch/args.py``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from tpserve.launch.argtypes import int_at_least

# The settings these flags reach in the parsed namespace (``launch/args.py``'s dests)
_MAPPED: dict[str, tuple[str, Any, str]] = {  # flag -> (dest, value, help)
    "--enforce-eager": ("cuda_graph_max_bs", 0, "no CUDA graphs (as --cuda-graph-max-bs 0)"),
    "--disable-custom-all-reduce": ("all_reduce", "nccl", "NCCL for every all-reduce (as --all-reduce nccl)"),
}
# vLLM's on/off pairs for what tpserve does by default: the last of a pair given wins, as in vLLM; off sets the dest
_SWITCHES: dict[str, tuple[str, Any, str]] = {  # the "on" flag -> (dest, off value, what it is)
    "--enable-prefix-caching": ("cache", "naive", "the radix prefix cache (off: as --cache naive)"),
    "--enable-chunked-prefill": ("chunked_prefill_size", 0, "chunked prefill (off: as --chunked-prefill-size 0, "
                                 "whatever --max-num-batched-tokens says)"),
}
# What tpserve always does: taken as said
_ALWAYS = {
    "--enable-auto-tool-choice": "tool_choice auto works whenever a tool-call parser is known (--tool-call-parser)",
    "--async-scheduling": "the scheduler overlaps each step with the next one's planning by default",
    "--enable-prompt-tokens-details": "usage always carries prompt_tokens_details.cached_tokens",
    "--disable-fastapi-docs": "tpserve serves no /docs pages",
    "--disable-log-requests": "tpserve does not log request contents",
    "--enable-request-id-headers": "answers to API requests carry X-Request-Id",
    "--disable-uvicorn-access-log": "HTTP requests are logged at --log-level debug only",
}


@dataclass(frozen=True)
class _Unused:
    why: str
    nargs: int | str | None = None  # argparse's: None one value, 0 a switch, "+" a list


# Flags with no effect in tpserve: taken, with a warning at start-up saying why
_IGNORED = {
    "--swap-space": _Unused("a preempted request is recomputed, never swapped to CPU memory"),
    "--preemption-mode": _Unused("a preempted request is recomputed"),
    "--disable-log-stats": _Unused("the scheduler's periodic log line stays (--log-level warning hides it)", 0),
    "--enable-log-requests": _Unused("tpserve does not log request contents", 0),
    "--max-log-len": _Unused("tpserve does not log request contents"),
    "--uvicorn-log-level": _Unused("--log-level sets every process's level, uvicorn's included"),
    "--disable-frontend-multiprocessing": _Unused("the API server is one process beside the scheduler ranks", 0),
    "--tokenizer-mode": _Unused("the model's fast tokenizer is always used"),
    "--tokenizer-pool-size": _Unused("tokenizer workers are set by --num-tokenizers"),
    "--max-parallel-loading-workers": _Unused("each rank streams its own shard of the weights"),
    "--num-scheduler-steps": _Unused("each step is scheduled; overlap scheduling hides the host's work"),
    "--max-seq-len-to-capture": _Unused("CUDA graphs hold decode steps only (--cuda-graph-max-bs)"),
    "--cuda-graph-sizes": _Unused("decode graphs are captured up to --cuda-graph-max-bs", "+"),
    "--cudagraph-capture-sizes": _Unused("decode graphs are captured up to --cuda-graph-max-bs", "+"),
    "--compilation-config": _Unused("tpserve compiles nothing with torch.compile"),
    "-O": _Unused("tpserve compiles nothing with torch.compile"),
    "--model-impl": _Unused("tpserve runs its own implementation of each architecture"),
    "--config-format": _Unused("config.json is read as Hugging Face writes it"),
    "--guided-decoding-backend": _Unused("structured output is compiled by xgrammar"),
    "--max-logprobs": _Unused("logprobs and top_logprobs are at most 20, as OpenAI's"),
    "--structured-outputs-config": _Unused("structured output is compiled by xgrammar"),
    "--distributed-executor-backend": _Unused("the ranks are tpserve's own processes (as vLLM's mp)"),
    "--scheduler-delay-factor": _Unused("a waiting request is admitted at the next step"),
    "--num-lookahead-slots": _Unused("tpserve does not decode speculatively"),
    "--prefix-caching-hash-algo": _Unused("the radix prefix cache compares token ids, not hashes"),
    "--ignore-patterns": _Unused("only the model's *.safetensors are read", "+"),
    "--long-prefill-token-threshold": _Unused("a long prompt is prefilled in --chunked-prefill-size chunks"),
    "--max-num-partial-prefills": _Unused("a long prompt is prefilled in --chunked-prefill-size chunks"),
    "--max-long-partial-prefills": _Unused("a long prompt is prefilled in --chunked-prefill-size chunks"),
    "--max-cpu-loras": _Unused("every loaded adapter stays in host memory, read from disk once"),
    "--fully-sharded-loras": _Unused("an adapter is sharded as its layer's weight", 0),
    "--lora-dtype": _Unused("adapters are held in the model's dtype"),
    "--api-server-count": _Unused("one API server process serves every request"),
    "--h11-max-incomplete-event-size": _Unused("request bodies are bounded by --max-request-bytes"),
    "--h11-max-header-count": _Unused("request bodies are bounded by --max-request-bytes"),
    "--disable-access-log-for-endpoints": _Unused("HTTP requests are logged at --log-level debug only"),
    "--enable-log-outputs": _Unused("tpserve does not log request contents", 0),
    "--log-error-stack": _Unused("a 500's traceback is logged always", 0),
}
# Features tpserve does not serve: an error naming the flag
_REFUSED = {
    "--enable-sleep-mode": "sleep mode is not served",
    "--otlp-traces-endpoint": "OpenTelemetry traces are not served (metrics: GET /metrics)",
    "--limit-mm-per-prompt": "tpserve serves text-only models",
    "--mm-processor-kwargs": "tpserve serves text-only models",
    "--num-gpu-blocks-override": "set the KV cache's size in tokens with --max-total-tokens",
    "--tokenizer-revision": "the tokenizer is read from the model's own files (--revision)",
    "--code-revision": "tpserve runs no code from model repositories",
    "--cpu-offload-gb": "weights are not offloaded to CPU memory: use more GPUs (--tp-size) or FP8 (--quantization fp8)",
    "--kv-transfer-config": "disaggregated prefill (KV transfer between instances) is not served",
    "--tool-parser-plugin": "tpserve runs no plugin code: --tool-call-parser names its built-in parsers",
    "--reasoning-parser-plugin": "tpserve runs no plugin code: --reasoning-parser names its built-in parsers",
    "--middleware": "tpserve imports no code named on its command line",
    "--rope-scaling": "give it as config.json's: --hf-overrides '{\"rope_scaling\": {...}}'",
    "--headless": "data parallelism across nodes is not served (tensor parallelism is: --nnodes, --node-rank)",
    "--data-parallel-address": "data parallelism across nodes is not served (tensor parallelism is: --nnodes)",
    "--tokens-only": "the Tokens In<>Out endpoint is not served",
    "--long-lora-scaling-factors": "long-context LoRA adapters are not served",
    "--log-config-file": "logging is set by --log-level (every process, uvicorn included)",
}
_REFUSED_SWITCHES = ("--enable-sleep-mode", "--headless", "--tokens-only")  # these take no value
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")  # vLLM's
# vLLM's tasks (--task, --runner, --convert) and what a model must be to serve them: checked once it is read
TASKS = {"--task": ("auto", "generate", "embed", "embedding", "classify", "score", "reward"),
         "--runner": ("auto", "generate", "pooling"),
         "--convert": ("auto", "none", "embed", "classify", "reward")}


class _Refused(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise argparse.ArgumentError(self, _REFUSED[self.option_strings[0]])


class _Switch(argparse.Action):
    """One of an on/off pair (``_SWITCHES``): recorded in order, resolved by ``check_vllm_flags``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        namespace.vllm_switches = [*getattr(namespace, "vllm_switches", []), option_string]


class _Ignored(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        flag = self.option_strings[0]
        namespace.vllm_ignored = [*getattr(namespace, "vllm_ignored", []), f"{flag}: no effect in tpserve "
                                  f"({_IGNORED[flag].why})"]


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags and ``vllm serve``'s positional model, in a group of their own."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    group = parser.add_argument_group("vLLM's flags", "taken as vLLM takes them, for pasted vLLM command lines")
    group.add_argument("--max-num-seqs", dest="max_running_requests", type=int_at_least(1), default=argparse.SUPPRESS,
                       help="as --max-running-requests")
    group.add_argument("--max-num-batched-tokens", dest="chunked_prefill_size", type=int_at_least(1),
                       default=argparse.SUPPRESS, help="as --chunked-prefill-size")
    group.add_argument("--block-size", dest="page_size", type=int_at_least(1), default=argparse.SUPPRESS,
                       help="as --page-size")
    group.add_argument("--max-cudagraph-capture-size", dest="cuda_graph_max_bs", type=int_at_least(0),
                       default=argparse.SUPPRESS, help="as --cuda-graph-max-bs")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="GET /load answers {\"server_load\": N}: the chat, completions, embeddings, classify, "
                       "score and rerank calls in flight (without this flag N stays 0, as in vLLM)")
    for flag, (dest, value, text) in _MAPPED.items():
        group.add_argument(flag, dest=dest, action="store_const", const=value, default=argparse.SUPPRESS, help=text)
    for flag, (_, _, what) in _SWITCHES.items():
        off = flag.replace("--enable-", "--no-enable-")
        group.add_argument(flag, off, action=_Switch, nargs=0, help=f"{what}; on by default, the last of the pair wins")
    for flag, why in _ALWAYS.items():
        group.add_argument(flag, action="store_true", dest=f"vllm_{flag[2:].replace('-', '_')}",
                           help=f"always so: {why}")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="1",
                       help="1 only: tpserve splits a model by tensor parallelism (--tp-size)")
    group.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                       help="as --schedule-policy fcfs or priority")
    group.add_argument("--response-role", default="assistant", metavar="assistant",
                       help="assistant only: the role of chat answers (another is an error)")
    group.add_argument("--chat-template-content-format", choices=("auto", "string", "openai"), default="auto",
                       help="string (auto takes it): a message's content parts reach the chat template as one text, "
                       "joined by newlines; openai (parts as a list) is an error")
    group.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logprobs",
                       help="raw_logprobs only: returned log-probabilities are the model's, before temperature, "
                       "penalties and top-k/top-p (another mode is an error)")
    group.add_argument("--revision", default=None, help="a Hugging Face id's revision in the local cache")
    group.add_argument("--download-dir", default=None,
                       help="the Hugging Face cache directory a Hugging Face id is looked up in (never downloaded)")
    group.add_argument("--tokenizer", default=None,
                       help="the model's own tokenizer only (tpserve reads it from the model's files)")
    for flag, choices in TASKS.items():
        group.add_argument(flag, choices=choices, default="auto",
                           help="checked against the model: tpserve serves every task its architecture has "
                           "(generation with an LM head, embeddings, a *ForSequenceClassification's classify and score)")
    for flag, unused in _IGNORED.items():
        group.add_argument(flag, action=_Ignored, nargs=unused.nargs, metavar="VALUE",
                           help=f"no effect (a warning): {unused.why}")
    for flag, why in _REFUSED.items():
        group.add_argument(flag, action=_Refused, nargs=0 if flag in _REFUSED_SWITCHES else None, metavar="VALUE",
                           help=f"an error: {why}")


def check_vllm_flags(ns: argparse.Namespace) -> tuple[str, ...]:
    """The flags' values that need the whole command line: a ValueError naming one tpserve cannot take; returns
    the warnings for the flags with no effect."""
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"the model is given twice: {ns.model_tag!r} and --model {ns.model!r} (or "
                             f"{ns.model_tag!r} is a value no flag before it takes)")
        ns.model = ns.model_tag
    # `--served-model-name NAME MODEL`: the list took the model, which would serve the demo model: a directory, or
    # after the first name one that reads as a Hugging Face id (org/name)
    names = list(ns.served_model_name or ()) if ns.model is None else []
    swallowed = [n for i, n in enumerate(names) if os.path.isdir(n) or (i > 0 and n.count("/") == 1)]
    if swallowed:
        what = "a model directory" if os.path.isdir(swallowed[0]) else "a model id"
        raise ValueError(f"--served-model-name took {swallowed[0]!r}, {what}, as a name: give MODEL "
                         "before --served-model-name (or use --model)")
    for flag, (dest, off, _) in _SWITCHES.items():
        given = [s for s in getattr(ns, "vllm_switches", ()) if s.endswith(flag[2:])]
        if given and given[-1] != flag:  # the off flag came last
            setattr(ns, dest, off)
    if ns.pipeline_parallel_size != 1:
        raise ValueError(f"--pipeline-parallel-size {ns.pipeline_parallel_size}: tpserve splits a model by tensor "
                         "parallelism only (use --tp-size, and --nnodes across nodes)")
    if ns.response_role != "assistant":
        raise ValueError(f"--response-role {ns.response_role}: the role of chat answers is assistant")
    if ns.logprobs_mode != "raw_logprobs":
        raise ValueError(f"--logprobs-mode {ns.logprobs_mode}: tpserve returns the model's own log-probabilities "
                         "(raw_logprobs), not the sampler's processed ones or logits")
    if ns.chat_template_content_format == "openai":
        raise ValueError("--chat-template-content-format openai: tpserve hands the chat template each message's "
                         "content as one text (string)")
    if ns.scheduling_policy == "priority":
        if ns.schedule_policy not in ("fcfs", "priority"):  # fcfs: --schedule-policy's default
            raise ValueError(f"--scheduling-policy priority and --schedule-policy {ns.schedule_policy}: give one")
        ns.schedule_policy = "priority"
    if (ns.revision is not None or ns.download_dir is not None) and ns.model is None:
        raise ValueError("--revision and --download-dir need a model (a Hugging Face id)")
    return tuple(getattr(ns, "vllm_ignored", ()))


def task_problem_of_flags(ns: argparse.Namespace, generates: bool, embeds: bool, classifies: bool,
                          scores: bool) -> str | None:
    """Why vLLM's --task, --runner or --convert asks for what this model does not serve, or None."""
    wanted = {"generate": generates, "embed": embeds, "embedding": embeds, "classify": classifies,
              "score": scores, "reward": False, "pooling": embeds or classifies}
    for flag in TASKS:
        value = getattr(ns, flag[2:])
        if value not in ("auto", "none") and not wanted[value]:
            return (f"{flag} {value}: this model does not serve it (tpserve serves what its architecture has: "
                    f"generation {'yes' if generates else 'no'}, embeddings {'yes' if embeds else 'no'}, "
                    f"classification {'yes' if classifies else 'no'})")
    return None
