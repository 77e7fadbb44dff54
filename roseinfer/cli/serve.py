"""python -m roseinfer.cli.serve (or rose-serve): an OpenAI-compatible HTTP server.

    python -m roseinfer.cli.serve --checkpoint-path checkpoints/tiny --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "ROMEO:", "max_tokens": 32, "temperature": 0}'

The model runs in the serving engine (roseinfer/engine/), owned by one thread, the only
one that runs tensor operations on several threads (this one, which loads the model and
then runs the event loop, keeps to one: roseinfer/serving/engine_thread.py says why);
FastAPI and uvicorn answer HTTP on the event loop (roseinfer/serving/). Ctrl-C or
SIGTERM stops accepting connections, lets the requests in flight finish (for
--shutdown-timeout seconds, then aborts them) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
import sys
from collections.abc import Callable

import torch
import uvicorn

from roseinfer.cli.engine_flags import add_engine_flags, engine_from_flags, speculative_config
from roseinfer.loading import load_model_and_tokenizer
from roseinfer.request import grammar_process
from roseinfer.serving.app import ServerSettings, build_app
from roseinfer.serving.chat_template import ChatTemplate
from roseinfer.serving.compiles import DEFAULT_PER_CLIENT as DEFAULT_COMPILES_PER_CLIENT
from roseinfer.serving.connections import (
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    DEFAULT_PROXIES,
    QuietResourceErrors,
    bounded_protocol,
)
from roseinfer.serving.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from roseinfer.serving.live import MAX_WATCHERS, MAX_WATCHERS_PER_CLIENT, end_streams
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.runtime import DTYPES, pick_device, pick_dtype
from rosetrainer.threads import Threads

PROG = "rose-serve"
# After --shutdown-timeout the requests left are aborted; this long more for their last
# answers to leave before uvicorn cancels what still runs.
ABORT_GRACE_S = 10.0
QUIET_RESOURCE_ERRORS = QuietResourceErrors()  # one for the process's loggers


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m roseinfer.cli.serve",
        description="Serve a rose checkpoint or a Hugging Face GPT-2 over OpenAI's HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize, "
        "/detokenize).",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--checkpoint-path",
        help="a rose .pt file, or a run directory holding best.pt or last.pt "
        "(default: the newest checkpoint under checkpoints/)",
    )
    source.add_argument("--hf-model", help="a local Hugging Face GPT-2 directory")
    p.add_argument("--tokenizer-name", help="tiktoken encoding (default: the checkpoint's)")
    p.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000; 0 picks a free one")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="default: float32")
    add_engine_flags(p)
    p.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests (choices) admitted but without a first token, at most; more get 503 "
        "with Retry-After, and a request holding more choices than this a 400 (default: 256)",
    )
    p.add_argument(
        "--max-waiting-per-client",
        type=int,
        help="of them from one client address, so that one client cannot turn the others "
        "away; more get 503 (default: a quarter of --max-waiting; the proxies uvicorn "
        "trusts are not one client, as for --max-connections-per-client)",
    )
    p.add_argument(
        "--max-compiles-per-client",
        type=int,
        default=DEFAULT_COMPILES_PER_CLIENT,
        help="new structured-output constraints compiling at once for one client address; "
        "one more gets 429 (a constraint already compiled or compiling costs nothing; "
        "default: %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="a request body larger than this gets 413 before it is parsed (default: 1 MiB)",
    )
    p.add_argument(
        "--served-model-name",
        help="the model's name in the API (default: --checkpoint-path or --hf-model as given, "
        "as vLLM names a model by its --model; the checkpoint's path when neither is given)",
    )
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on every API request (/health and /metrics "
        "stay open)",
    )
    p.add_argument(
        "--no-live-page",
        action="store_true",
        help="do not serve the live page at / (nor its /live/snapshot and /live/events)",
    )
    p.add_argument(
        "--max-live-watchers",
        type=int,
        default=MAX_WATCHERS,
        help="live-page event streams (/live/events) at once; more get 429 (default: "
        f"{MAX_WATCHERS})",
    )
    p.add_argument(
        "--max-live-watchers-per-client",
        type=int,
        default=MAX_WATCHERS_PER_CLIENT,
        help="of them from one client address (default: %(default)s)",
    )
    p.add_argument(
        "--root-path",
        default="",
        help="the path prefix a reverse proxy serves this server under, e.g. /rose (it "
        "strips the prefix; the API docs and OpenAPI schema name it)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections at once; a new one past it gets 503 and is closed "
        "(default: %(default)s; keep it below the open-file limit, ulimit -n)",
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
        help="of them from one client address; a new one past it gets 503 and is closed "
        "(default: %(default)s; the proxies uvicorn trusts, 127.0.0.1 and ::1 unless "
        "FORWARDED_ALLOW_IPS says otherwise, are not bounded so; a proxy elsewhere is one "
        "address: raise it there)",
    )
    p.add_argument(
        "--request-head-timeout",
        type=float,
        default=DEFAULT_HEAD_TIMEOUT_S,
        help="seconds a connection may take to send a request's line and headers, after "
        "it opens or its last response ended; then it is closed (default: %(default)s)",
    )
    p.add_argument(
        "--request-body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request's body may take to arrive once its head has; then 408 "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja2 chat template (sees `messages` and `add_generation_prompt`); default: "
        "the --hf-model folder's own (tokenizer_config.json), else role-prefixed paragraphs "
        "ending in 'Assistant:'",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on Ctrl-C/SIGTERM, seconds to let requests in flight finish before aborting them",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default: warning)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.max_waiting < 1:
        raise RoseError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if args.max_body_bytes < 1:
        raise RoseError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if not 0 <= args.port <= 65535:
        raise RoseError(f"--port must be in [0, 65535] (0 picks a free one), got {args.port}")
    if not 0 <= args.shutdown_timeout < math.inf:
        raise RoseError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    for flag in ("request_head_timeout", "request_body_timeout"):
        if not 0 < getattr(args, flag) < math.inf:
            raise RoseError(
                f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}"
            )
    if args.max_waiting_per_client is not None and args.max_waiting_per_client < 1:
        raise RoseError(f"--max-waiting-per-client must be >= 1, got {args.max_waiting_per_client}")
    for flag in (
        "max_compiles_per_client",
        "max_connections",
        "max_connections_per_client",
        "max_live_watchers",
        "max_live_watchers_per_client",
    ):
        if getattr(args, flag) < 1:
            raise RoseError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise RoseError(f"--root-path must start with / and not end with one, got {args.root_path}")
    speculative_config(args)  # (a mistake in the speculative flags: told before loading)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    chat_template = ChatTemplate.from_file(args.chat_template)
    # The engine's thread computes, on the count `threads` chooses and follows; from here
    # this thread keeps to one torch thread (roseinfer/serving/engine_thread.py says why).
    threads = Threads(args.num_threads)
    torch.set_num_threads(1)
    model, tokenizer, source = load_model_and_tokenizer(
        args.checkpoint_path, args.hf_model, args.tokenizer_name, device, dtype
    )
    if args.chat_template is None and tokenizer.chat_template:
        chat_template = ChatTemplate(tokenizer.chat_template)  # the model's own (a Llama's)
    engine = engine_from_flags(model, tokenizer, args)
    proxies = os.environ.get("FORWARDED_ALLOW_IPS", DEFAULT_PROXIES)  # as uvicorn.Config reads them
    settings = ServerSettings(
        model_name=served_model_name(args, source),
        max_waiting=args.max_waiting,
        max_waiting_per_client=args.max_waiting_per_client,
        max_compiles_per_client=args.max_compiles_per_client,
        proxies=proxies,
        api_key=args.api_key,
        chat_template=chat_template,
        live_page=not args.no_live_page,
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.request_body_timeout,
        threads=threads,
        max_live_watchers=args.max_live_watchers,
        max_live_watchers_per_client=args.max_live_watchers_per_client,
    )
    app = build_app(engine, tokenizer, settings)

    # Bind first, so a busy port is one clear line and --port 0 can report the port it got.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as err:
        raise RoseError(f"cannot listen on {args.host}:{args.port}: {err.strerror}") from None
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    server = ReadyServer(
        uvicorn.Config(
            app,
            log_level=args.log_level,
            # uvicorn cancels what is still running after this: a last resort, since the
            # requests are aborted through the engine first (ReadyServer.shutdown).
            timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S,
            root_path=args.root_path,
            # uvicorn's h11 with what its settings lack: a time bound on a request's head
            # and a bound on connections (roseinfer/serving/connections.py).
            http=bounded_protocol(
                args.request_head_timeout,
                args.max_connections,
                args.max_connections_per_client,
                proxies,
            ),
        ),
        ready_line=f"[{PROG}] serving {settings.model_name} at {url}/v1 (device {device}, "
        f"{args.dtype})",
        drain_timeout=args.shutdown_timeout,
        abort_all=app.state.engine_thread.abort_all,
    )
    if device.type == "cpu":  # (once everything above is good: a mistake is one line)
        print(f"[{PROG}] threads: {threads.describe()}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0


def served_model_name(args: argparse.Namespace, source: str) -> str:
    """The model's id in the API: --served-model-name, else the path as the user gave it
    (`checkpoints/tiny`, not the `checkpoints/tiny/best.pt` it resolved to), else the
    newest checkpoint's path, found."""
    return args.served_model_name or args.hf_model or args.checkpoint_path or source


