"""ZeroMQ CURVE for TCP sockets: key pairs, the two roles, and a Trio ZAP handler.

The client is the CURVE *server* of every connection (it binds; engines connect): it
holds a key pair and an allow-list of engine public keys, enforced by a ZAP handler
running as a Trio task in the client's context. An engine is a CURVE *client*: it holds
its own key pair and the client's public key, so it talks only to that client and
nobody on the path can read or alter the traffic.

Keys are Z85 text (40 characters), stored in ZeroMQ's certificate files
(``NAME.key`` public, ``NAME.key_secret`` both halves) as ``trio-enginecore keygen``
writes them.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
from collections.abc import Callable, Iterable, Set as AbstractSet
from pathlib import Path
from typing import Any, Final

import attrs
import trio
import zmq
import zmq.auth
from zmq.utils import z85

from ._zmq import TrioSocket, make_socket

__all__ = [
    "CurveClient",
    "CurveKeyPair",
    "CurveRefusal",
    "CurveRefusals",
    "CurveServer",
    "check_key_pair_name",
    "load_public_key",
    "local_engine_keys",
    "run_zap_handler",
    "write_key_pair",
]

logger = logging.getLogger("trio_enginecore.curve")

ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
_ZAP_VERSION: Final = b"1.0"
_KEY_LENGTH: Final = 40


def _public_key(key: bytes) -> bytes:
    return _check_key(key, "the public key")


def _secret_key(key: bytes) -> bytes:
    return _check_key(key, "the secret key")


def _server_key(key: bytes) -> bytes:
    return _check_key(key, "the server key")


def _public_keys(keys: Iterable[str | bytes | os.PathLike[str]]) -> frozenset[bytes]:
    return frozenset(load_public_key(k) for k in keys)


def _check_key(key: bytes, what: str) -> bytes:
    if len(key) != _KEY_LENGTH:
        raise ValueError(f"{what} must be a 40-character Z85 CURVE key, got {len(key)} bytes")
    try:
        z85.decode(key)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{what} is not valid Z85: {exc}") from exc
    return key


@attrs.frozen(repr=False)
class CurveKeyPair:
    """A CURVE key pair (Z85). The secret half is kept out of ``repr``."""

    public: bytes = attrs.field(converter=_public_key)
    secret: bytes = attrs.field(converter=_secret_key)

    def __repr__(self) -> str:
        return f"CurveKeyPair(public={self.public.decode()!r}, secret=<hidden>)"

    @classmethod
    def generate(cls) -> CurveKeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CurveKeyPair:
        """Read a secret certificate file (``NAME.key_secret``).

        Raises:
            ValueError: the file holds no secret key (a public certificate?).
            OSError: it cannot be read.
        """
        public, secret = zmq.auth.load_certificate(path)  # pyright: ignore[reportUnknownMemberType]
        if secret is None:
            raise ValueError(f"{os.fspath(path)} holds no secret key (is it the public .key file?)")
        return cls(public, secret)


def load_public_key(source: str | bytes | os.PathLike[str]) -> bytes:
    """A public key given as Z85 text or as the path of a certificate file."""
    if isinstance(source, bytes):
        return _check_key(source, "the public key")
    if isinstance(source, str) and len(source) == _KEY_LENGTH and not os.path.exists(source):
        return _check_key(source.encode("ascii"), "the public key")
    public, _ = zmq.auth.load_certificate(source)  # pyright: ignore[reportUnknownMemberType]
    return _check_key(public, f"the public key in {os.fspath(source)}")


def check_key_pair_name(name: str) -> None:
    """Refuse a key pair name that is not a plain file name stem.

    Raises:
        ValueError: ``name`` is empty, ``.`` or ``..``, or holds a path separator.
    """
    if not name:
        raise ValueError("a key pair's name must not be empty")
    separators = [sep for sep in (os.sep, os.altsep, "/") if sep]
    if name in (".", "..") or any(sep in name for sep in separators) or "\0" in name:
        raise ValueError(
            f"a key pair's name is a file name stem, not a path: got {name!r} (give the "
            "folder as the directory)"
        )


def write_key_pair(
    directory: str | os.PathLike[str], name: str, *, overwrite: bool = False
) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (mode 0600) in ``directory``.

    ``directory`` is created if needed. The secret file is mode 0600 before any key is
    written in it.

    Returns the two paths.

    Raises:
        ValueError: ``name`` is empty, ``.`` or ``..``, or holds a path separator.
        FileExistsError: ``NAME.key`` or ``NAME.key_secret`` is already there and
            ``overwrite`` is false (nothing was written); its ``filename`` is that file.
        OSError: the directory or the files cannot be written.
    """
    check_key_pair_name(name)
    folder = Path(directory)
    public = folder / f"{name}.key"
    secret = folder / f"{name}.key_secret"
    folder.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (0 if overwrite else os.O_EXCL)
    created: list[Path] = []
    try:
        # Create both files first, the secret one 0600: O_EXCL refuses an existing one
        # even if it appeared just now, and the secret is never readable by others.
        for path, mode in ((secret, 0o600), (public, 0o644)):
            try:
                os.close(os.open(path, flags, mode))
            except FileExistsError as exc:
                raise FileExistsError(
                    errno.EEXIST,
                    f"{path} already exists: not overwriting a key pair (pass "
                    "overwrite=True to replace it)",
                    str(path),
                ) from exc
            created.append(path)
        os.chmod(secret, 0o600)
        zmq.auth.create_certificates(folder, name)  # pyright: ignore[reportUnknownMemberType]
    except BaseException:
        if not overwrite:
            for path in created:
                path.unlink(missing_ok=True)
        raise
    return public, secret


