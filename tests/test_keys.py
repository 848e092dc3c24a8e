"""A secret key file is never readable by others, not even while it is being written.

``write_key_pair`` creates ``NAME.key_secret`` with mode 0600 (``O_EXCL``: never an
existing file) before any key is written in it, whatever the umask. Checking the mode
once the pair is written would not tell that apart from writing the file with the
umask's mode and restricting it afterwards, so these tests look *during* the writes:

* an audit hook (in a subprocess, where it cannot outlive the test) looks at every
  file of the directory at each file operation the writes make: opening, changing a
  mode, renaming;
* a second process polls the secret file's mode in a loop while hundreds of pairs are
  written, on another core.

Both run under umask 022, where a file written plainly is 0644.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trio_enginecore._curve import CurveKeyPair, load_public_key, write_key_pair

PAIRS = 300

AUDITED_WRITER = r"""
import json, os, stat, sys
from trio_enginecore._curve import write_key_pair

directory = sys.argv[1]
seen = {"checks": 0, "readable_by_others": []}
active = False

def check(event, args):
    if not active or event not in ("open", "os.chmod", "os.rename", "os.replace"):
        return
    for name in os.listdir(directory):
        if name.endswith(".key"):
            continue  # a public key: readable by anyone on purpose
        try:
            mode = stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode)
        except FileNotFoundError:
            continue
        seen["checks"] += 1
        if mode & 0o077:
            seen["readable_by_others"].append([event, name, oct(mode)])

sys.addaudithook(check)
os.umask(0o022)
for i in range(int(sys.argv[2])):
    active = True
    write_key_pair(directory, f"pair-{i}", overwrite=i % 2 == 1)
    active = False
    for suffix in (".key", ".key_secret"):
        os.unlink(os.path.join(directory, f"pair-{i}{suffix}"))
print(json.dumps(seen))
"""

POLLER = r"""
import json, os, stat, sys
path, stop = sys.argv[1], sys.argv[2]
seen = {"checks": 0, "readable_by_others": []}
print("polling", flush=True)
while not os.path.exists(stop):
    for _ in range(1000):
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            continue
        seen["checks"] += 1
        if mode & 0o077:
            seen["readable_by_others"].append(oct(mode))
print(json.dumps(seen))
"""


def test_no_file_but_the_public_key_is_readable_by_others_at_any_step(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", AUDITED_WRITER, str(tmp_path), str(PAIRS)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    seen = json.loads(result.stdout)
    assert seen["readable_by_others"] == []
    # The hook did look while the secret files existed (creating, writing them).
    assert seen["checks"] >= PAIRS


def test_a_process_polling_the_secret_file_never_sees_it_readable_by_others(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "engine.key_secret"
    stop = tmp_path / "stop"
    poller = subprocess.Popen(
        [sys.executable, "-c", POLLER, str(secret), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert poller.stdout is not None
        assert poller.stdout.readline() == "polling\n"
        writer = f"""
import os
from trio_enginecore._curve import write_key_pair
os.umask(0o022)
for i in range({PAIRS}):
    write_key_pair({str(tmp_path)!r}, "engine", overwrite=i % 2 == 1)
    if i % 2 == 1:
        os.unlink({str(secret)!r})
        os.unlink({str(tmp_path / "engine.key")!r})
"""
        subprocess.run([sys.executable, "-c", writer], check=True, timeout=60)
        stop.touch()
        out, _ = poller.communicate(timeout=30)
    finally:
        if poller.poll() is None:
            poller.kill()
            poller.wait()
    seen = json.loads(out)
    assert seen["readable_by_others"] == []
    assert seen["checks"] > 0, "the poller never saw the secret file: the test saw nothing"


def test_overwriting_a_pair_whose_secret_file_others_could_read_restricts_it_first(
    tmp_path: Path,
) -> None:
    public, secret = write_key_pair(tmp_path, "engine")
    secret.chmod(0o644)  # someone loosened it
    write_key_pair(tmp_path, "engine", overwrite=True)
    assert oct(secret.stat().st_mode & 0o777) == oct(0o600)
    assert CurveKeyPair.load(secret).public == load_public_key(public)
