"""Text streams: the frontend's CPU per output token, our text layer against vLLM's
``AsyncLLM``, on vLLM's own engine core, in one run.

    python -m benchmarks.text --vllm-python PATH [--rounds N] [--quick] [--out DIR]
                              [--no-profile]

What is compared, on the same engine and the same workload:

* ours: :class:`trio_enginecore.text.AsyncLLM` over our client, attached to vLLM 0.34's
  real engine core (``EngineCoreProc`` as shipped, started by vLLM's own supervisor
  for a client that bound its sockets: what ``AsyncLLM`` does for itself);
* vLLM: vLLM 0.34's own ``AsyncLLM``, which starts its own engine core child, the
  same way, with the same settings.

Both engines run the counter executor of the interop tests
(``tests/interop/vllm_side/fake_executor.py``) at zero step cost: every engine step is
as cheap as vLLM's scheduler allows, so the frontend is what is measured. The model
directory is the text tests' tricky tokenizer (``write_tricky_dir``: a byte-level BPE of
422 tokens whose pieces split accented letters, CJK and emoji across tokens) beside a
tiny llama ``config.json`` of the same vocabulary; the counter model (next = last + 1,
modulo the vocabulary) walks every token id, special, added and partial-character
ones included.

The workload: text prompts of exactly 32 tokens, 512 output tokens each
(``ignore_eos``), ``DELTA`` outputs, each request read to its end by one task (a Trio
task for ours, an asyncio task iterating ``AsyncLLM.generate`` for vLLM), in a closed
loop of ``C`` such tasks (C = 64 and 512) until a fixed number of requests has run
(whole waves: 4 per task at C = 64, 1 at C = 512), so every request's own costs (its
tokenization, its detokenizer's set-up) count once per 512 tokens, as in service.
Variants: ours without stop strings, with 2 stop strings that never match, and with
``detokenize=False`` (token ids only: the floor of our client and text layer without
text); vLLM without and with the same stop strings.

What is measured: the CPU seconds of the frontend process alone
(``time.process_time()`` in that process, every thread of it included, around the
measurement), divided by the output tokens it received; the engine core is another
process in both cases and is not counted. Each process is started once; rounds
alternate the variants (their order rotated each round) so that all see the same
machine; every figure is the median over the rounds, with the spread (max / min) of
its rounds beside it. After the rounds: prompt tokenization on the Trio thread against
``trio.to_thread.run_sync`` (µs per call, and how long the Trio thread is held), and
(unless ``--no-profile``) a cProfile of one more run of ours with stop strings, as a
breakdown of where our process's CPU goes.

Needs the vLLM 0.34 environment that ``nox -s "interop(vllm='0.34')"`` builds (its
Python: ``--vllm-python``, else ``$TRIO_ENGINECORE_VLLM_PYTHON``, else a complete
``.nox/vllm-0.34-*``). ``nox -s bench_text`` runs this. Writes ``text.json`` and
``text.md`` into ``--out`` (``benchmarks/results`` for a full run; a new temporary
directory for ``--quick``, whose figures mean nothing). Progress on stderr. A full run
(5 rounds) takes about 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Final

BENCH_DIR: Final = Path(__file__).resolve().parent
REPO: Final = BENCH_DIR.parent
RESULTS_DIR: Final = BENCH_DIR / "results"
VLLM_WORKER: Final = BENCH_DIR / "vllm_text_worker.py"
VLLM_PYTHON_VARIABLE: Final = "TRIO_ENGINECORE_VLLM_PYTHON"
VLLM_RELEASE: Final = "0.34"

CONCURRENCIES: Final = (64, 512)
PROMPT_TOKENS: Final = 32
OUTPUT_TOKENS: Final = 512
MAX_MODEL_LEN: Final = 1024
WAVES: Final = {64: 4, 512: 1}
"""Requests per task and measurement: about 130,000 and 260,000 output tokens."""
STOP_STRINGS: Final = ("\n\nUser:", "<|never|>")
"""Two stop strings that the counter model's text never contains (every run checks that
no request finished on one): each step pays the search and the hold-back, never a cut."""

VARIANTS: Final[dict[str, dict[str, Any]]] = {
    "ours": {"side": "ours", "stop": False, "detokenize": True},
    "ours, stop strings": {"side": "ours", "stop": True, "detokenize": True},
    "ours, tokens only": {"side": "ours", "stop": False, "detokenize": False},
    "vllm": {"side": "vllm", "stop": False, "detokenize": True},
    "vllm, stop strings": {"side": "vllm", "stop": True, "detokenize": True},
}
"""Each measured variant: which frontend, with the stop strings or not, and whether it
makes text (``detokenize``)."""
PROFILED: Final = ("ours, stop strings", 512)

CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
FOREIGN_LOAD_LIMIT: Final = 0.2
"""Cores' worth of CPU other programs may take during a measurement before it is taken
again (the machine is shared); at most :data:`RETRIES` times, and the report says so."""
RETRIES: Final = 2

TOKENIZE_LENGTHS: Final = (32, 2000)
"""Prompt lengths (tokens) of the tokenization measurement."""


# ------------------------------------------------------------------ the workload


def prompts(tokenizer: Any) -> list[str]:
    """The prompts: two sentences of the tricky tokenizer's corpus, every pair that
    is exactly :data:`PROMPT_TOKENS` tokens long (there are six)."""
    from tests.text.tokenizers_for_tests import TRICKY_CORPUS

    found = [
        f"{first} {second}"
        for first in TRICKY_CORPUS
        for second in TRICKY_CORPUS
        if first != second and len(tokenizer.encode(f"{first} {second}")) == PROMPT_TOKENS
    ]
    if not found:
        raise RuntimeError(f"no prompt of {PROMPT_TOKENS} tokens in the tricky corpus")
    return found


def tokenize_texts(tokenizer: Any) -> dict[int, str]:
    """A text of each length of :data:`TOKENIZE_LENGTHS` (to within a few tokens): the
    corpus repeated, cut at a word."""
    from tests.text.tokenizers_for_tests import TRICKY_CORPUS

    corpus = " ".join(TRICKY_CORPUS).split(" ")
    texts: dict[int, str] = {}
    for length in TOKENIZE_LENGTHS:
        # Enough repeats of the corpus (about 300 tokens) for the length.
        words = corpus * (length // 250 + 1)
        low, high = 1, len(words)
        # The longest prefix of whole words within the length.
        while low < high:
            middle = (low + high + 1) // 2
            if len(tokenizer.encode(" ".join(words[:middle]))) <= length:
                low = middle
            else:
                high = middle - 1
        texts[length] = " ".join(words[:low])
    return texts


# ------------------------------------------------------------------ our worker


class CollectorTime:
    """The time the garbage collector ran (``gc.callbacks``): CPU time of the thread
    that allocated, part of the frontend's CPU figure."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began