@attrs.frozen
class CurveServer:
    """The client's side: its key pair and the engines' public keys it admits."""

    keys: CurveKeyPair
    allowed: frozenset[bytes] = attrs.field(converter=_public_keys)

    @classmethod
    def from_files(
        cls, secret_file: str | os.PathLike[str], allowed: Iterable[str | bytes | os.PathLike[str]]
    ) -> CurveServer:
        """Load the key pair from a secret certificate; ``allowed`` holds Z85 keys or
        certificate paths."""
        return cls(CurveKeyPair.load(secret_file), _public_keys(allowed))

    def as_client_of_itself(self) -> CurveClient:
        """The CURVE client role for a peer holding the same key pair (a client of a
        data-parallel group connecting to the group's coordinator)."""
        return CurveClient(self.keys, self.keys.public)

    def apply(self, sock: TrioSocket) -> None:
        """Make ``sock`` (not bound yet) a CURVE server."""
        raw = sock.raw
        raw.curve_server = True
        raw.curve_secretkey = self.keys.secret
        raw.curve_publickey = self.keys.public


@attrs.frozen
class CurveClient:
    """An engine's side: its key pair and the public key of the client it joins."""

    keys: CurveKeyPair
    server_key: bytes = attrs.field(converter=_server_key)

    def apply(self, sock: TrioSocket) -> None:
        """Make ``sock`` (not connected yet) a CURVE client of the server."""
        raw = sock.raw
        raw.curve_serverkey = self.server_key
        raw.curve_publickey = self.keys.public
        raw.curve_secretkey = self.keys.secret


@attrs.frozen
class CurveRefusal:
    """A connection the ZAP handler refused."""

    address: str
    public_key: str | None
    reason: str

    def __str__(self) -> str:
        key = f" with public key {self.public_key}" if self.public_key else ""
        return f"{self.address}{key}: {self.reason}"


