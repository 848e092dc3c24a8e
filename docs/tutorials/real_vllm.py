"""Serving a real vLLM model: the client launches vLLM's engine core, or joins one
started by hand.

    python docs/tutorials/real_vllm.py MODEL_DIR [--vllm COMMAND] [-- VLLM_SERVE_FLAGS...]

MODEL_DIR is a model directory with its tokenizer (``huggingface-cli download
Qwen/Qwen3-0.6B --local-dir qwen3`` makes one); COMMAND runs vLLM's command-line
interface (default: ``vllm``, found on PATH); the flags after ``--`` go to every
``vllm serve`` (``--max-model-len 4096``, ``--gpu-memory-utilization 0.8``...).
"""

import argparse
import shlex
import socket
import subprocess
import sys

import trio

from trio_enginecore import Liveness, RemoteEngines, VllmEngines, open_engine_client
from trio_enginecore.client import TrioMPClient
from trio_enginecore.text import AsyncLLM, load_tokenizer

# A long prompt's prefill, a slow first step, a utility that reloads weights: a step
# may take minutes on a real model. An engine that sends nothing for this long while
# it has work is hung (and killed): say how long is too long for your model.
LIVENESS = Liveness(progress_timeout_s=600)
# Loading weights and capturing CUDA graphs takes minutes, not seconds.
READY_TIMEOUT_S = 900


async def generate_text(client: TrioMPClient, model_dir: str) -> None:
    llm = AsyncLLM(client, load_tokenizer(model_dir))
    output = await llm.complete("The capital of France is", max_tokens=16, seed=0)
    (completion,) = output.outputs
    print(f"   {len(completion.token_ids)} tokens, finish reason {completion.finish_reason}:")
    print(f"   {completion.text!r}")


async def the_client_launches_vllm(model_dir: str, command: list[str], flags: list[str]) -> None:
    print("1. the client launches vLLM's engine core")
    vllm = VllmEngines(model_dir, flags, command=command)
    async with open_engine_client(
        vllm=vllm, ready_timeout_s=READY_TIMEOUT_S, liveness=LIVENESS
    ) as client:
        (ready,) = client.engines
        assert ready is not None
        (engine,) = client.statistics().engines
        print(f"   ready: vLLM {ready.vllm_version}, its launcher is pid {engine.pid}")
        await generate_text(client, model_dir)
    print("   the block is over: vLLM's processes are gone with it")


async def vllm_started_by_hand(model_dir: str, command: list[str], flags: list[str]) -> None:
    print("2. vLLM's engine core started by hand joins the client")
    with socket.socket() as probe:  # a free port, for this demonstration
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # On another host, with the client's address: the engine says HELLO there.
    serve = [*command, "serve", model_dir, "--headless"]
    serve += ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port)]
    serve += flags
    print(f"   $ {shlex.join(['vllm', *serve[len(command) :]])}")
    engine = await trio.lowlevel.open_process(
        serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        remote = RemoteEngines(f"tcp://127.0.0.1:{port}")
        async with open_engine_client(
            remote=remote, ready_timeout_s=READY_TIMEOUT_S, liveness=LIVENESS
        ) as client:
            (ready,) = client.engines
            assert ready is not None
            print(f"   joined: vLLM {ready.vllm_version}")
            await generate_text(client, model_dir)
    finally:
        # Started by hand, it is ours to stop: SIGTERM, which vLLM handles.
        engine.terminate()
        await engine.wait()
    print("   stopped by hand")


async def main() -> None:
    flags: list[str] = []
    argv = sys.argv[1:]
    if "--" in argv:  # what follows goes to `vllm serve`, untouched
        argv, flags = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--vllm", default="vllm", help="how to run vLLM's CLI")
    args = parser.parse_args(argv)
    command = shlex.split(args.vllm)
    await the_client_launches_vllm(args.model_dir, command, flags)
    await vllm_started_by_hand(args.model_dir, command, flags)


if __name__ == "__main__":
    trio.run(main)
