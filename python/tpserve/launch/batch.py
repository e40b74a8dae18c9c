"""``tpserve run-batch -i requests.jsonl -o results.jsonl --model M``: OpenAI's batch file format, offline.

Each input line is a request as OpenAI's Batch API takes it (``{"custom_id", "method": "POST", "url", "body"}``,
url one of BATCH_URLS); each output line, in input order, its answer (``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``). The requests run through the server's own app in this process
(no port is bound), so they are checked, answered and refused exactly as over HTTP; a line that is no such
request gets ``error`` instead of a response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
import uuid
from typing import Any

import httpx
from tqdm import tqdm

from tpserve.launch.args import build_parser, parse_with
from tpserve.launch.argtypes import int_at_least
from tpserve.launch.backend import STOP_SIGNALS
from tpserve.launch.child import setup_logging
from tpserve.launch.frontend import serving_backend, watch
from tpserve.server.api import AppState, create_app

logger = logging.getLogger(__name__)

# vLLM's run-batch also takes score and rerank requests, at any of the paths the server answers them on
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/score", "/v1/rerank",
              "/score", "/rerank", "/v2/rerank")


def main(argv: list[str]) -> int:
    parser = build_parser()
    parser.prog = "tpserve run-batch"
    parser.description = ("Answer a file of OpenAI batch requests (JSON lines) offline and write their results; "
                          "takes every flag of the server.")
    batch = parser.add_argument_group("batch")
    batch.add_argument("-i", "--input-file", required=True,
                       help="JSON lines, each {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"} with url one of "
                       + ", ".join(BATCH_URLS))
    batch.add_argument("-o", "--output-file", required=True, help="where the results go, one JSON line each, in order")
    batch.add_argument("--max-concurrent", type=int_at_least(1), default=256,
                       help="requests in flight at once (the scheduler batches those it can)")
    args, ns = parse_with(parser, argv)
    if args.shell:
        parser.error("--shell does not combine with run-batch")
    try:
        with open(ns.input_file, encoding="utf-8") as f:
            # (line number, line); split at newlines only: JSON strings may hold U+2028 and U+0085 unescaped
            lines = [(number, line) for number, line in enumerate(f.read().split("\n"), start=1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"--input-file {ns.input_file!r}: {e}")
    if os.path.isdir(ns.output_file):
        parser.error(f"--output-file {ns.output_file!r} is a directory: name the file to write")
    try:  # a file beside the output, renamed over it once every result is in: a failed run leaves the old one
        output = tempfile.NamedTemporaryFile("w", encoding="utf-8", delete=False,
                                             dir=os.path.dirname(os.path.abspath(ns.output_file)), suffix=".partial")
        os.chmod(output.name, _output_mode(ns.output_file))  # a temporary file is the owner's only
    except OSError as e:
        parser.error(f"--output-file {ns.output_file!r}: {e}")
    setup_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        with output:
            results = asyncio.run(_run(args, lines, ns.max_concurrent))
            if results is None:
                return 1
            output.writelines(json.dumps(result, ensure_ascii=False) + "\n" for result in results)
        os.replace(output.name, ns.output_file)
    finally:
        if os.path.exists(output.name):
            os.unlink(output.name)
    failed = sum(result["error"] is not None or result["response"]["status_code"] != 200 for result in results)
    logger.info("wrote %d results to %s (%d failed)", len(results), ns.output_file, failed)
    return 0


def _output_mode(path: str) -> int:
    """The mode ``open(path, "w")`` leaves the output with: an existing file's own, else 0o666 less the umask (read by
    setting it, the only way)."""
    if os.path.exists(path):
        return os.stat(path).st_mode & 0o7777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


async def _run(args: Any, lines: list[tuple[int, str]], max_concurrent: int) -> list[dict[str, Any]] | None:
    """Every line's result, or None where the backend failed or a signal stopped the run."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    state = AppState(args)
    async with serving_backend(args, state, stop) as running:
        if running is None:
            return None
        async with in_process_client(state, args.api_key) as client:
            work = asyncio.create_task(_answer_all(client, lines, max_concurrent))
            watcher = asyncio.create_task(watch(running.backend, stop, running.tasks))
            await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
            watcher.cancel()
            if not work.done():
                work.cancel()
                logger.error("run-batch stopped before every request was answered")
                return None
            return work.result()


def in_process_client(state: AppState, api_key: str | None) -> httpx.AsyncClient:
    """A client of the app itself, no socket between. A 500 is that request's answer: the app re-raises what it
    answered with a 500, which the transport would otherwise raise in the client."""
    transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(transport=transport, base_url="http://tpserve", headers=headers, timeout=None)


async def _answer_all(
    client: httpx.AsyncClient, lines: list[tuple[int, str]], max_concurrent: int
) -> list[dict[str, Any]]:
    slots = asyncio.Semaphore(max_concurrent)
    bar = tqdm(total=len(lines), desc="Requests", unit="req", file=sys.stderr)

    async def answer(number: int, line: str) -> dict[str, Any]:
        async with slots:
            result = await _answer(client, number, line)
        bar.update()
        return result

    with bar:
        return await asyncio.gather(*(answer(number, line) for number, line in lines))


async def _answer(client: httpx.AsyncClient, number: int, line: str) -> dict[str, Any]:
    custom_id = None
    try:
        request = json.loads(line)
        if not isinstance(request, dict):
            raise ValueError("a line must be a JSON object")
        custom_id = request.get("custom_id")
        problem = _problem(request)
        if problem is not None:
            raise ValueError(problem)
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError too; nesting past the parser's depth
        return _result(custom_id, None, {"code": "invalid_request", "message": f"line {number}: {e}"})
    try:  # the body as sent (NaN too: the app answers it with a 400, as over HTTP)
        response = await client.post(request["url"], content=json.dumps(request["body"]).encode(),
                                     headers={"Content-Type": "application/json"})
        body = response.json()
    except Exception as e:  # noqa: BLE001 -- that line's failure, not the batch's
        logger.exception("line %d failed", number)
        error = {"code": "internal_error", "message": f"line {number}: {type(e).__name__}: {e}"}
        return _result(custom_id, None, error)
    return _result(custom_id, {"status_code": response.status_code,
                               "request_id": response.headers.get("x-request-id"), "body": body}, None)


def _problem(request: dict[str, Any]) -> str | None:
    if not isinstance(request.get("custom_id"), str):
        return "custom_id must be a string"
    if request.get("method") != "POST":
        return f"method must be \"POST\", got {request.get('method')!r}"
    if request.get("url") not in BATCH_URLS:
        return f"url must be one of {', '.join(BATCH_URLS)}, got {request.get('url')!r}"
    if not isinstance(request.get("body"), dict):
        return "body must be a JSON object"
    if request["body"].get("stream"):
        return "stream is not supported in a batch"
    if request["body"].get("background"):
        return "background is not supported in a batch (the answer is the result)"
    return None


def _result(custom_id: Any, response: dict[str, Any] | None, error: dict[str, str] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}