@attrs.define
class CurveRefusals:
    """A bounded record of the connections a ZAP handler refused.

    A refused peer that keeps connecting again (a stranger engine its supervisor
    restarts, a peer presenting a new key each time) must not make it grow: it counts
    every refusal, keeps the most recent ``keep`` of them and the counts of the first
    ``keep_keys`` distinct public keys.
    """

    keep: int = 16
    keep_keys: int = 8
    total: int = 0
    recent: collections.deque[CurveRefusal] = attrs.field(init=False)
    keys: dict[str, int] = attrs.field(init=False, factory=dict[str, int])
    """Refusals per public key, for the first ``keep_keys`` distinct keys."""
    other_keys: int = 0
    """Refusals of keys beyond those, which are not kept."""
    without_key: int = 0
    """Refusals of connections that presented no CURVE key."""

    def __attrs_post_init__(self) -> None:
        self.recent = collections.deque(maxlen=self.keep)

    def add(self, refusal: CurveRefusal) -> None:
        """Record one refusal."""
        self.total += 1
        self.recent.append(refusal)
        key = refusal.public_key
        if key is None:
            self.without_key += 1
        elif key in self.keys or len(self.keys) < self.keep_keys:
            self.keys[key] = self.keys.get(key, 0) + 1
        else:
            self.other_keys += 1

    def __bool__(self) -> bool:
        return self.total > 0

    def describe(self, *, latest: int = 3) -> str:
        """One line: how many were refused, which keys, the ``latest`` most recent."""
        who = [f"{count} with public key {key}" for key, count in self.keys.items()]
        if self.other_keys:
            who.append(f"{self.other_keys} with other public keys")
        if self.without_key:
            who.append(f"{self.without_key} without a CURVE key")
        last = "; ".join(str(refusal) for refusal in list(self.recent)[-latest:])
        return (
            f"CURVE authentication refused {self.total} connection(s) ({', '.join(who)}), "
            f"most recently {last}"
        )


async def run_zap_handler(
    ctx: zmq.Context[Any],
    allowed: AbstractSet[bytes],
    on_refusal: Callable[[CurveRefusal], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer ZeroMQ's authentication requests for ``ctx`` until cancelled.

    Admits CURVE connections whose public key is in ``allowed`` (read at each
    request: keys added to a mutable set are admitted from then on); refuses everything
    else (other mechanisms included) and reports each refusal to ``on_refusal``. Reports
    started once bound: CURVE server sockets must be bound after that, or libzmq admits
    their peers unchecked.
    """
    sock = make_socket(ctx, zmq.REP)
    try:
        sock.bind(ZAP_ENDPOINT)
        task_status.started()
        while True:
            frames = [bytes(f) for f in await sock.recv_multipart()]
            reply = _answer(frames, allowed, on_refusal)
            await sock.send_multipart(reply)
    finally:
        sock.close()


def _answer(
    frames: list[bytes], allowed: AbstractSet[bytes], on_refusal: Callable[[CurveRefusal], None]
) -> list[bytes]:
    """The ZAP reply (RFC 27) to one request (pure)."""
    if len(frames) < 6 or frames[0] != _ZAP_VERSION:
        request_id = frames[1] if len(frames) > 1 else b""
        return [_ZAP_VERSION, request_id, b"500", b"invalid ZAP request", b"", b""]
    request_id, address, mechanism = frames[1], frames[3], frames[5]
    credentials = frames[6:]
    peer = address.decode("ascii", "replace")
    if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
        reason = f"mechanism {mechanism.decode('ascii', 'replace')}, CURVE required"
        on_refusal(CurveRefusal(peer, None, reason))
        return [_ZAP_VERSION, request_id, b"400", reason.encode(), b"", b""]
    key = z85.encode(credentials[0])
    if key not in allowed:
        reason = "public key not in the allow-list"
        on_refusal(CurveRefusal(peer, key.decode("ascii"), reason))
        return [_ZAP_VERSION, request_id, b"400", reason.encode(), b"", b""]
    return [_ZAP_VERSION, request_id, b"200", b"OK", key, b""]


def local_engine_keys(directory: str, curve: CurveServer) -> tuple[bytes, list[str]]:
    """A key pair for the engines a client launches beside CURVE-authenticated remote
    ones, its secret written in ``directory``: the public key to admit, and the
    engines' command-line arguments."""
    public, secret = write_key_pair(directory, "local-engines")
    server_key = curve.keys.public.decode("ascii")
    # "=": a Z85 key may start with "-", which argparse would take for an option.
    arguments = ["--curve-secret-key", str(secret), f"--curve-server-key={server_key}"]
    return load_public_key(public), arguments
