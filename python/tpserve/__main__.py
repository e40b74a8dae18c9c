"""``tpserve`` / ``python -m tpserve``: serve a model over HTTP, or chat with it (--shell)."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("tpserve")


def main(argv: list[str] | None = None) -> int:
    from tpserve.launch.args import parse_args
    from tpserve.launch.child import setup_logging

    args = parse_args(argv)
    setup_logging(args.log_level)
    if args.demo_model:
        logger.warning(
            "no --model given: serving the built-in tiny RANDOM-WEIGHT demo model from %s "
            "(its answers are gibberish; pass --model to serve a real model)",
            args.model_dir,
        )
    if args.shell:
        from tpserve.launch.shell import run_shell

        return run_shell(args)
    from tpserve.launch.http import run_http_server

    return run_http_server(args)


if __name__ == "__main__":
    sys.exit(main())
