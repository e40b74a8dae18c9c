"""``tpserve`` / ``python -m tpserve``: serve a model over HTTP, or chat with it (--shell); ``tpserve serve MODEL ...``
as vLLM's ``vllm serve`` line is the same;
``python -m tpserve plan``: choose TP and DP for a model and a machine;
``python -m tpserve run-batch``: answer a file of OpenAI batch requests offline."""

from __future__ import annotations

import logging
import os
import sys

from tpserve.launch.args import ServerArgs, parse_args

logger = logging.getLogger("tpserve")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        from tpserve.plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["run-batch"]:
        from tpserve.launch.batch import main as batch_main

        return batch_main(argv[1:])
    if argv[:1] == ["serve"] and not os.path.isdir("serve"):  # a pasted `vllm serve MODEL ...` line
        argv = argv[1:]
    return serve(parse_args(argv))


def serve(args: ServerArgs) -> int:
    """Serve over HTTP, or chat in the terminal (``args.shell``); return the exit code."""
    from tpserve.launch.child import setup_logging

    setup_logging(args.log_level)
    for warning in args.startup_warnings:
        logger.warning("%s", warning)
    if args.demo_model:
        logger.warning(
            "no --model given: serving the built-in tiny RANDOM-WEIGHT demo model from %s "
            "(its answers are gibberish; pass --model to serve a real model)",
            args.model_dir,
        )
    if args.engine.node_rank > 0:
        from tpserve.launch.backend import run_headless

        return run_headless(args)
    if args.shell:
        from tpserve.launch.shell import run_shell

        return run_shell(args)
    from tpserve.launch.http import run_http_server

    return run_http_server(args)


if __name__ == "__main__":
    sys.exit(main())
