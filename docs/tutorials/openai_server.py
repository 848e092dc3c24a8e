"""Serving OpenAI's API: `trio-enginecore api-server`, driven by the official `openai`
package and by curl.

The program starts the server as you would in a shell, asks it for text three ways
(a completion, a streamed chat, curl), reads its Prometheus metrics, and stops it with
SIGTERM, as a process manager would.
"""

import json
import shutil
import signal
import subprocess
import sys

import openai

# `trio-enginecore api-server` with no arguments serves the built-in engine on
# 127.0.0.1:8000; --port 0 picks a free port, which a line on stderr names
# ("trio-enginecore api-server: serving 'ngram' on http://127.0.0.1:PORT").
server = subprocess.Popen(
    [
        sys.executable,
        "-m",
        "trio_enginecore",
        "api-server",
        "--port",
        "0",
        "--log-level",
        "warning",
    ],
    stderr=subprocess.PIPE,
    text=True,
)
assert server.stderr is not None
for line in server.stderr:
    if line.startswith("trio-enginecore api-server: serving"):
        url = line.split()[-1]
        break
else:
    sys.exit(f"the server exited with code {server.wait()}")
print("server:", url)

client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")  # no --api-key: any key

# A completion. `seed` makes the built-in model's sampling repeatable.
completion = client.completions.create(
    model="ngram", prompt="The river", max_tokens=60, seed=1, stop=["."]
)
choice = completion.choices[0]
print("completion:", repr(choice.text), choice.finish_reason, completion.usage.completion_tokens)

# A chat, streamed: the first chunk names the role, the last says why it stopped.
stream = client.chat.completions.create(
    model="ngram",
    messages=[{"role": "user", "content": "Tell me about the river."}],
    max_completion_tokens=24,
    seed=1,
    stream=True,
    stream_options={"include_usage": True},
)
pieces = []
for chunk in stream:
    if chunk.choices:
        delta = chunk.choices[0].delta
        pieces.append(delta.content or "")
        if chunk.choices[0].finish_reason:
            print("chat finished:", chunk.choices[0].finish_reason)
    else:
        print("usage chunk:", chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
print("chat:", repr("".join(pieces)))

# Errors are OpenAI's: the client raises its own exception types.
try:
    client.completions.create(model="ngram", prompt="The river", n=0)
except openai.BadRequestError as error:
    print("refused:", error.status_code, error.body["message"])

# curl, as a shell script would call it (when curl is installed).
if shutil.which("curl"):
    body = json.dumps({"model": "ngram", "prompt": "The river", "max_tokens": 8, "seed": 1})
    answer = subprocess.run(
        ["curl", "-s", f"{url}/v1/completions", "-H", "Content-Type: application/json", "-d", body],
        capture_output=True,
        text=True,
        check=True,
    )
    print("curl:", repr(json.loads(answer.stdout)["choices"][0]["text"]))

# vLLM's metrics, under vLLM's names: existing dashboards read them unchanged.
metrics = subprocess.run(
    ["curl", "-s", f"{url}/metrics"], capture_output=True, text=True, check=False
).stdout
for line in metrics.splitlines():
    if line.startswith("vllm:request_success_total") and 'finished_reason="stop"' in line:
        print("metrics:", line)

# SIGTERM: the server stops accepting, lets what is in flight finish, stops its engine.
server.send_signal(signal.SIGTERM)
print("exit code:", server.wait(timeout=60))
