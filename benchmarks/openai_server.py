"""OpenAI servers side by side: ours, vLLM's Python server and vLLM's Rust frontend, on
vLLM's own engine core, with the same load, in one run.

    python -m benchmarks.openai_server --vllm-python PATH [--rounds N] [--quick]
                                       [--out DIR] [--frontends ours vllm vllm-rs]

The three frontends, each serving the same model directory as ``tiny`` on a loopback
port, each over its own engine core (vLLM 0.34's ``EngineCoreProc`` as shipped, with the
interop tests' counter executor, ``tests/interop/vllm_side/fake_executor.py``, at zero
step cost: ``TRIO_ENGINECORE_FAKE_STEP_S=0``), every engine started with the same
``vllm serve`` engine flags (:data:`ENGINE_FLAGS`):

* ``ours``: ``trio-enginecore api-server --vllm`` in this interpreter (our package's
  environment); it launches ``vllm serve DIR --headless`` and handshakes with it;
* ``vllm``: ``vllm serve DIR --api-server-count 1``: vLLM's API server (FastAPI on
  uvicorn, its ``AsyncLLM``) in one process, its engine core a child of it;
* ``vllm-rs``: ``vllm-rs serve DIR`` (the Rust frontend shipped in the 0.34 wheel, in
  its managed mode): it launches ``vllm serve DIR --headless`` and handshakes with it,
  as ours does. Its ``--python`` is a two-line wrapper that runs vLLM's CLI behind
  ``tests/interop/vllm_side/vllm_cli.py`` (the interop tests' answer to vLLM 0.34's
  Triton check on CPU), as ours is given with ``--vllm-command``.

vLLM 0.33 and 0.34 run ``vllm serve`` with the same command line both; the 0.34 one is
used here (``.nox/vllm-0.34-*``), the release our server frames.

The model: the tiny llama ``config.json`` of the interop tests with the package's
built-in byte-level tokenizer (ids 0-255 are the bytes, 256 the EOS; no merges, so a
prompt of 32 ASCII characters is 32 tokens), its ``vocab_size`` set to 128, so that the
counter model (next = last + 1, modulo the vocabulary) writes ASCII only: every output
token is one character of text, nothing is held back as an incomplete UTF-8 sequence,
and the load generator counts a stream's tokens from its text. Control characters
(0-31) are among them: every frontend escapes them in its JSON.

The load: ``benchmarks/openai_load.py``, a process of its own (one thread, ``epoll``,
raw HTTP/1.1 keep-alive connections, a minimal parser), in a closed loop of C
connections until a fixed number of requests have run. Workloads (:data:`WORKLOADS`):
streamed completions of 32 prompt tokens and 512 output tokens (``ignore_eos``,
``stream_options.include_usage``) at C = 64 and 256; non-streamed completions of 32 in
and 16 out at C = 64. Each prompt starts with its request's number, so the prefix cache
never serves one from another. The engines admit 256 sequences at once
(``--max-num-seqs 256``) and have KV blocks for all of them, so that C = 256 streams
run at once, not 128 (vLLM's default on CPU) with the rest queued.

Per frontend and workload: requests/s, output tokens/s, TTFT p50 and p99 (for the
non-streamed requests: the whole response's latency), inter-token latency p50 (each
arrival's time since the previous one divided by the tokens it brought, weighted by
tokens), the frontend's CPU seconds per output token (user + system from
``/proc/<pid>/stat`` of the frontend process only, all its threads: ours, vLLM's API
server, vllm-rs; never its engine-side processes, which are reported apart), tokens per
SSE event, and the load generator's own CPU. Ratios of ours to the two others are taken
within each round (their measurements ran one after the other), then the median over
the rounds.

The three servers start once, together, and stay up; the rounds alternate them (the
order rotated each round), so that all three see the same machine. Access logs are off
in both of vLLM's servers (``--disable-uvicorn-access-log``, ``--disable-access-log``):
ours writes none. A measurement during which programs outside the benchmark took more
than 0.2 of a core is taken again (twice at most; never in ``--quick``) and the report
says so.

Needs the vLLM 0.34 environment that ``nox -s "interop(vllm='0.34')"`` builds, with
``vllm serve``'s own dependencies (its recipe has them). ``nox -s bench_server`` runs
this. Writes ``openai_server.json``, ``openai_server.md`` and, when matplotlib is
installed, ``openai_server.png`` into ``--out`` (``benchmarks/results`` for a full run,
a new temporary directory for ``--quick``, whose figures mean nothing). Progress on
stderr. A full run (3 rounds) takes about 10 minutes on 2 cores, ``--quick`` about two,
most of it the three servers starting (vLLM's imports). Run the full one on a quiet
machine: the load generator, three frontends and an engine share the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from benchmarks.text import (
    code_facts,
    cpu_seconds,
    descendants,
    find_vllm_python,
    speed_probe_us,
    system_busy_seconds,
    vllm_version,
)

BENCH_DIR: Final = Path(__file__).resolve().parent
REPO: Final = BENCH_DIR.parent
RESULTS_DIR: Final = BENCH_DIR / "results"
VLLM_SIDE: Final = REPO / "tests" / "interop" / "vllm_side"
VLLM_CLI: Final = VLLM_SIDE / "vllm_cli.py"

SERVED_MODEL_NAME: Final = "tiny"
PROMPT_TOKENS: Final = 32
MODEL_VOCAB_SIZE: Final = 128
"""The counter model's vocabulary: the ASCII bytes of the byte-level tokenizer."""
MAX_MODEL_LEN: Final = 1024
MAX_NUM_SEQS: Final = 256
KV_BLOCKS: Final = 10240
"""KV blocks of 16 tokens: 256 requests of 544 tokens need 8704."""
ENGINE_FLAGS: Final = (
    "--distributed-executor-backend",
    "fake_executor.CounterExecutor",
    "--load-format",
    "dummy",
    "--enforce-eager",
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--num-gpu-blocks-override",
    str(KV_BLOCKS),
)
"""``vllm serve``'s engine flags, the same for every frontend's engine: those of the
HTTP differential tests (``tests/interop/vllm_server.py``) plus room for 256 streams."""

