"""CurveZMQ for tcp:// sockets: a deployment's key pairs and the handshake gatekeeper.

``generate_keys(DIR)`` (``omniflow keys DIR``) writes, in an owner-only folder::

    server.key  server.key_secret    every bound socket (actors, clients' reply sockets)
    client.key  client.key_secret    every connecting socket
    authorized/client.key            the client public keys a server lets in

Every process of a deployment holds both pairs: actors bind (and so serve) and connect
(and so are clients of the next hop and of the caller's reply socket). A bound socket
is a CURVE server whose ZAP handler (a ``Gatekeeper``, one per ZeroMQ context) admits
only the public keys in ``authorized/``: a peer without keys fails the handshake (no
common mechanism), one with a key not listed is refused by the handler, and each
refusal is logged, at most once per ``LOG_EVERY_S`` with a count of those it folded.
Adding a client is copying its ``*.key`` (public half) into ``authorized/``.

ipc:// sockets never use CURVE: they sit in the owner-only run dir.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any, NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from omniflow.transport.throttle import LOG_EVERY_S, Throttled

log = logging.getLogger(__name__)

ZAP_DOMAIN = "omniflow"


class UntrustedPath(PermissionError):
    """A folder another user owns or may write, where only ours will do."""


def check_private(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> None:
    """Raise ``UntrustedPath`` naming the first folder from ``root`` (default: ``path``)
    down to ``path`` that is a link, is not ours, or that group or others may write."""
    path = Path(path)
    top = Path(root) if root is not None else path
    chain = [path, *path.parents]
    if top not in chain:
        raise ValueError(f"{top} is not {path} or a folder above it")
    for folder in reversed(chain[: chain.index(top) + 1]):
        st = os.stat(folder, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise UntrustedPath(f"{folder}: a link or not a folder; refusing to use it")
        if st.st_uid != os.getuid():
            raise UntrustedPath(
                f"{folder}: owned by uid {st.st_uid}, not {os.getuid()}; refusing to use it "
                "(remove it, or set OMNIFLOW_RUN_ROOT to a folder of yours)"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UntrustedPath(
                f"{folder}: writable by group or others ({oct(stat.S_IMODE(st.st_mode))}); "
                "refusing to use it (chmod go-w it)"
            )


class KeysError(ValueError):
    """A keys folder that cannot be used: missing files, or secrets others can read."""


class Keys(NamedTuple):
    folder: Path
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def authorized(self) -> Path:
        return self.folder / "authorized"


def generate_keys(folder: str | os.PathLike[str], *, force: bool = False) -> Keys:
    """New server and client key pairs in ``folder`` (created owner-only)."""
    from omniflow.transport.endpoint import private_dir

    folder = Path(folder)
    private_dir(folder)
    if not force and (folder / "server.key_secret").exists():
        raise KeysError(f"{folder}: already holds keys (remove them first, or force)")
    for name in ("server", "client"):
        public, secret = zmq.auth.create_certificates(folder, name)
        for path in (public, secret):
            os.chmod(path, 0o600)  # pyzmq writes them with the umask's mode
    authorized = folder / "authorized"
    private_dir(authorized)
    for old in authorized.glob("*.key"):
        old.unlink()
    shutil.copyfile(folder / "client.key", authorized / "client.key")
    return load_keys(folder)


def load_keys(folder: str | os.PathLike[str]) -> Keys:
    """The key pairs in ``folder``; ``KeysError`` naming the file that is missing or exposed."""
    folder = Path(folder).expanduser()
    pairs: list[bytes] = []
    for name in ("server", "client"):
        path = folder / f"{name}.key_secret"
        try:
            st = path.stat()
        except OSError as e:
            message = f"{path}: {e.strerror} (make keys with `omniflow keys {folder}`)"
            raise KeysError(message) from None
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise KeysError(
                f"{path}: a secret key readable by others ({oct(stat.S_IMODE(st.st_mode))}) "
                f"or owned by uid {st.st_uid}; chmod 600 it"
            )
        public, secret = zmq.auth.load_certificate(path)
        if not public or not secret:
            raise KeysError(f"{path}: holds no CURVE key pair")
        pairs += [public, secret]
    if not (folder / "authorized").is_dir():
        raise KeysError(f"{folder / 'authorized'}: missing (the client keys a server admits)")
    try:  # another user who may write the folder may add a key that it admits
        check_private(folder / "authorized", folder)
    except UntrustedPath as e:
        raise KeysError(str(e)) from None
    return Keys(folder, *pairs)


def secure_server(sock: zmq.Socket, keys: Keys) -> None:
    """Make ``sock`` (before it binds) a CURVE server behind its context's gatekeeper."""
    Gatekeeper.of(sock.context, keys)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: Keys) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the deployment's servers."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class Gatekeeper(ThreadAuthenticator):
    """The ZAP handler of one context: admits the keys in ``authorized/``, logs refusals."""

    _lock = threading.Lock()
    _by_context: dict[int, Gatekeeper] = {}

    @classmethod
    def of(cls, ctx: zmq.Context, keys: Keys) -> Gatekeeper:
        with cls._lock:
            keeper = cls._by_context.get(id(ctx))
            if keeper is None:
                keeper = cls(ctx, log=logging.getLogger(f"{__name__}.zap"))
                keeper.start()
                keeper.configure_curve(domain=ZAP_DOMAIN, location=str(keys.authorized))
                cls._by_context[id(ctx)] = keeper
            keeper.users += 1
            return keeper

    @classmethod
    def release(cls, ctx: zmq.Context) -> None:
        """One server socket of ``ctx`` closed; the last one stops the handler."""
        with cls._lock:
            keeper = cls._by_context.get(id(ctx))
            if keeper is None:
                return
            keeper.users -= 1
            if keeper.users > 0:
                return
            del cls._by_context[id(ctx)]
        keeper.stop()

    def __init__(self, ctx: zmq.Context, log: Any) -> None:
        super().__init__(ctx, log=log)
        self.users = 0
        self.refusals = Refusals()
        self._address = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def _send_zap_reply(
        self, request_id: bytes, status_code: bytes, status_text: bytes, user_id: str = ""
    ) -> None:
        super()._send_zap_reply(request_id, status_code, status_text, user_id or "anonymous")
        if status_code != b"200":
            why = status_text.decode("utf-8", "replace")
            self.refusals.note(f"from {self._address}: {why} (its key is not in authorized/)")


class Refusals(Throttled):
    """Refused handshakes, logged at most once per ``LOG_EVERY_S`` (a flood of strangers
    must not flood the log); the next report counts the ones folded into it."""

    def __init__(self) -> None:
        super().__init__(log, "refused a CURVE handshake %s", LOG_EVERY_S)


# Handshake failures a CURVE server's monitor reports: a peer without keys (no common
# mechanism) or one whose CURVE hello does not decrypt under the server key.
HANDSHAKE_FAILED = int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def describe_failure(event: dict[str, Any]) -> str:
    """A refusal reported by a socket monitor, in words."""
    where = event.get("endpoint", b"")
    where = where.decode("utf-8", "replace") if isinstance(where, bytes) else str(where)
    if event.get("event") == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"on {where}: the peer speaks no CURVE, or not with this deployment's server key"
    return f"on {where}: the handshake failed (a peer without CURVE keys, or one that hung up)"
