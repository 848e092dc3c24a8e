"""The client's cost per token against engines of each vLLM release, in one run.

    python -m benchmarks.releases [--rounds N] [--duration-s S] [--out DIR]

vLLM 0.34 reads prompts as int32 arrays where 0.33 reads lists of ints, so the client
packs every prompt it sends a 0.34 engine (``serial.request_for``). This measures what
that costs: the Trio client, batch API and per-request streams, against the reference
engine presenting itself as each supported release (``EngineConfig.vllm_version``: the
same engine, only the wire form differs), releases alternating within each round. Two
workloads: the usual one (8-token prompts, 64 tokens out) and a prompt-heavy one
(1024-token prompts, 8 tokens out), where packing weighs most per output token.

Every figure is the median over ``--rounds``; the report gives each release's client CPU
per output token, the ratio of each release to the oldest, and the spread of the
oldest's own rounds (max / min), the noise a ratio is to be read against. Writes
``releases.json`` and ``releases.md`` into ``--out`` (``benchmarks/results`` by
default).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

from trio_enginecore import EngineConfig, open_engine_client
from trio_enginecore._bench import Mode, measure_generate
from trio_enginecore.dialects import DIALECTS

RESULTS = Path(__file__).resolve().parent / "results"
CONCURRENCY = 64
WORKLOADS: dict[str, tuple[int, int]] = {"short prompts": (8, 64), "long prompts": (1024, 8)}
"""name -> (prompt tokens, output tokens)"""
MODES: tuple[Mode, ...] = ("batch", "stream")


async def measure(version: str, duration_s: float) -> dict[str, float]:
    """CPU µs per output token of every (workload, mode), one engine of ``version``."""
    figures: dict[str, float] = {}
    config = EngineConfig(vllm_version=version, max_num_seqs=CONCURRENCY, max_model_len=4096)
    async with open_engine_client(config) as client:
        # A short warm-up: imports, first allocations, the engine's first steps.
        await measure_generate(client, concurrency=8, tokens=8, duration_s=0.5, mode="batch")
        for workload, (prompt_len, tokens) in WORKLOADS.items():
            for mode in MODES:
                result = await measure_generate(
                    client,
                    concurrency=CONCURRENCY,
                    tokens=tokens,
                    duration_s=duration_s,
                    mode=mode,
                    prompt_len=prompt_len,
                )
                figures[f"{workload}/{mode}"] = result["cpu_us_per_token"]
    return figures


async def run(rounds: int, duration_s: float) -> dict[str, Any]:
    versions = [dialect.tested_version for dialect in DIALECTS]
    runs: dict[str, list[dict[str, float]]] = {version: [] for version in versions}
    for round_ in range(rounds):
        # Alternate the order, so that neither release always runs on a warmer machine.
        order = versions if round_ % 2 == 0 else versions[::-1]
        for version in order:
            print(f"round {round_ + 1}/{rounds}: vLLM {version}", file=sys.stderr)
            runs[version].append(await measure(version, duration_s))
    keys = list(runs[versions[0]][0])
    medians = {v: {k: statistics.median(r[k] for r in runs[v]) for k in keys} for v in versions}
    oldest = versions[0]
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "python": platform.python_version(),
            "cpus": len(__import__("os").sched_getaffinity(0)),
        },
        "rounds": rounds,
        "duration_s": duration_s,
        "concurrency": CONCURRENCY,
        "workloads": {
            k: {"prompt_tokens": p, "output_tokens": t} for k, (p, t) in WORKLOADS.items()
        },
        "runs": runs,
        "medians_cpu_us_per_token": medians,
        "ratio_to_oldest": {
            v: {k: medians[v][k] / medians[oldest][k] for k in keys} for v in versions
        },
        "oldest_spread": {
            k: max(r[k] for r in runs[oldest]) / min(r[k] for r in runs[oldest]) for k in keys
        },
    }


def report(result: dict[str, Any]) -> str:
    versions = list(result["medians_cpu_us_per_token"])
    oldest, keys = versions[0], list(result["oldest_spread"])
    lines = [
        "# Client CPU per output token, by the engine's vLLM release",
        "",
        f"{result['date']}, Python {result['machine']['python']}, "
        f"{result['machine']['cpus']} CPUs; C = {result['concurrency']}, median of "
        f"{result['rounds']} rounds of {result['duration_s']:g} s each, releases alternating. "
        "The reference engine, presenting itself as each release: only the wire form "
        "differs. Reproduce: `nox -s bench_releases`.",
        "",
        "| workload / API | "
        + " | ".join(f"vLLM {v} (µs/token)" for v in versions)
        + " | "
        + " | ".join(f"{v} / {oldest}" for v in versions[1:])
        + f" | spread of {oldest}'s rounds |",
        "|---|" + "---|" * (2 * len(versions) - 1) + "---|",
    ]
    for key in keys:
        cells = [f"{result['medians_cpu_us_per_token'][v][key]:.2f}" for v in versions]
        ratios = [f"{result['ratio_to_oldest'][v][key]:.3f}" for v in versions[1:]]
        spread = f"{result['oldest_spread'][key]:.3f}"
        lines.append(f"| {key} | " + " | ".join(cells + ratios) + f" | {spread} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = trio.run(run, args.rounds, args.duration_s)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "releases.json").write_text(json.dumps(result, indent=2) + "\n")
    text = report(result)
    (args.out / "releases.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