FRONTENDS: Final = {
    "ours": "trio-enginecore api-server",
    "vllm": "vllm serve (Python, 1 API server)",
    "vllm-rs": "vllm-rs serve (Rust)",
}


@dataclass(frozen=True)
class Workload:
    name: str
    stream: bool
    concurrency: int
    output_tokens: int
    requests: int


WORKLOADS: Final = (
    Workload("stream 32/512, C = 64", True, 64, 512, 64 * 4),
    Workload("stream 32/512, C = 256", True, 256, 512, 256 * 2),
    Workload("short 32/16, C = 64", False, 64, 16, 64 * 24),
)
QUICK_WORKLOADS: Final = (
    Workload("stream 32/512, C = 16", True, 16, 512, 16),
    Workload("short 32/16, C = 16", False, 16, 16, 64),
)

FOREIGN_LOAD_LIMIT: Final = 0.2
"""Cores' worth of CPU other programs may take during a measurement before it is taken
again (the machine is shared): at most :data:`RETRIES` times; never in ``--quick``."""
RETRIES: Final = 2
READY_TIMEOUT_S: Final = 420.0
"""Three servers importing vLLM at once on two cores: minutes."""


# ------------------------------------------------------------------ the model


def write_model(directory: Path) -> Path:
    """The model directory every frontend serves: the interop tests' tiny llama
    ``config.json`` (``vllm_side/common.py``, loaded by path: its top level is stdlib),
    the built-in tokenizer's files, ``vocab_size`` :data:`MODEL_VOCAB_SIZE`."""
    import importlib.util

    from trio_enginecore.text import BUILTIN_TOKENIZER_DIR

    spec = importlib.util.spec_from_file_location("vllm_side_common", VLLM_SIDE / "common.py")
    assert spec is not None
    assert spec.loader is not None
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    directory.mkdir(parents=True, exist_ok=True)
    common.write_model("llama", str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (directory / name).write_bytes((BUILTIN_TOKENIZER_DIR / name).read_bytes())
    config = json.loads((directory / "config.json").read_text())
    config["vocab_size"] = MODEL_VOCAB_SIZE
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def prompt(number: int) -> str:
    """Request ``number``'s prompt: :data:`PROMPT_TOKENS` ASCII characters (one token
    each), its number first (no prefix shared beyond a few characters)."""
    text = f"{number:06d} The quick brown fox jumps over the lazy dog"
    return text[:PROMPT_TOKENS]


def bodies(workload: Workload, count: int) -> list[dict[str, Any]]:
    """The request bodies the load generator cycles through."""
    extra: dict[str, Any] = {}
    if workload.stream:
        extra = {"stream": True, "stream_options": {"include_usage": True}}
    return [
        {
            "model": SERVED_MODEL_NAME,
            "prompt": prompt(number),
            "max_tokens": workload.output_tokens,
            "ignore_eos": True,
            **extra,
        }
        for number in range(count)
    ]


# ------------------------------------------------------------------ the servers


def _die_with_parent() -> None:
    """In a server's child process before exec: SIGTERM when this benchmark dies (a
    server stops its own engine processes then)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def server_environment() -> dict[str, str]:
    """Every server's environment: this one's less this venv; vLLM's CPU platform; the
    counter executor's folder on ``PYTHONPATH`` and its zero step time; no network."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    }
    env.update(
        PYTHONPATH=str(VLLM_SIDE),
        TRIO_ENGINECORE_FAKE_STEP_S="0",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_COLOR="0",
        NO_COLOR="1",
        VLLM_ENGINE_READY_TIMEOUT_S=str(int(READY_TIMEOUT_S)),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def vllm_rs_binary(vllm_python: Path) -> Path | None:
    """The ``vllm-rs`` binary of the vLLM wheel in that environment."""
    for found in vllm_python.parent.parent.glob("lib/python*/site-packages/vllm/vllm-rs"):
        return found
    return None


def python_wrapper(path: Path, vllm_python: Path) -> Path:
    """A ``--python`` for ``vllm-rs serve``: it runs ``PYTHON -m vllm.entrypoints.cli.main
    ARGS``, which this turns into ``PYTHON vllm_cli.py ARGS`` (the same CLI, with the
    Triton check answered first); anything else runs as given."""
    python, cli = shlex.quote(str(vllm_python)), shlex.quote(str(VLLM_CLI))
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "vllm.entrypoints.cli.main" ]; then\n'
        f'  shift 2; exec {python} {cli} "$@"\n'
        "fi\n"
        f'exec {python} "$@"\n'
    )
    path.chmod(0o755)
    return path