async def _measure_ours(
    llm: Any,
    prompt_texts: list[str],
    *,
    concurrency: int,
    requests: int,
    stop: list[str],
    detokenize: bool,
) -> dict[str, Any]:
    """A closed loop of ``concurrency`` Trio tasks until ``requests`` requests have run;
    the same loop as ``vllm_text_worker.measure``."""
    import trio

    from trio_enginecore import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=OUTPUT_TOKENS,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        stop=list(stop) or None,
        detokenize=detokenize,
    )
    counts = dict.fromkeys(("started", "tokens", "chars", "outputs", "stopped", "prompt_tokens"), 0)

    async def slot() -> None:
        while counts["started"] < requests:
            number = counts["started"]
            counts["started"] += 1
            first = True
            async with llm.generate(prompt_texts[number % len(prompt_texts)], params) as outputs:
                async for output in outputs:
                    completion = output.outputs[0]
                    if first:
                        counts["prompt_tokens"] += len(output.prompt_token_ids)
                        first = False
                    counts["outputs"] += 1
                    counts["tokens"] += len(completion.token_ids)
                    counts["chars"] += len(completion.text)
                    if completion.finish_reason == "stop":
                        counts["stopped"] += 1

    collections0 = [g["collections"] for g in gc.get_stats()]
    collector = CollectorTime()
    gc.callbacks.append(collector)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(slot)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    # The collector's runs per generation: a figure's variance follows the full ones.
    gc.callbacks.remove(collector)
    collections = [g["collections"] - c for g, c in zip(gc.get_stats(), collections0, strict=True)]
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "requests": counts.pop("started"),
        **counts,
        "gc_collections": collections,
        "gc_s": collector.seconds,
    }