class ReadyServer(uvicorn.Server):
    """uvicorn's server, printing one line once it accepts connections, and ending
    requests through the engine when a shutdown's drain time is up."""

    def __init__(
        self,
        config: uvicorn.Config,
        ready_line: str,
        drain_timeout: float,
        abort_all: Callable[[], None],
    ) -> None:
        super().__init__(config)
        self.ready_line, self.drain_timeout, self.abort_all = ready_line, drain_timeout, abort_all

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.ready_line, flush=True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Requests still running when the drain time is up are aborted in the engine: each
        # client then gets a complete answer (finish_reason "abort", a stream's [DONE]),
        # where uvicorn's own timeout would cancel the handlers mid-response.
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self.abort_all)
        # A constraint still compiling would hold its request (and the exit) until its
        # time bound: its worker is killed now, and the request answered 503.
        grammar_process.pool.stop()
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def handle_exit(self, sig: int, frame: object) -> None:
        # uvicorn raises the signal again once it has shut down gracefully, so the process
        # would end "killed by SIGTERM"; a server that stopped cleanly exits 0 instead.
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        end_streams(self.config.app)  # the live page's, so that shutdown need not wait


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format=f"[{PROG}] %(levelname)s %(message)s")
    for name in ("asyncio", "uvicorn.error"):  # out of file descriptors: not a flood
        logging.getLogger(name).addFilter(QUIET_RESOURCE_ERRORS)
    return run_cli(lambda: run(build_parser().parse_args(argv)), PROG)


if __name__ == "__main__":
    sys.exit(main())
