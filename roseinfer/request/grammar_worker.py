"""A grammar compiler's worker process (roseinfer/request/grammar_process.py says why):
`python -m roseinfer.request.grammar_worker`, answering compile requests on stdin until
it closes or its parent goes.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from typing import BinaryIO

from roseinfer.request import structured
from roseinfer.request.grammar_process import PARENT_POLL_S, STACK_MARGIN
from roseinfer.request.sampling_params import InvalidParam
from rosetrainer.errors import one_line


def serve() -> None:
    """Answer compile requests on stdin until it closes (or the parent goes)."""
    parent = os.getppid()

    def watch_parent() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    structured._llguidance()  # imported before the ready message: not the compile's time
    threading.stack_size(compile_stack_bytes())
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    send(stdout, {"ready": True})
    while True:
        head = stdin.read(4)
        if len(head) < 4:
            return
        request = json.loads(stdin.read(int.from_bytes(head, "big")))
        answer: dict[str, str | None] = {}

        def compile_it(request: dict = request, answer: dict = answer) -> None:
            try:
                structured.check_compile(request["tokenizer"], request["grammar"])
                answer["error"] = None
            except InvalidParam as err:
                answer["error"] = str(err)
            except Exception as err:  # (a tokenizer it cannot load, say)
                answer["error"] = f"the grammar compiler failed: {one_line(err)}"

        # On a thread with a little less stack than the parent's threads that compile
        # and mask (and its main thread) start with: what passes here passes there.
        thread = threading.Thread(target=compile_it)
        thread.start()
        thread.join()
        send(stdout, answer)


def compile_stack_bytes() -> int:
    """The worker's compile thread's stack: the parent's threads' (the stack limit, as
    glibc sizes a thread's by it; 8 MiB where it is unlimited) less STACK_MARGIN, the
    frames a caller already holds when it compiles."""
    limit = resource.getrlimit(resource.RLIMIT_STACK)[0]
    usual = 8 << 20
    size = usual if limit == resource.RLIM_INFINITY else min(limit, usual)
    return max(size - STACK_MARGIN, 1 << 20)


def send(stream: BinaryIO, payload: dict) -> None:
    message = json.dumps(payload).encode()
    stream.write(len(message).to_bytes(4, "big") + message)
    stream.flush()


if __name__ == "__main__":
    serve()