async def _measure_tokenize(tokenizer: Any, calls: int) -> list[dict[str, Any]]:
    """``tokenizer.encode`` inline on the Trio thread against ``trio.to_thread.run_sync``.

    Calls one after another; per call: the wall time, the process's CPU time (both
    threads), the time the Trio thread spent running tasks (a Trio instrument adds up
    every task step: inline, the encode itself; through a thread, only the hand-off)
    and the longest single task step (how long the Trio thread was held at once: what
    every other stream waits at worst). ``hand-off alone`` is a thread call that does
    nothing, the price of going to a thread at all.
    """
    import trio

    class Steps(trio.abc.Instrument):
        def __init__(self) -> None:
            self.busy = 0.0
            self.longest = 0.0
            # Added during a step of the measuring task: that step began now.
            self._began = time.perf_counter()

        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            self._began = time.perf_counter()

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            step = time.perf_counter() - self._began
            self.busy += step
            self.longest = max(self.longest, step)

    async def timed(name: str, call: Any, tokens: int | None, count: int) -> dict[str, Any]:
        await call()  # warm: the thread cache's first worker, the first encode
        steps = Steps()
        trio.lowlevel.add_instrument(steps)
        try:
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(count):
                await call()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        finally:
            trio.lowlevel.remove_instrument(steps)
        return {
            "case": name,
            "prompt_tokens": tokens,
            "calls": count,
            "wall_us_per_call": 1e6 * wall / count,
            "cpu_us_per_call": 1e6 * cpu / count,
            "trio_thread_us_per_call": 1e6 * steps.busy / count,
            "longest_hold_us": 1e6 * steps.longest,
        }

    rows: list[dict[str, Any]] = []
    for length, text in tokenize_texts(tokenizer).items():
        tokens = len(tokenizer.encode(text))
        count = max(50, calls * PROMPT_TOKENS // length)

        async def inline(text: str = text) -> None:
            tokenizer.encode(text)
            await trio.lowlevel.checkpoint()  # as a caller would, before sending

        async def threaded(text: str = text) -> None:
            await trio.to_thread.run_sync(tokenizer.encode, text)

        rows.append(await timed(f"inline, {length} tokens", inline, tokens, count))
        rows.append(await timed(f"to_thread, {length} tokens", threaded, tokens, count))

    async def handoff() -> None:
        await trio.to_thread.run_sync(int)

    rows.append(await timed("to_thread, hand-off alone", handoff, None, calls))
    return rows


def _replay_outputs(
    prompt_ids: list[int], vocab_size: int, per_output: int, request_id: str
) -> list[Any]:
    """The engine outputs of one request as the counter model makes them (next = last
    + 1, modulo the vocabulary), ``per_output`` tokens each, the last one finished."""
    from trio_enginecore import EngineCoreOutput, FinishReason

    last = prompt_ids[-1]
    ids = [(last + 1 + i) % vocab_size for i in range(OUTPUT_TOKENS)]
    chunks = [ids[i : i + per_output] for i in range(0, OUTPUT_TOKENS, per_output)]
    return [
        EngineCoreOutput(
            request_id,
            chunk,
            finish_reason=FinishReason.LENGTH if i == len(chunks) - 1 else None,
        )
        for i, chunk in enumerate(chunks)
    ]


def _replay(tokenizer: Any, prompt_texts: list[str], requests: int) -> list[dict[str, Any]]:
    """The text layer alone, without client, engine or event loop: the same token
    sequences as the counter model's fed to ``TextRequestState.process``, ``k`` tokens
    an engine output (a reader that keeps up gets 1 a step; one that fell behind gets
    the client's merged outputs), and ``DecodeStream.step`` alone on the same ids, one
    id a call and ``k`` ids a call (a list). CPU µs per output token."""
    from tokenizers.decoders import DecodeStream

    from trio_enginecore import RequestOutputKind, SamplingParams
    from trio_enginecore.text import TextRequestState

    prompt_ids = [tokenizer.encode(text) for text in prompt_texts]
    cases = {
        "text layer, tokens only": {"detokenize": False},
        "text layer": {},
        "text layer, stop strings": {"stop": list(STOP_STRINGS)},
    }
    rows: list[dict[str, Any]] = []
    for per_output in (1, 4, 16):
        outputs = [
            _replay_outputs(
                prompt_ids[i % len(prompt_ids)], tokenizer.vocab_size, per_output, f"replay-{i}"
            )
            for i in range(requests)
        ]
        for case, keywords in cases.items():
            params = SamplingParams(
                max_tokens=OUTPUT_TOKENS,
                ignore_eos=True,
                output_kind=RequestOutputKind.DELTA,
                **keywords,
            )
            # Fresh outputs each case: process() may cut an output's token list.
            fed = [[msgspec_copy(o) for o in request] for request in outputs]
            cpu0 = time.process_time()
            for i, request in enumerate(fed):
                state = TextRequestState(
                    f"replay-{i}", None, prompt_ids[i % len(prompt_ids)], params, tokenizer
                )
                for output in request:
                    state.process(output)
            cpu = time.process_time() - cpu0
            rows.append(
                {
                    "case": case,
                    "tokens_per_output": per_output,
                    "cpu_us_per_token": 1e6 * cpu / (requests * OUTPUT_TOKENS),
                }
            )
        for batched in (False, True):
            cpu0 = time.process_time()
            backend = tokenizer.backend
            for i, request in enumerate(outputs):
                stream = DecodeStream(ids=prompt_ids[i % len(prompt_ids)], skip_special_tokens=True)
                for output in request:
                    if batched:
                        stream.step(backend, output.new_token_ids)
                    else:
                        for token_id in output.new_token_ids:
                            stream.step(backend, token_id)
            cpu = time.process_time() - cpu0
            rows.append(
                {
                    "case": "DecodeStream.step, a list of k ids a call"
                    if batched
                    else "DecodeStream.step, one id a call",
                    "tokens_per_output": per_output,
                    "cpu_us_per_token": 1e6 * cpu / (requests * OUTPUT_TOKENS),
                }
            )
    return rows


def msgspec_copy(output: Any) -> Any:
    """A copy of an engine output with its own token list."""
    import msgspec

    return msgspec.structs.replace(output, new_token_ids=list(output.new_token_ids))


_PROFILE_GROUPS: Final = (
    # (group, test on (file, function name)); the first that matches wins. Trio's
    # outcome objects are attrs classes too: Trio's rule comes before the outputs'.
    ("DecodeStream.step (tokenizers, Rust)", lambda f, n: "DecodeStream" in n and "step" in n),
    ("stop strings: find_stop_string, str.find", lambda f, n: n == "find_stop_string"),
    ("stop strings: find_stop_string, str.find", lambda f, n: "method 'find' of 'str'" in n),
    ("detokenizer (_detokenizer.py, Python)", lambda f, n: f.endswith("text/_detokenizer.py")),
    ("Trio: scheduler, epoll, wake-ups", lambda f, n: "/trio/" in f or "outcome" in f),
    ("Trio: scheduler, epoll, wake-ups", lambda f, n: "epoll" in n or "Context" in n),
    ("prompt tokenization", lambda f, n: "encode" in n and "tokenizers" in n),
    ("text layer: _processor.py, _llm.py, _outputs.py", lambda f, n: "enginecore/text/" in f),
    ("text layer: _processor.py, _llm.py, _outputs.py", lambda f, n: "text._outputs" in f),
    ("client: receive, decode, route, streams", lambda f, n: "trio_enginecore/" in f),
    ("client: receive, decode, route, streams", lambda f, n: "msgspec" in n or "zmq" in f),
    ("the benchmark's loop", lambda f, n: f.endswith("benchmarks/text.py")),
)


def _profile_breakdown(stats: Any) -> dict[str, Any]:
    """Own (``tottime``) CPU of the profiled run by group and by function, as shares."""
    entries = stats.stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    total = sum(value[2] for value in entries.values()) or math.nan
    groups: dict[str, float] = {}
    functions: list[tuple[float, str, int]] = []
    cumulative: dict[str, float] = {}
    for (file, line, name), (_, calls, own, cum, _) in entries.items():
        group = next(
            (g for g, test in _PROFILE_GROUPS if test(file, name)),
            "other: builtins every layer calls (len, dict.get, list.append, ...)",
        )
        groups[group] = groups.get(group, 0.0) + own
        where = f"{Path(file).name}:{line} {name}" if line else name
        functions.append((own, where, calls))
        if file.endswith("text/_detokenizer.py") and name in ("update", "find_stop_string"):
            cumulative[f"IncrementalDetokenizer.{name}" if name == "update" else name] = cum
        if file.endswith("text/_processor.py") and name == "process":
            cumulative["TextRequestState.process"] = cum
    functions.sort(reverse=True)
    return {
        "total_s": total,
        "groups": sorted(
            ({"group": g, "share": s / total} for g, s in groups.items()),
            key=lambda row: -row["share"],
        ),
        "cumulative": {name: cum / total for name, cum in cumulative.items()},
        "top": [
            {"function": where, "calls": calls, "share": own / total}
            for own, where, calls in functions[:15]
        ],
        # Every function of at least 0.1 %, to group them otherwise later.
        "functions": [
            {"function": where, "calls": calls, "share": own / total}
            for own, where, calls in functions
            if own >= total / 1000
        ],
    }


async def _serve_ours(spec: dict[str, Any]) -> None:
    import trio

    from trio_enginecore import EngineConfig, open_engine_client
    from trio_enginecore.text import AsyncLLM, load_tokenizer

    started = time.monotonic()
    tokenizer = load_tokenizer(spec["model_dir"])
    prompt_texts: list[str] = spec["prompts"]
    async with open_engine_client(
        EngineConfig(),
        input_address=spec["input_address"],
        output_address=spec["output_address"],
        ready_timeout_s=180,
    ) as client:
        llm = AsyncLLM(client, tokenizer)
        # A warm-up (first allocations, the engine's first steps), then the startup heap
        # frozen as in vLLM's worker (vLLM's freeze_gc_heap: collect, then freeze).
        await _measure_ours(llm, prompt_texts, concurrency=8, requests=16, stop=[], detokenize=True)
        gc.collect()
        gc.freeze()
        _say(event="ready", startup_s=time.monotonic() - started)
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                return
            command = json.loads(line)
            if command["cmd"] == "quit":
                return
            if command["cmd"] == "tokenize":
                rows = await _measure_tokenize(tokenizer, int(command["calls"]))
                _say(event="tokenized", rows=rows)
                continue
            if command["cmd"] == "replay":
                rows = _replay(tokenizer, prompt_texts, int(command["requests"]))
                _say(event="replayed", rows=rows)
                continue
            profiler = None
            if command.get("profile"):
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            result = await _measure_ours(
                llm,
                prompt_texts,
                concurrency=int(command["concurrency"]),
                requests=int(command["requests"]),
                stop=list(command.get("stop") or ()),
                detokenize=bool(command.get("detokenize", True)),
            )
            if profiler is not None:
                import pstats

                profiler.disable()
                result["profile"] = _profile_breakdown(pstats.Stats(profiler))
            _say(event="measured", **result)


def _say(**fields: Any) -> None:
    print("@" + json.dumps(fields), flush=True)


def worker_main(spec_json: str) -> int:
    """Our frontend's process: ``python -m benchmarks.text --worker '<spec json>'``.

    Same protocol as ``vllm_text_worker.py``'s frontend role: ``@{"event": "ready"}``,
    then one answer line per command read on stdin.
    """
    import trio

    try:
        trio.run(_serve_ours, json.loads(spec_json))
    except Exception as exc:
        import traceback

        traceback.print_exc(file=sys.stderr)
        _say(event="error", message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


# ------------------------------------------------------------------ orchestration


class Process:
    """A worker process: its ``@`` report lines through a queue, its stderr in a file."""

    def __init__(
        self, name: str, command: list[str], log: Path, *, env: dict[str, str], cwd: Path
    ) -> None:
        self.name = name
        self.log_path = log
        self._log: IO[str] = log.open("w")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=cwd,
            # Its own process group: vLLM's engine processes go with it at the end.
            start_new_session=True,
        )
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("@{"):
                self._lines.put(line)
        self._lines.put(None)

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def report(self, timeout_s: float) -> dict[str, Any]:
        """The next report; raises with the end of its log if it failed or exited."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            message = f"{self.name}: no report within {timeout_s:g} s{self._tail()}"
            raise RuntimeError(message) from None
        if line is None:
            raise RuntimeError(f"{self.name} exited ({self.process.wait()}){self._tail()}")
        report: dict[str, Any] = json.loads(line[1:])
        if report.get("event") == "error":
            raise RuntimeError(f"{self.name} failed: {report['message']}{self._tail()}")
        return report

    def _tail(self) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()[-25:]
        return "\n  its log ends:\n" + "\n".join(lines) if lines else ""

    def stop(self, timeout_s: float = 20.0) -> None:
        """Its stdin closed (a worker then ends on its own, its engine with it), then
        SIGTERM, then SIGKILL to its whole process group (vLLM's engine processes)."""
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        for ask in (None, self.process.terminate):
            if ask is not None and self.process.poll() is None:
                ask()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s / 2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, 9)
        self.process.wait()
        self._log.close()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of live processes, from /proc (0 for one that is gone)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def speed_probe_us() -> float:
    """The machine's speed now: the best of 5 timings of a fixed piece of Python
    (``sum(range(100_000))``), in µs. Taken each round: a shared virtual machine's speed
    drifts, and the report shows by how much."""
    best = math.inf
    for _ in range(5):
        began = time.perf_counter()
        sum(range(100_000))
        best = min(best, time.perf_counter() - began)
    return 1e6 * best


def system_busy_seconds() -> float:
    """CPU seconds every CPU has spent busy since boot (all processes), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait.
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLK_TCK


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from the parents /proc names)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


class Watch:
    """CPU taken around one measurement: the measured side's engine, the other side
    (idle meanwhile), and programs outside the benchmark (the machine is shared)."""

    def __init__(self, engine: list[int], idle: list[int], benchmark: list[int]) -> None:
        self._groups = {"engine": engine, "idle_side": idle, "benchmark": benchmark}
        self._wall = time.perf_counter()
        self._system = system_busy_seconds()
        self._before = {name: cpu_seconds(pids) for name, pids in self._groups.items()}

    def stop(self) -> dict[str, float]:
        used = {name: cpu_seconds(pids) - self._before[name] for name, pids in self._groups.items()}
        wall = time.perf_counter() - self._wall
        foreign = system_busy_seconds() - self._system - used["benchmark"]
        return {
            "engine_cpu_s": used["engine"],
            "idle_side_cpu_s": used["idle_side"],
            "foreign_cpu_load": max(foreign, 0.0) / wall,
        }


def vllm_environment() -> dict[str, str]:
    """The vLLM processes' environment: this one's less this venv, vLLM's CPU platform,
    its logs on stderr at WARNING, no telemetry, no hub look-ups."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    }
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_STREAM="ext://sys.stderr",
        VLLM_LOGGING_LEVEL="WARNING",
        VLLM_LOGGING_COLOR="0",
        NO_COLOR="1",
        VLLM_ENGINE_READY_TIMEOUT_S="180",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


def find_vllm_python(explicit: str | None) -> Path:
    """The vLLM 0.34 environment's interpreter: ``--vllm-python``, else
    ``$TRIO_ENGINECORE_VLLM_PYTHON``, else the newest complete ``.nox/vllm-0.34-*``.

    Raises:
        FileNotFoundError: none found (the message says how to build it).
    """
    given = explicit or os.environ.get(VLLM_PYTHON_VARIABLE)
    if given:
        # Absolute (the processes run elsewhere) but not resolved: a venv's bin/python
        # links to the base interpreter.
        python = Path(given).absolute()
        if not python.exists():
            raise FileNotFoundError(f"no interpreter at {python}")
        return python
    complete = sorted(
        (marker.parent for marker in (REPO / ".nox").glob(f"vllm-{VLLM_RELEASE}-*/recipe.json")),
        key=lambda env: env.stat().st_mtime,
    )
    for env in reversed(complete):
        if (env / "bin" / "python").exists():
            return env / "bin" / "python"
    raise FileNotFoundError(
        f"the vLLM {VLLM_RELEASE} environment (.nox/vllm-{VLLM_RELEASE}-<hash>) is absent: "
        f"`nox -s \"interop(vllm='{VLLM_RELEASE}')\"` builds it (once, a few minutes)"
    )


def vllm_version(python: Path) -> str | None:
    """vLLM's version in that environment, from its metadata (no import)."""
    for info in python.parent.parent.glob("lib/python*/site-packages/vllm-*.dist-info"):
        return info.name.removeprefix("vllm-").removesuffix(".dist-info")
    return None


def code_facts() -> dict[str, Any]:
    """Which code was measured: the commit, and the files of the package that differ
    from it (the working tree is what runs)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else ""

    # Porcelain lines are "XY path": the status columns may start with a space.
    changed = git("status", "--porcelain", "--", "trio_enginecore")
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip() or None,
        "package_changes": [line[3:] for line in changed.splitlines() if line.strip()],
    }


def machine_facts() -> dict[str, Any]:
    import tokenizers

    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tokenizers": tokenizers.__version__,
    }


@contextlib.contextmanager
def started(processes: list[Process]) -> Iterator[None]:
    try:
        yield
    finally:
        for process in reversed(processes):
            process.stop()


def run(args: argparse.Namespace, vllm_python: Path) -> dict[str, Any]:
    """Start the processes, measure every round, and return the raw results."""
    from tests.text.tokenizers_for_tests import write_tricky_dir
    from trio_enginecore.text import load_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="tec-text-bench-"))
    model_dir = write_tricky_dir(tmp / "model")
    tokenizer = load_tokenizer(model_dir)
    prompt_texts = prompts(tokenizer)
    waves = dict.fromkeys(CONCURRENCIES, 1) if args.quick else dict(WAVES)
    shared = {
        "model_dir": str(model_dir),
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": max(CONCURRENCIES),
    }
    env = vllm_environment()
    subprocess.run(
        [
            str(vllm_python),
            str(VLLM_WORKER),
            json.dumps({"role": "model", "vocab_size": tokenizer.vocab_size, **shared}),
        ],
        check=True,
        env=env,
        cwd=tmp,
        stdout=subprocess.DEVNULL,
    )
    addresses = {"input_address": f"ipc://{tmp}/in", "output_address": f"ipc://{tmp}/out"}
    load_before = os.getloadavg()
    code = code_facts()  # before anything runs: what the workers import
    begun = time.monotonic()
    processes: list[Process] = []
    with started(processes):
        # By path, from the temporary directory: nothing of this checkout but the
        # interop tests' vLLM side is importable in vLLM's processes.
        processes.append(
            Process(
                "vLLM's engine core for ours",
                [
                    str(vllm_python),
                    str(VLLM_WORKER),
                    json.dumps({"role": "engine", **shared, **addresses}),
                ],
                tmp / "engine.log",
                env=env,
                cwd=tmp,
            )
        )
        ours = Process(
            "our frontend",
            [
                sys.executable,
                "-m",
                "benchmarks.text",
                "--worker",
                json.dumps({**shared, **addresses, "prompts": prompt_texts}),
            ],
            tmp / "ours.log",
            env=dict(os.environ),
            cwd=REPO,
        )
        processes.append(ours)
        vllm = Process(
            "vLLM's AsyncLLM",
            [
                str(vllm_python),
                str(VLLM_WORKER),
                json.dumps(
                    {
                        "role": "frontend",
                        **shared,
                        "prompts": prompt_texts,
                        "output_tokens": OUTPUT_TOKENS,
                    }
                ),
            ],
            tmp / "vllm.log",
            env=env,
            cwd=tmp,
        )
        processes.append(vllm)
        engine_started = processes[0].report(240)
        ours_ready = ours.report(240)
        vllm_ready = vllm.report(240)
        print(
            f"ready: ours in {ours_ready['startup_s']:.1f} s, vLLM's AsyncLLM "
            f"{vllm_ready['vllm_version']} in {vllm_ready['startup_s']:.1f} s",
            file=sys.stderr,
        )
        workers = {"ours": ours, "vllm": vllm}
        # Each side's engine processes, and all of each side's processes: the engine's
        # load says whose pace a run went at; the idle side's, that it kept still.
        engine_pids = {"ours": engine_started["pids"], "vllm": vllm_ready["engine_pids"]}
        side_pids = {
            "ours": [ours.process.pid, processes[0].process.pid, *engine_pids["ours"]],
            "vllm": [vllm.process.pid, *engine_pids["vllm"]],
        }
        ours_all = descendants(os.getpid())
        runs: list[dict[str, Any]] = []
        replay: list[dict[str, Any]] = []
        probes: list[float] = []
        names = list(VARIANTS)
        for round_ in range(args.rounds):
            probes.append(speed_probe_us())
            for concurrency in CONCURRENCIES:
                # Rotate the order every round: no variant always runs first or last.
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    variant = VARIANTS[name]
                    side = variant["side"]
                    command = {
                        "cmd": "measure",
                        "concurrency": concurrency,
                        "requests": concurrency * waves[concurrency],
                        "stop": list(STOP_STRINGS) if variant["stop"] else [],
                        "detokenize": variant["detokenize"],
                    }
                    idle = side_pids["vllm" if side == "ours" else "ours"]
                    for attempt in range(1 + RETRIES):
                        watched = Watch(engine_pids[side], idle, ours_all)
                        workers[side].send(**command)
                        result = workers[side].report(600)
                        result.pop("event")
                        row = {
                            "variant": name,
                            "concurrency": concurrency,
                            "round": round_,
                            "attempt": attempt,
                            **result,
                            **watched.stop(),
                        }
                        # Another program took CPU meanwhile (the machine is shared):
                        # measure again, at most RETRIES times; the report says so.
                        if row["foreign_cpu_load"] <= FOREIGN_LOAD_LIMIT:
                            break
                        print(
                            f"  other programs used {row['foreign_cpu_load']:.2f} of a core: "
                            + ("again" if attempt < RETRIES else "kept"),
                            file=sys.stderr,
                        )
                    runs.append(row)
                    print(
                        f"round {round_ + 1}/{args.rounds}, C = {concurrency}, {name}: "
                        f"{1e6 * row['cpu_s'] / row['tokens']:.2f} µs/token, "
                        f"{row['tokens'] / row['wall_s']:,.0f} tokens/s",
                        file=sys.stderr,
                    )
            # The text layer alone, each round: its shares are taken against the same
            # round's end-to-end figures (the machine's speed drifts between rounds).
            ours.send(cmd="replay", requests=16 if args.quick else 32)
            replay += [{**r, "round": round_} for r in ours.report(300)["rows"]]
        ours.send(cmd="tokenize", calls=200 if args.quick else 2000)
        tokenize = ours.report(300)["rows"]
        profile = None
        if not args.no_profile:
            name, concurrency = PROFILED
            ours.send(
                cmd="measure",
                concurrency=concurrency,
                requests=concurrency * waves[concurrency],
                stop=list(STOP_STRINGS),
                detokenize=True,
                profile=True,
            )
            profiled = ours.report(600)
            profile = {
                "variant": name,
                "concurrency": concurrency,
                "cpu_us_per_token": 1e6 * profiled["cpu_s"] / profiled["tokens"],
                **profiled["profile"],
            }
        vllm.send(cmd="quit")
        ours.send(cmd="quit")
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "machine": {
            **machine_facts(),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "run_seconds": round(time.monotonic() - begun),
            "vllm": {"python": str(vllm_python), "version": vllm_ready["vllm_version"]},
            "code": code,
        },
        "quick": args.quick,
        "rounds": args.rounds,
        "workload": {
            "prompt_tokens": PROMPT_TOKENS,
            "prompts": prompt_texts,
            "output_tokens": OUTPUT_TOKENS,
            "requests_per_task": waves,
            "stop_strings": list(STOP_STRINGS),
            "output_kind": "DELTA",
            "tokenizer": "tests/text/tokenizers_for_tests.py write_tricky_dir "
            f"({tokenizer.vocab_size} tokens)",
            "engine": "vLLM's EngineCoreProc with the counter executor, zero step cost, "
            f"max_num_seqs {max(CONCURRENCIES)}, max_model_len {MAX_MODEL_LEN}",
            "engine_pid_for_ours": engine_started["pids"],
        },
        "runs": runs,
        "tokenize": tokenize,
        "replay": replay,
        "speed_probe_us": probes,
        "profile": profile,
    }


# ------------------------------------------------------------------ the report


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians per (variant, C), ratios to vLLM, the shares, the goal."""
    rows: list[dict[str, Any]] = []
    for concurrency in CONCURRENCIES:
        for name in VARIANTS:
            runs = [
                r
                for r in result["runs"]
                if r["variant"] == name and r["concurrency"] == concurrency
            ]
            if not runs:
                continue
            per_token = [1e6 * r["cpu_s"] / r["tokens"] for r in runs]
            rows.append(
                {
                    "variant": name,
                    "concurrency": concurrency,
                    "cpu_us_per_token": statistics.median(per_token),
                    "spread": max(per_token) / min(per_token),
                    "tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in runs),
                    "frontend_cpu_load": statistics.median(r["cpu_s"] / r["wall_s"] for r in runs),
                    "engine_cpu_load": statistics.median(
                        r["engine_cpu_s"] / r["wall_s"] for r in runs
                    ),
                    "idle_side_cpu_load": max(r["idle_side_cpu_s"] / r["wall_s"] for r in runs),
                    "foreign_cpu_load": max(r["foreign_cpu_load"] for r in runs),
                    "tokens_per_output": statistics.median(
                        r["tokens"] / r["outputs"] for r in runs
                    ),
                    "chars_per_token": statistics.median(r["chars"] / r["tokens"] for r in runs),
                    "gc_share": statistics.median(r["gc_s"] / r["cpu_s"] for r in runs),
                    "gc_collections": [
                        statistics.median(r["gc_collections"][g] for r in runs) for g in range(3)
                    ],
                    "tokens": runs[0]["tokens"],
                    "prompt_tokens_per_request": runs[0]["prompt_tokens"] / runs[0]["requests"],
                    "stopped": sum(r["stopped"] for r in runs),
                    "rounds": len(runs),
                }
            )

    def row(name: str, concurrency: int) -> dict[str, Any]:
        found = [r for r in rows if r["variant"] == name and r["concurrency"] == concurrency]
        return found[0] if found else {"cpu_us_per_token": math.nan, "tokens_per_output": 1.0}

    def replayed(case: str, per_output: int, round_: int | None = None) -> float:
        """A replay figure: one round's, or the median over the rounds."""
        found = [
            float(r["cpu_us_per_token"])
            for r in result.get("replay") or ()
            if r["case"] == case
            and r["tokens_per_output"] == per_output
            and (round_ is None or r["round"] == round_)
        ]
        return statistics.median(found) if found else math.nan

    replay_ks = sorted({r["tokens_per_output"] for r in result.get("replay") or ()})
    ratios, shares = [], []

    def per_round(name: str, concurrency: int) -> dict[int, float]:
        return {
            r["round"]: 1e6 * r["cpu_s"] / r["tokens"]
            for r in result["runs"]
            if r["variant"] == name and r["concurrency"] == concurrency
        }

    for concurrency in CONCURRENCIES:
        for ours, theirs in (("ours", "vllm"), ("ours, stop strings", "vllm, stop strings")):
            # Paired within each round (the two ran within seconds of each other), so
            # that the machine's own drift cancels; the median over the rounds.
            mine, theirs_ = per_round(ours, concurrency), per_round(theirs, concurrency)
            paired = [mine[r] / theirs_[r] for r in sorted(mine) if r in theirs_]
            ratios.append(
                {
                    "concurrency": concurrency,
                    "ours": ours,
                    "vllm": theirs,
                    "ratio": statistics.median(paired) if paired else math.nan,
                    "ratio_min": min(paired, default=math.nan),
                    "ratio_max": max(paired, default=math.nan),
                    "ratio_of_medians": row(ours, concurrency)["cpu_us_per_token"]
                    / row(theirs, concurrency)["cpu_us_per_token"],
                }
            )
        plain = row("ours", concurrency)
        stop = row("ours, stop strings", concurrency)
        floor = row("ours, tokens only", concurrency)
        share: dict[str, Any] = {
            "concurrency": concurrency,
            # End to end: what making text adds to the token-only floor, and what two
            # stop strings add to that (each reader's pace changes how many tokens an
            # output carries, so these mix the cost of text with the cost per output).
            "detokenization_us": plain["cpu_us_per_token"] - floor["cpu_us_per_token"],
            "stop_strings_us": stop["cpu_us_per_token"] - plain["cpu_us_per_token"],
        }
        if replay_ks:
            # Per round: the replay at the tokens per output that ours with stop strings
            # got in that round, against that round's end-to-end figure; the medians.
            per: dict[str, list[float]] = {}
            for r in result["runs"]:
                if r["variant"] != "ours, stop strings" or r["concurrency"] != concurrency:
                    continue
                got = r["tokens"] / r["outputs"]
                k = min(replay_ks, key=lambda candidate: abs(math.log(candidate / got)))
                total = 1e6 * r["cpu_s"] / r["tokens"]
                figures = {
                    "tokens_per_output": k,
                    "text_layer_us": replayed("text layer, stop strings", k, r["round"]),
                    "detokenization_us": replayed("text layer", k, r["round"])
                    - replayed("text layer, tokens only", k, r["round"]),
                    "decode_stream_us": replayed("DecodeStream.step, one id a call", k, r["round"]),
                    "stop_strings_us": replayed("text layer, stop strings", k, r["round"])
                    - replayed("text layer", k, r["round"]),
                }
                figures.update(
                    {
                        name.replace("_us", "_share"): value / total
                        for name, value in figures.items()
                        if name.endswith("_us")
                    }
                )
                for name, value in figures.items():
                    per.setdefault(name, []).append(value)
            share.update({f"replay_{name}": statistics.median(v) for name, v in per.items()})
        shares.append(share)
    worst = max(r["ratio"] for r in ratios)
    return {
        "medians": rows,
        "ratios": ratios,
        "shares": shares,
        "tokenize": _tokenize_verdict(result["tokenize"]),
        "goal": {
            "text": "ours at most half of vLLM's frontend CPU per output token",
            "threshold": 0.5,
            "worst_ratio": worst,
            "met": worst <= 0.5,
        },
        "stop_strings_never_matched": all(r["stopped"] == 0 for r in rows),
    }


def _tokenize_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Inline against a thread, per prompt length, and the prompt length above which a
    thread costs the Trio thread less than encoding inline does."""
    by_case = {r["case"]: r for r in rows}
    short, long = TOKENIZE_LENGTHS
    inline_short, inline_long = (
        by_case[f"inline, {short} tokens"],
        by_case[f"inline, {long} tokens"],
    )
    thread_short = by_case[f"to_thread, {short} tokens"]
    # The Trio thread's time inline grows with the prompt (a + b n); through a thread it
    # is the hand-off, about constant (the short prompt's figure).
    slope = (inline_long["trio_thread_us_per_call"] - inline_short["trio_thread_us_per_call"]) / (
        inline_long["prompt_tokens"] - inline_short["prompt_tokens"]
    )
    base = inline_short["trio_thread_us_per_call"] - slope * inline_short["prompt_tokens"]
    verdict: dict[str, Any] = {
        "encode_us_per_token": slope,
        "break_even_tokens": (thread_short["trio_thread_us_per_call"] - base) / slope,
    }
    for length in TOKENIZE_LENGTHS:
        inline, threaded = (
            by_case[f"inline, {length} tokens"],
            by_case[f"to_thread, {length} tokens"],
        )
        verdict[str(length)] = {
            "trio_thread_us": {
                "inline": inline["trio_thread_us_per_call"],
                "to_thread": threaded["trio_thread_us_per_call"],
            },
            "extra_cpu_us_through_thread": threaded["cpu_us_per_call"] - inline["cpu_us_per_call"],
            "extra_wall_us_through_thread": threaded["wall_us_per_call"]
            - inline["wall_us_per_call"],
        }
    return verdict


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _pct(value: float | None) -> str:
    return _fmt(None if value is None else 100 * value, ".0f") + " %"


def markdown(result: dict[str, Any], summary: dict[str, Any]) -> str:
    machine = result["machine"]
    work = result["workload"]
    goal = summary["goal"]
    waves = ", ".join(f"{w} at C = {c}" for c, w in work["requests_per_task"].items())
    stops = ", ".join(f"`{json.dumps(s)[1:-1]}`" for s in work["stop_strings"])
    never = (
        "no request finished on one"
        if summary["stop_strings_never_matched"]
        else "**a request finished on one: the stop-string figures are wrong**"
    )
    lines = [
        "# Text streams: frontend CPU per output token, ours against vLLM's AsyncLLM",
        "",
        f"Measured {machine['date']} on {machine['cpus']} CPUs ({machine['processor']}), "
        f"Python {machine['python']}, {machine['platform']}, tokenizers "
        f"{machine['tokenizers']}, vLLM {machine['vllm']['version']}. Load average "
        f"(1, 5, 15 min): {', '.join(map(str, machine['load_before']))} before the run, "
        f"{', '.join(map(str, machine['load_after']))} after it; the run took "
        f"{machine['run_seconds']} s. The machine's own speed (a fixed piece of Python "
        f"timed each round) varied from {min(result['speed_probe_us']):.0f} to "
        f"{max(result['speed_probe_us']):.0f} µs between rounds. Reproduce: "
        "`nox -s bench_text`"
        + (
            f" at commit {machine['code']['commit']}"
            + (
                " with uncommitted changes to "
                + ", ".join(f"`{f}`" for f in machine["code"]["package_changes"])
                if machine["code"]["package_changes"]
                else ""
            )
        )
        + (" (this was a `--quick` run: the figures mean nothing)." if result["quick"] else "."),
        "",
        f"Engine: {work['engine']}, one per frontend: ours attached to a vLLM engine "
        "core that vLLM's supervisor started for it, vLLM's `AsyncLLM` starting its own. "
        f"Workload: text prompts of {work['prompt_tokens']} tokens, "
        f"{work['output_tokens']} output tokens each (`ignore_eos`), "
        f"{work['output_kind']} outputs, each request read by one task (Trio for ours, "
        "asyncio iterating `AsyncLLM.generate` for vLLM), C tasks in a closed loop, "
        f"requests per task: {waves}. Tokenizer: {work['tokenizer']}. Stop strings: "
        f"{stops} (they never match: {never}).",
        "",
        "CPU is the frontend process's own (`time.process_time()` in it, all its "
        "threads), never the engine core's, per output token received. Medians of "
        f"{result['rounds']} rounds, variants alternating (order rotated each round); "
        "`spread` is max / min over the rounds. `frontend load` and `engine load`: CPU "
        "over wall time (1.0 is one core busy all along); an engine near 1.0 set the pace.",
        "",
        "## Goal",
        "",
        f"{goal['text']}: worst ratio {goal['worst_ratio']:.2f} "
        f"(goal ≤ {goal['threshold']}): **{'met' if goal['met'] else 'not met'}**.",
        "",
        "Ours ÷ vLLM, CPU per output token: the median over the rounds of the ratio "
        "within each round (the two ran seconds apart), the rounds' lowest and highest "
        "in brackets, and the ratio of the medians of the figures below.",
        "",
        "| C | no stop strings | 2 stop strings | ratio of medians, no stop / stop |",
        "|---:|---:|---:|---:|",
    ]
    for concurrency in CONCURRENCIES:
        pair = [r for r in summary["ratios"] if r["concurrency"] == concurrency]
        lines.append(
            f"| {concurrency} | "
            + " | ".join(
                f"{_fmt(r['ratio'], '.2f')} ({_fmt(r['ratio_min'], '.2f')}-"
                f"{_fmt(r['ratio_max'], '.2f')})"
                for r in pair
            )
            + " | "
            + " / ".join(_fmt(r["ratio_of_medians"], ".2f") for r in pair)
            + " |"
        )
    lines += [
        "",
        "## Figures",
        "",
        "| C | variant | CPU µs/token | spread | tokens/s | frontend load | engine load "
        "| tokens/output | chars/token | collections, gen 0/1/2 | in the collector |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["medians"]:
        lines.append(
            f"| {r['concurrency']} | {r['variant']} | {r['cpu_us_per_token']:.2f} | "
            f"{r['spread']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['frontend_cpu_load']:.2f} | {r['engine_cpu_load']:.2f} | "
            f"{r['tokens_per_output']:.1f} | {r['chars_per_token']:.2f} | "
            + "/".join(f"{c:.0f}" for c in r["gc_collections"])
            + f" | {_pct(r['gc_share'])} |"
        )
    idle = max(r["idle_side_cpu_load"] for r in summary["medians"])
    foreign = max(r["foreign_cpu_load"] for r in summary["medians"])
    retried = sum(1 for r in result["runs"] if r["attempt"])
    lines += [
        "",
        "`tokens/output`: output tokens per `RequestOutput` a reader got. Both frontends "
        "merge the delta outputs of a reader that fell behind, so a frontend that is "
        "cheaper per output gets more, smaller outputs: CPU per token depends on the "
        "reader's pace as well as on the work per token. `in the collector`: the share "
        "of that CPU spent in the garbage collector (timed with `gc.callbacks`; both "
        "frontends froze their startup heap and keep CPython's thresholds). The side not "
        "being measured "
        f"used at most {idle:.2f} of a core meanwhile (its idle loops and heartbeats); "
        f"programs outside the benchmark at most {foreign:.2f} of a core during a kept "
        f"measurement ({retried} measurement(s) taken again because others used more "
        f"than {FOREIGN_LOAD_LIMIT} of a core).",
        "",
        "## Where our CPU goes",
        "",
        "End to end, from the differences between our variants: making text "
        "(ours - tokens only) and two stop strings (with - without), per output token.",
        "",
        "| C | text | 2 stop strings |",
        "|---:|---:|---:|",
    ]
    for share in summary["shares"]:
        lines.append(
            f"| {share['concurrency']} | {share['detokenization_us']:.2f} µs | "
            f"{share['stop_strings_us']:.2f} µs |"
        )
    replay = result.get("replay") or []
    if replay:
        ks = sorted({r["tokens_per_output"] for r in replay})
        cases = list(dict.fromkeys(r["case"] for r in replay))
        lines += [
            "",
            "The text layer alone (a replay, each round: the counter model's token "
            "sequences fed to `TextRequestState.process` without client, engine or event "
            "loop, k tokens an engine output; and `DecodeStream.step` alone on the same "
            "ids), CPU µs per output token, medians over the rounds:",
            "",
            "| case | " + " | ".join(f"k = {k}" for k in ks) + " |",
            "|---|" + "---:|" * len(ks),
        ]
        for case in cases:
            cells = []
            for k in ks:
                found = [
                    r["cpu_us_per_token"]
                    for r in replay
                    if r["case"] == case and r["tokens_per_output"] == k
                ]
                cells.append(_fmt(statistics.median(found) if found else None, ".2f"))
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Shares of ours with stop strings, end to end: in each round, the replay at "
            "the tokens per output (k) that round's run got, over that run's CPU per "
            "token; medians over the rounds:",
            "",
            "| C | k | text layer, all of it | text (detokenizer) | of which "
            "`DecodeStream.step` | 2 stop strings |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for share in summary["shares"]:
            lines.append(
                f"| {share['concurrency']} | {share['replay_tokens_per_output']:g} | "
                + " | ".join(
                    f"{share[f'replay_{part}_us']:.2f} µs, {_pct(share[f'replay_{part}_share'])}"
                    for part in ("text_layer", "detokenization", "decode_stream", "stop_strings")
                )
                + " |"
            )
    profile = result.get("profile")
    if profile:
        lines += [
            "",
            f"cProfile of one more run ({profile['variant']}, C = {profile['concurrency']}"
            f": {profile['cpu_us_per_token']:.2f} µs/token under the profiler, which slows "
            "Python calls more than C calls, so the shares rank the costs and the figures "
            "above size them). Own time (`tottime`) of the Trio thread's functions:",
            "",
            "| group | share |",
            "|---|---:|",
            *(f"| {g['group']} | {100 * g['share']:.1f} % |" for g in profile["groups"]),
            "",
            "Cumulative (a function and what it calls): "
            + "; ".join(
                f"`{name}` {100 * share:.1f} %" for name, share in profile["cumulative"].items()
            )
            + ".",
            "",
            "| function (own time) | calls | share |",
            "|---|---:|---:|",
            *(
                f"| `{f['function']}` | {f['calls']:,} | {100 * f['share']:.1f} % |"
                for f in profile["top"]
            ),
        ]
    lines += [
        "",
        "## Prompt tokenization: on the Trio thread or through `trio.to_thread.run_sync`",
        "",
        "`tokenizer.encode` of one prompt, calls one after another. `Trio thread` is the "
        "time the Trio thread spent running tasks per call (a Trio instrument adds up the "
        "task steps: inline, the encode; through a thread, the hand-off); `longest hold` "
        "the longest single step, what every other stream waits at worst. The last row "
        "is a thread call that does nothing.",
        "",
        "| case | prompt tokens | wall µs/call | CPU µs/call | Trio thread µs/call "
        "| longest hold µs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["tokenize"]:
        lines.append(
            f"| {r['case']} | {_fmt(r['prompt_tokens'], 'd')} | "
            f"{r['wall_us_per_call']:.1f} | {r['cpu_us_per_call']:.1f} | "
            f"{r['trio_thread_us_per_call']:.1f} | {r['longest_hold_us']:.0f} |"
        )
    verdict = summary["tokenize"]
    short, long = (verdict[str(length)] for length in TOKENIZE_LENGTHS)
    lines += [
        "",
        f"At {TOKENIZE_LENGTHS[0]} tokens, encoding inline takes "
        f"{short['trio_thread_us']['inline']:.0f} µs of the Trio thread and going through a "
        f"thread {short['trio_thread_us']['to_thread']:.0f} µs (the hand-off), plus "
        f"{short['extra_cpu_us_through_thread']:.0f} µs more CPU in all and "
        f"{short['extra_wall_us_through_thread']:.0f} µs more latency: inline is cheaper on "
        f"every count. At {TOKENIZE_LENGTHS[1]} tokens, inline holds the Trio thread "
        f"{long['trio_thread_us']['inline'] / 1e3:.2f} ms (every stream waits); "
        f"through a thread it is held {long['trio_thread_us']['to_thread']:.0f} µs, for "
        f"{long['extra_cpu_us_through_thread']:.0f} µs more CPU: the thread pays where the "
        "Trio thread has streams to serve and a core is free for the encode. On the Trio "
        f"thread's time the two break even at about {verdict['break_even_tokens']:.0f} "
        f"prompt tokens (encoding costs {verdict['encode_us_per_token']:.2f} µs a token "
        "with this tokenizer; another tokenizer's cost per token moves the break-even).",
    ]
    return "\n".join(lines) + "\n"


def output_dir(out: Path | None, *, quick: bool) -> Path:
    """``out``, else the committed results for a full run and a temporary directory
    for a quick one (whose figures must never replace the committed ones)."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="tec-text-quick-")) if quick else RESULTS_DIR
    if quick and out.resolve() == RESULTS_DIR:
        raise ValueError("a --quick run does not replace the committed figures")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--vllm-python", default=None, metavar="PATH")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (5; quick: 1)")
    parser.add_argument("--quick", action="store_true", help="one small round: a smoke test")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile run")
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    try:
        out = output_dir(args.out, quick=args.quick)
        vllm_python = find_vllm_python(args.vllm_python)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    args.rounds = args.rounds or (1 if args.quick else 5)
    print(
        f"load average before the run: {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
        file=sys.stderr,
    )
    result = run(args, vllm_python)
    summary = summarize(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "text.json").write_text(json.dumps({**result, "summary": summary}, indent=1) + "\n")
    report = markdown(result, summary)
    (out / "text.md").write_text(report)
    print(report)
    print(f"results written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
