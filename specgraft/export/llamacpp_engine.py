"""Run the pinned llama.cpp build: find its binaries and drive ``llama-server`` over HTTP.

``scripts/build_llamacpp.sh`` builds the tree vendored by the PyPI sdist llama-cpp-python 0.3.36 into
``$SPECGRAFT_LLAMACPP_HOME`` (default ``~/.cache/specgraft/llama.cpp-0.3.36``); :func:`llamacpp_bin` finds the
binaries there and refuses, in one line with the build command, a folder that lacks them or holds another build.

:class:`LlamaServer` starts ``llama-server`` on a free local port with the given model flags and sends token-id
prompts to ``/completion`` (greedy, no prompt cache). With ``trace_steps`` the server runs with ``LLAMA_TRACE=1``
and logs one ``accepted A/D draft tokens`` line per verification step; each :class:`Completion` carries them, so
callers compare the engine's own per-step acceptance, not only its totals.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgraft.errors import SpecgraftError
from specgraft.export.llamacpp import BUILD_COMMAND, LLAMACPP_PIN

#: The llama-cpp-python version whose vendored tree the build script builds.
LLAMACPP_VERSION = "0.3.36"
HOME_ENV = "SPECGRAFT_LLAMACPP_HOME"
#: Binaries the build script makes.
BINARIES = ("llama-server", "llama-speculative-simple", "llama-completion", "llama-quantize")
#: The build script's stamp file (written last, so a half-built folder has none).
STAMP = "BUILT"
#: What the build script records in its stamp.
_STAMP_VERSION = re.compile(r"llama-cpp-python (\S+)")
_STEP = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")


def llamacpp_home() -> Path:
    """``$SPECGRAFT_LLAMACPP_HOME``, else ``$XDG_CACHE_HOME/specgraft/llama.cpp-0.3.36``."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specgraft" / f"llama.cpp-{LLAMACPP_VERSION}"


def llamacpp_bin() -> Path:
    """The folder of the pinned build's binaries (refused in one line, naming the build command, when absent or
    when the folder holds another llama.cpp)."""
    home = llamacpp_home()
    bin_dir = home / "build" / "bin"
    missing = [b for b in BINARIES if not (bin_dir / b).is_file()]
    if missing or not (home / STAMP).is_file():
        raise SpecgraftError(f"the pinned llama.cpp ({LLAMACPP_PIN}) is not built in {home} (missing "
                             f"{', '.join(missing) or STAMP}); build it with `{BUILD_COMMAND}` (about 10 minutes on "
                             "2 cores)")
    recorded = _STAMP_VERSION.search((home / STAMP).read_text(encoding="utf-8", errors="replace"))
    if recorded is not None and recorded.group(1) != LLAMACPP_VERSION:
        raise SpecgraftError(f"{home} holds the llama.cpp of llama-cpp-python {recorded.group(1)}, not the pinned "
                             f"{LLAMACPP_VERSION}; point {HOME_ENV} elsewhere and build with `{BUILD_COMMAND}`")
    return bin_dir


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Completion:
    """One ``/completion`` answer: the generated token ids and the engine's timings and draft counters."""

    tokens: list[int]
    timings: dict[str, Any]
    steps: list[tuple[int, int]]
    """(accepted, drafted) per verification step, from the server's log."""
    log: str = ""
    """The server's log lines of this request."""

    @property
    def drafted(self) -> int:
        return int(self.timings.get("draft_n", 0))

    @property
    def accepted(self) -> int:
        return int(self.timings.get("draft_n_accepted", 0))


class LlamaServer:
    """``llama-server`` with ``args`` (``-m TARGET.gguf`` and any speculative flags), one slot, on a free port.

    Use as a context manager; the process is stopped on exit.
    """

    def __init__(self, args: Sequence[str], threads: int = 1, ctx_size: int = 2048, timeout_s: float = 120.0,
                 trace_steps: bool = True) -> None:
        self.args = [str(a) for a in args]
        self.trace_steps = trace_steps
        self.threads = threads
        self.ctx_size = ctx_size
        self.timeout_s = timeout_s
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._log_offset = 0

    def __enter__(self) -> LlamaServer:
        self.port = _free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)  # noqa: SIM115
        command = [str(llamacpp_bin() / "llama-server"), *self.args, "--host", "127.0.0.1", "--port", str(self.port),
                   "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.ctx_size), "-np", "1",
                   "--no-webui", "--metrics"]
        env = dict(os.environ, LLAMA_TRACE="1") if self.trace_steps else None
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpecgraftError(f"llama-server exited with status {self.process.returncode} while loading; its "
                                     f"log: {self._log.name} (last line: {self._last_line()})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise SpecgraftError(f"llama-server did not become ready in {self.timeout_s:.0f} s; its log: {self._log.name}")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None

    def _last_line(self) -> str:
        text = Path(self._log.name).read_text(encoding="utf-8", errors="replace").strip().splitlines()
        return text[-1] if text else ""

    def _new_log(self) -> str:
        self._log.flush()
        with open(self._log.name, encoding="utf-8", errors="replace") as fh:
            fh.seek(self._log_offset)
            text = fh.read()
            self._log_offset = fh.tell()
        return text

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters (``/metrics``), name (with labels) -> value, ``llamacpp:`` dropped."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=self.timeout_s) as response:
            text = response.read().decode("utf-8")
        out = {}
        for line in text.splitlines():
            if line.startswith("llamacpp:"):
                name, value = line[len("llamacpp:"):].rsplit(" ", 1)
                out[name] = float(value)
        return out

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the server process has used so far (Linux ``/proc``)."""
        assert self.process is not None
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def post(self, route: str, body: dict[str, Any]) -> Any:
        """POST ``body`` as JSON to ``route`` (``/tokenize``, ``/apply-template``, ...); the decoded answer."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{route}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.loads(response.read())

    def complete(self, prompt_ids: Sequence[int], n_predict: int, ignore_eos: bool = True) -> Completion:
        """Greedy generation of ``n_predict`` tokens after the token-id prompt (no prompt cache; with
        ``ignore_eos`` the length is exactly ``n_predict``, as specgraft's ``ignore_eos`` decoding)."""
        self._new_log()
        body = {"prompt": [int(t) for t in prompt_ids], "n_predict": int(n_predict), "temperature": 0.0,
                "top_k": 1, "cache_prompt": False, "return_tokens": True, "stream": False,
                "ignore_eos": bool(ignore_eos)}
        answer = self.post("/completion", body)
        time.sleep(0.05)  # the slot's log lines are written before the answer; let the pipe reach the file
        log = self._new_log()
        steps = [(int(a), int(d)) for a, d in _STEP.findall(log)]
        return Completion([int(t) for t in answer.get("tokens", [])], dict(answer.get("timings") or {}), steps, log)