def server_command(
    frontend: str, port: int, model_dir: Path, vllm_python: Path, wrapper: Path | None
) -> list[str]:
    where = ["--host", "127.0.0.1", "--port", str(port)]
    if frontend == "ours":
        return [
            sys.executable,
            "-m",
            "trio_enginecore",
            "api-server",
            "--model",
            str(model_dir),
            "--served-model-name",
            SERVED_MODEL_NAME,
            *where,
            "--vllm",
            "--vllm-command",
            shlex.join([str(vllm_python), str(VLLM_CLI)]),
            "--",
            *ENGINE_FLAGS,
        ]
    if frontend == "vllm":
        return [
            str(vllm_python),
            str(VLLM_CLI),
            "serve",
            str(model_dir),
            *where,
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--api-server-count",
            "1",
            "--disable-uvicorn-access-log",
            *ENGINE_FLAGS,
        ]
    binary = vllm_rs_binary(vllm_python)
    assert binary is not None
    assert wrapper is not None
    return [
        str(binary),
        "serve",
        str(model_dir),
        *where,
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--python",
        str(wrapper),
        "--disable-access-log",
        "true",
        "--",
        *ENGINE_FLAGS,
    ]


@dataclass
class Server:
    """A frontend under test: its process (the one measured), its log, its port."""

    frontend: str
    command: list[str]
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    ready_s: float = math.nan
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self, env: dict[str, str]) -> None:
        self._log = self.log_path.open("wb")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.log_path.parent,
            start_new_session=True,  # its group: whatever it leaves is killed at the end
            preexec_fn=_die_with_parent,
        )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def engine_side(self) -> list[int]:
        """The processes below the frontend (``vllm serve --headless``, the engine
        core, vLLM's resource tracker): not the frontend's CPU."""
        return [pid for pid in descendants(self.pid) if pid != self.pid]

    def processes(self) -> list[dict[str, Any]]:
        """The frontend process and its engine side, with their command lines."""
        found = []
        for pid in descendants(self.pid):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                command = " ".join(a.decode(errors="replace") for a in argv if a)
                found.append({"pid": pid, "frontend": pid == self.pid, "command": command[:200]})
        return found

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(text)

    def health(self) -> bool:
        with contextlib.suppress(OSError, http.client.HTTPException):
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                connection.request("GET", "/health")
                return connection.getresponse().status == 200
            finally:
                connection.close()
        return False

    def stop(self, timeout_s: float = 30.0) -> list[int]:
        """SIGTERM (each server then stops its engine), then SIGKILL to its process
        group; the group's processes left after that (none, normally)."""
        if self.process is None:
            return []
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)
        deadline = time.monotonic() + 10
        while (left := group_members(self.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait()
        if self._log is not None:
            self._log.close()
        return left


def group_members(leader: int) -> list[int]:
    """The live processes of the process group ``leader`` leads."""
    members = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = entry.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == leader and fields[0] != "Z":
                members.append(int(entry.parent.name))
    return members


def wait_ready(servers: list[Server]) -> None:
    """Until every server answers ``GET /health`` with 200 (they start together)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            assert server.process is not None
            code = server.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"{server.frontend} exited with code {code} before it was ready; its log "
                    f"({server.log_path}) ends:\n{server.tail()}"
                )
            if server.health():
                server.ready_s = time.monotonic() - server.started
                print(f"{server.frontend} ready in {server.ready_s:.0f} s", file=sys.stderr)
                waiting.remove(server)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(s.frontend for s in waiting)
            raise RuntimeError(f"not ready within {READY_TIMEOUT_S:.0f} s: {names}")
        time.sleep(0.5)


def check_server(server: Server) -> dict[str, Any]:
    """One request of each kind through the load generator: the counts must add up
    (usage against the text, the prompt's 32 tokens), else the figures would not."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        body = json.dumps(bodies(QUICK_WORKLOADS[1], 1)[0])
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        answer = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    usage = answer["usage"]
    text = answer["choices"][0]["text"]
    if usage["prompt_tokens"] != PROMPT_TOKENS or len(text) != usage["completion_tokens"]:
        raise RuntimeError(f"{server.frontend}: the counts do not add up: {answer}")
    return {"prompt_tokens": usage["prompt_tokens"], "sample_text": text}


# ------------------------------------------------------------------ measuring


class LoadGenerator:
    """The load generator's process (``benchmarks/openai_load.py``), up for the whole
    run: one spec a line on its stdin, one report a line on its stdout."""

    def __init__(self, log_path: Path) -> None:
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.openai_load"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO,
        )

    def run(self, port: int, workload: Workload, requests: int | None = None) -> dict[str, Any]:
        """One closed-loop run against ``port``: its report."""
        count = requests or workload.requests
        spec = {
            "port": port,
            "stream": workload.stream,
            "concurrency": workload.concurrency,
            "requests": count,
            "bodies": bodies(workload, count),
            "timeout_s": 900,
        }
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(json.dumps(spec) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith("@{"):
                report: dict[str, Any] = json.loads(line[1:])
                if "error" in report:
                    raise RuntimeError(f"the load generator: {report['error']}")
                return report
        raise RuntimeError(f"the load generator exited ({self.process.wait()})")

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def warm_up(workload: Workload) -> Workload:
    """A short run of ``workload``'s kind: connections, first allocations, the engine's
    first steps."""
    concurrency = min(workload.concurrency, 32)
    return Workload(f"warm-up: {workload.name}", workload.stream, concurrency, 32, concurrency)


def measure(
    load: LoadGenerator, server: Server, others: list[Server], workload: Workload
) -> dict[str, Any]:
    """One measurement: the load against ``server``, with the CPU of its frontend
    process, of its engine side, of the other (idle) servers and of the machine."""
    engine = server.engine_side()
    idle = [pid for other in others for pid in descendants(other.pid)]
    benchmark = descendants(os.getpid())
    wall0 = time.perf_counter()
    system0 = system_busy_seconds()
    frontend0 = cpu_seconds([server.pid])
    engine0, idle0, benchmark0 = cpu_seconds(engine), cpu_seconds(idle), cpu_seconds(benchmark)
    report = load.run(server.port, workload)
    frontend = cpu_seconds([server.pid]) - frontend0
    engine_cpu = cpu_seconds(engine) - engine0
    idle_cpu = cpu_seconds(idle) - idle0
    ours = cpu_seconds(benchmark) - benchmark0
    wall = time.perf_counter() - wall0
    foreign = max(0.0, system_busy_seconds() - system0 - ours) / wall
    return {
        **report,
        "frontend_cpu_s": frontend,
        "engine_cpu_s": engine_cpu,
        "idle_servers_cpu_s": idle_cpu,
        "foreign_cpu_load": foreign,
        "window_s": wall,
    }


def derived(run: dict[str, Any], workload: Workload) -> dict[str, float]:
    """A measurement's figures. A non-streamed response's first token comes with its
    last: its TTFT is its latency."""
    tokens = run["output_tokens"] or math.nan
    wall = run["wall_s"]
    first = "ttft" if workload.stream else "latency"
    return {
        "requests_per_s": run["requests"] / wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * run[f"{first}_p50_s"],
        "ttft_p99_ms": 1e3 * run[f"{first}_p99_s"],
        "latency_p50_ms": 1e3 * run["latency_p50_s"],
        "latency_p99_ms": 1e3 * run["latency_p99_s"],
        "itl_p50_ms": 1e3 * run["itl_p50_s"],
        "frontend_cpu_us_per_token": 1e6 * run["frontend_cpu_s"] / tokens,
        "frontend_cpu_us_per_request": 1e6 * run["frontend_cpu_s"] / run["requests"],
        "tokens_per_event": tokens / run["events"] if run["events"] else math.nan,
        "frontend_load": run["frontend_cpu_s"] / wall,
        "engine_load": run["engine_cpu_s"] / wall,
        "load_generator_load": run["load_cpu_s"] / wall,
        "load_generator_cpu_us_per_token": 1e6 * run["load_cpu_s"] / tokens,
    }


@contextlib.contextmanager
def stopping(servers: list[Server], load: LoadGenerator) -> Iterator[None]:
    """Stop every server and the load generator at the end, whatever happens (a SIGTERM
    to this process too)."""

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        load.stop()
        for server in servers:
            left = server.stop()
            if left:
                print(f"{server.frontend} left processes {left} (killed)", file=sys.stderr)
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace, vllm_python: Path) -> dict[str, Any]:
    """Start the servers, measure every round, and return the raw results. The servers'
    logs are in a temporary directory, removed after a run that went well and named on
    stderr after one that did not."""
    tmp = Path(tempfile.mkdtemp(prefix="tec-server-bench-"))
    try:
        result = _run(args, vllm_python, tmp)
    except BaseException:
        print(f"the servers' logs are in {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def _run(args: argparse.Namespace, vllm_python: Path, tmp: Path) -> dict[str, Any]:
    model_dir = write_model(tmp / "model")
    workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    retries = 0 if args.quick else RETRIES
    wrapper = python_wrapper(tmp / "vllm-python", vllm_python)
    env = server_environment()
    code = code_facts()
    load_before = os.getloadavg()
    begun = time.monotonic()
    servers = [
        Server(
            frontend,
            server_command(frontend, port, model_dir, vllm_python, wrapper),
            port,
            tmp / f"{frontend}.log",
        )
        for frontend in args.frontends
        for port in [free_port()]
    ]
    rs_version = None
    if "vllm-rs" in args.frontends:
        binary = vllm_rs_binary(vllm_python)
        if binary is None:
            raise RuntimeError(f"no vllm-rs in the vLLM environment of {vllm_python}")
        rs_version = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True
        ).stdout.strip()
    runs: list[dict[str, Any]] = []
    probes: list[float] = []
    checks: dict[str, Any] = {}
    load = LoadGenerator(tmp / "load.log")
    processes: dict[str, list[dict[str, Any]]] = {}
    with stopping(servers, load):
        for server in servers:
            server.start(env)
        wait_ready(servers)
        for server in servers:
            checks[server.frontend] = check_server(server)
            processes[server.frontend] = server.processes()
            for workload in workloads:
                load.run(server.port, warm_up(workload))
        for round_ in range(args.rounds):
            probes.append(speed_probe_us())
            for workload in workloads:
                shift = round_ % len(servers)
                for server in servers[shift:] + servers[:shift]:
                    others = [s for s in servers if s is not server]
                    for attempt in range(1 + retries):
                        row = {
                            "frontend": server.frontend,
                            "workload": workload.name,
                            "round": round_,
                            "attempt": attempt,
                            **measure(load, server, others, workload),
                        }
                        if row["foreign_cpu_load"] <= FOREIGN_LOAD_LIMIT:
                            break
                        print(
                            f"  other programs used {row['foreign_cpu_load']:.2f} of a core: "
                            + ("again" if attempt < retries else "kept"),
                            file=sys.stderr,
                        )
                    row.update(derived(row, workload))
                    runs.append(row)
                    print(
                        f"round {round_ + 1}/{args.rounds}, {workload.name}, "
                        f"{server.frontend}: {row['output_tokens_per_s']:,.0f} tokens/s, "
                        f"{row['requests_per_s']:.1f} req/s, frontend "
                        f"{row['frontend_cpu_us_per_token']:.2f} µs/token, "
                        f"{row['tokens_per_event']:.2f} tokens/event",
                        file=sys.stderr,
                    )
    return {
        "machine": {
            **machine_facts(),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "run_seconds": round(time.monotonic() - begun),
            "vllm": {"python": str(vllm_python), "version": vllm_version(vllm_python)},
            "vllm_rs": rs_version,
            "code": code,
        },
        "quick": args.quick,
        "rounds": args.rounds,
        "frontends": {
            s.frontend: {
                "what": FRONTENDS[s.frontend],
                "command": s.command,
                "ready_s": s.ready_s,
                "check": checks.get(s.frontend),
                "processes": processes.get(s.frontend),
            }
            for s in servers
        },
        "workloads": [vars(w) for w in workloads],
        "engine_flags": list(ENGINE_FLAGS),
        "model": {
            "tokenizer": "trio_enginecore.text.BUILTIN_TOKENIZER_DIR (byte-level, 257 ids)",
            "vocab_size": MODEL_VOCAB_SIZE,
            "prompt_tokens": PROMPT_TOKENS,
            "example_prompt": prompt(0),
        },
        "runs": runs,
        "speed_probe_us": probes,
    }


def machine_facts() -> dict[str, Any]:
    import platform

    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


# ------------------------------------------------------------------ the report

FIGURES: Final = (
    "requests_per_s",
    "output_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "latency_p50_ms",
    "latency_p99_ms",
    "itl_p50_ms",
    "frontend_cpu_us_per_token",
    "frontend_cpu_us_per_request",
    "tokens_per_event",
    "frontend_load",
    "engine_load",
    "load_generator_load",
    "load_generator_cpu_us_per_token",
    "foreign_cpu_load",
)
RATIOS: Final = (
    "frontend_cpu_us_per_token",
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
)


def _median(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians per (workload, frontend) and ours ÷ each other frontend, paired within
    each round."""
    names = [w["name"] for w in result["workloads"]]
    frontends = list(result["frontends"])
    medians: list[dict[str, Any]] = []
    for workload in names:
        for frontend in frontends:
            rows = [
                r for r in result["runs"] if r["workload"] == workload and r["frontend"] == frontend
            ]
            if not rows:
                continue
            cpu = [r["frontend_cpu_us_per_token"] for r in rows]
            medians.append(
                {
                    "workload": workload,
                    "frontend": frontend,
                    **{name: _median([r[name] for r in rows]) for name in FIGURES},
                    "cpu_spread": max(cpu) / min(cpu) if min(cpu) > 0 else math.nan,
                    "empty_events": sum(r["empty_events"] for r in rows),
                    "text_usage_mismatches": sum(r["text_usage_mismatches"] for r in rows),
                    "missing_usage": sum(r["missing_usage"] for r in rows),
                    "rounds": len(rows),
                }
            )
    ratios: list[dict[str, Any]] = []
    for workload in names:
        for other in [f for f in frontends if f != "ours"]:
            if "ours" not in frontends:
                continue
            row: dict[str, Any] = {"workload": workload, "against": other}
            for name in RATIOS:
                per_round = [
                    mine[name] / theirs[name]
                    for mine in result["runs"]
                    for theirs in result["runs"]
                    if mine["workload"] == theirs["workload"] == workload
                    and mine["round"] == theirs["round"]
                    and mine["frontend"] == "ours"
                    and theirs["frontend"] == other
                    and theirs[name]
                ]
                per_round = [ratio for ratio in per_round if not math.isnan(ratio)]
                row[name] = _median(per_round)
                row[f"{name}_range"] = (
                    [min(per_round), max(per_round)] if per_round else [math.nan, math.nan]
                )
            ratios.append(row)
    return {"medians": medians, "ratios": ratios}


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def markdown(result: dict[str, Any], summary: dict[str, Any], plotted: str | None) -> str:
    machine = result["machine"]
    workloads = {w["name"]: w for w in result["workloads"]}
    ready = ", ".join(
        f"{name} {_fmt(f['ready_s'], '.0f')} s" for name, f in result["frontends"].items()
    )
    lines = [
        "# OpenAI servers side by side: ours, vLLM's Python server, vLLM's Rust frontend",
        "",
        f"Measured {machine['date']} on {machine['cpus']} CPUs ({machine['processor']}), "
        f"Python {machine['python']}, {machine['platform']}, vLLM "
        f"{machine['vllm']['version']}, {machine['vllm_rs'] or 'vllm-rs not run'}. Load "
        f"average (1, 5, 15 min): {', '.join(map(str, machine['load_before']))} before "
        f"the run, {', '.join(map(str, machine['load_after']))} after it; the run took "
        f"{machine['run_seconds']} s (ready: {ready}). The machine's own speed (a fixed "
        f"piece of Python timed each round) varied from {min(result['speed_probe_us']):.0f} "
        f"to {max(result['speed_probe_us']):.0f} µs. Reproduce: `nox -s bench_server`"
        + (f" at commit {machine['code']['commit']}" if machine["code"]["commit"] else "")
        + (
            " with uncommitted changes to "
            + ", ".join(f"`{f}`" for f in machine["code"]["package_changes"])
            if machine["code"]["package_changes"]
            else ""
        )
        + (" (this was a `--quick` run: the figures mean nothing)." if result["quick"] else "."),
        "",
        "Each frontend serves the same model over its own vLLM 0.34 engine core (the "
        "counter executor at zero step cost; engine flags `"
        + " ".join(result["engine_flags"])
        + "`): "
        + "; ".join(f"`{name}` is {f['what']}" for name, f in result["frontends"].items())
        + ". Every output token is one ASCII character (the counter model over a "
        f"vocabulary of {result['model']['vocab_size']}). The load: a closed loop of C "
        "raw HTTP/1.1 keep-alive connections from one process "
        "(`benchmarks/openai_load.py`). Medians of "
        f"{result['rounds']} round(s), the frontends alternating (order rotated each round).",
        "",
        "`CPU µs/token`: the frontend process's CPU (user + system, all threads, from "
        "`/proc`), never its engine side's, per output token. `TTFT`: for the "
        "non-streamed requests, the whole response's latency. `ITL p50`: each arrival's "
        "gap to the previous one divided by its tokens, token-weighted. `tokens/event`: "
        "output tokens per SSE event. `frontend`, `engine`, `load gen`: CPU over wall "
        "time (1.0 is one core; the engine side includes the idle `vllm serve "
        "--headless` parent of ours and of vllm-rs).",
        "",
        "| workload | frontend | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| CPU µs/token | CPU µs/request | tokens/event | frontend | engine | load gen |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["medians"]:
        stream = workloads[r["workload"]]["stream"]
        lines.append(
            f"| {r['workload']} | {r['frontend']} | {r['requests_per_s']:,.1f} | "
            f"{r['output_tokens_per_s']:,.0f} | "
            + f"{_fmt(r['ttft_p50_ms'], '.1f')} | {_fmt(r['ttft_p99_ms'], '.1f')} | "
            + (f"{_fmt(r['itl_p50_ms'], '.3f')} | " if stream else "n/a | ")
            + f"{r['frontend_cpu_us_per_token']:.2f} | {r['frontend_cpu_us_per_request']:,.0f} | "
            f"{_fmt(r['tokens_per_event'], '.2f') if stream else 'n/a'} | "
            f"{r['frontend_load']:.2f} | {r['engine_load']:.2f} | "
            f"{r['load_generator_load']:.2f} |"
        )
    if summary["ratios"]:
        lines += [
            "",
            "## Ours ÷ the others",
            "",
            "Within each round (the two measured one after the other), the median over "
            "the rounds, the rounds' lowest and highest in brackets. Below 1 is better "
            "for CPU and latencies, above 1 for throughput.",
            "",
            "| workload | ours ÷ | CPU µs/token | output tok/s | req/s | TTFT p50 "
            "| TTFT p99 | ITL p50 |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in summary["ratios"]:
            stream = workloads[r["workload"]]["stream"]
            cells = []
            for name in RATIOS:
                if name == "itl_p50_ms" and not stream:
                    cells.append("n/a")
                    continue
                low, high = r[f"{name}_range"]
                cells.append(f"{_fmt(r[name], '.2f')} ({_fmt(low, '.2f')}-{_fmt(high, '.2f')})")
            lines.append(f"| {r['workload']} | {r['against']} | " + " | ".join(cells) + " |")
    foreign = max(r["foreign_cpu_load"] for r in result["runs"])
    retried = sum(1 for r in result["runs"] if r["attempt"])
    mismatches = sum(r["text_usage_mismatches"] for r in result["runs"])
    empty: dict[str, int] = {}
    for r in summary["medians"]:
        empty[r["frontend"]] = empty.get(r["frontend"], 0) + r["empty_events"]
    lines += [
        "",
        f"Programs outside the benchmark took at most {foreign:.2f} of a core during a "
        f"kept measurement ({retried} measurement(s) taken again because they took more "
        f"than {FOREIGN_LOAD_LIMIT}). The load generator's token count from the text "
        f"disagreed with the usage chunk's in {mismatches} request(s). Events with empty "
        "text (the closing `finish_reason` event of some frontends): "
        + ", ".join(f"{name} {count}" for name, count in empty.items())
        + ".",
        "",
        f"Chart: `{plotted}`." if plotted else "No chart: matplotlib is not installed here.",
    ]
    return "\n".join(lines) + "\n"


def chart(summary: dict[str, Any], path: Path, quick: bool) -> bool:
    """Frontend CPU per token and output tokens/s per workload, one bar per frontend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart", file=sys.stderr)
        return False
    medians = summary["medians"]
    workloads = list(dict.fromkeys(r["workload"] for r in medians))
    frontends = list(dict.fromkeys(r["frontend"] for r in medians))
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(frontends)
    for index, frontend in enumerate(frontends):
        rows = {r["workload"]: r for r in medians if r["frontend"] == frontend}
        xs = [i + index * width for i in range(len(workloads))]
        names = ("frontend_cpu_us_per_token", "output_tokens_per_s")
        for axis, name in zip(axes, names, strict=True):
            axis.bar(
                xs, [rows[w][name] if w in rows else 0 for w in workloads], width, label=frontend
            )
    for axis, label in zip(
        axes,
        ("frontend CPU µs per output token (lower is better)", "output tokens/s"),
        strict=True,
    ):
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
        axis.set_ylabel(label)
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend()
    if quick:
        figure.suptitle("--quick run: the figures mean nothing")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def output_dir(out: Path | None, *, quick: bool) -> Path:
    """``out``, else the committed results for a full run and a temporary directory
    for a quick one (whose figures must never replace the committed ones)."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="tec-server-quick-")) if quick else RESULTS_DIR
    if quick and out.resolve() == RESULTS_DIR:
        raise ValueError("a --quick run does not replace the committed figures")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--vllm-python", default=None, metavar="PATH")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (3; quick: 1)")
    parser.add_argument("--quick", action="store_true", help="one small round: a smoke test")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR")
    parser.add_argument(
        "--frontends",
        nargs="+",
        choices=list(FRONTENDS),
        default=list(FRONTENDS),
        help="which frontends (default: all three)",
    )
    args = parser.parse_args(argv)
    try:
        out = output_dir(args.out, quick=args.quick)
        vllm_python = find_vllm_python(args.vllm_python)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    args.rounds = args.rounds or (1 if args.quick else 3)
    print(
        f"load average before the run: {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
        file=sys.stderr,
    )
    result = run(args, vllm_python)
    summary = summarize(result)
    out.mkdir(parents=True, exist_ok=True)
    plotted = "openai_server.png" if chart(summary, out / "openai_server.png", args.quick) else None
    (out / "openai_server.json").write_text(
        json.dumps({**result, "summary": summary}, indent=1) + "\n"
    )
    report = markdown(result, summary, plotted)
    (out / "openai_server.md").write_text(report)
    print(report)
    print(f"results written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
