"""A named shared-memory segment: one file in /dev/shm, mapped once per process.

Raw ``os.open`` + ``mmap`` rather than ``multiprocessing.shared_memory``: on Python
3.11 the latter registers every *attached* segment with the resource tracker, which
unlinks it when that process exits, tearing the pool out from under its siblings.
Here only ``unlink()`` removes the file, and only the creator should call it.

The same file descriptor carries the cross-process lock (``flock``, cheap when
uncontended). The kernel drops a flock when its holder dies, so a ``kill -9`` never
leaves the pool locked.
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import mmap
import os
import re
import stat
import threading

from omniflow.memory.errors import PoolError

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def segment_path(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"pool name {name!r}: use 1-200 characters of letters, digits, '.', '_', '-' "
            "(no '/'), starting with a letter or digit"
        )
    return os.path.join(SHM_DIR, name)


def unlink_segment(name: str) -> bool:
    """Remove the segment file ``name`` and its side files; False if it was not there."""
    path = segment_path(name)
    unlink_side_files(path)
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def side_file(path: str, suffix: str) -> str:
    """A file kept next to the segment at ``path`` (shared weights' manifests and locks).

    '@' never appears in a pool name, so one pool's side files never match another's."""
    return f"{path}@{suffix}"


def unlink_side_files(path: str) -> None:
    """Remove the side files of the segment at ``path``: at ``down``, and when a segment of
    that name is created (anything left then is from a run that crashed)."""
    for side in glob.glob(glob.escape(path) + "@*"):
        try:
            os.unlink(side)
        except FileNotFoundError:
            pass


class Segment:
    """The file, its mapping and the lock that guards the pool's tables."""

    def __init__(self, name: str, fd: int, mm: mmap.mmap, size: int, created: bool) -> None:
        self.name = name
        self.path = segment_path(name)
        self.size = size
        self.created = created
        self.mm = mm
        self._fd = fd
        self._pid = os.getpid()
        # flock excludes other open file descriptions, not threads sharing this one.
        self._thread_lock = threading.Lock()
        self._locked = _Locked(self._thread_lock, fd)

    def address(self) -> int:
        """The mapping's base address."""
        # The ctypes view exports the buffer: drop it at once, or mmap.close() refuses.
        view = ctypes.c_char.from_buffer(self.mm)
        try:
            return ctypes.addressof(view)
        finally:
            del view

    @classmethod
    def create(cls, name: str, size: int, populate: bool = True) -> Segment:
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise PoolError(
                f"pool {name!r}: {path} already exists (a live deployment, or one that "
                "crashed: unlink it first)"
            ) from None
        unlink_side_files(path)
        try:
            os.fchmod(fd, 0o600)  # the umask can only narrow the mode; make it exact
            os.ftruncate(fd, size)
            # Reserve the pages now: a tmpfs that fills later would SIGBUS a reader.
            os.posix_fallocate(fd, 0, size)
            mm = _map(fd, size, populate)
        except BaseException as e:
            os.close(fd)
            os.unlink(path)
            if isinstance(e, OSError):
                raise PoolError(f"pool {name!r}: cannot create {size} bytes at {path}: {e}") from e
            raise
        return cls(name, fd, mm, size, created=True)

    @classmethod
    def attach(cls, name: str, populate: bool = True) -> Segment:
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PoolError(f"pool {name!r}: no segment at {path}; is the deployment up?") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise PoolError(
                    f"pool {name!r}: {path} is not owner-only ({oct(st.st_mode)}) or belongs "
                    f"to uid {st.st_uid}; refusing to map it"
                )
            mm = _map(fd, st.st_size, populate)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, mm, st.st_size, created=False)

    def lock(self) -> _Locked:
        """The cross-process lock, as a context manager (one object per process, reused:
        it runs three times per tensor hop)."""
        if self._pid != os.getpid():
            self._after_fork()
        return self._locked

    def _after_fork(self) -> None:
        # A forked child shares the parent's open file description, so flock would not
        # exclude the two; a fresh open gives the child its own.
        fd = os.open(self.path, os.O_RDWR)
        self._fd, self._pid = fd, os.getpid()
        self._thread_lock = threading.Lock()
        self._locked = _Locked(self._thread_lock, fd)

    def unlink(self) -> bool:
        return unlink_segment(self.name)

    def close(self) -> None:
        """Unmap and close; tensors still viewing the mapping keep it alive until freed."""
        if self._fd < 0:
            return
        try:
            self.mm.close()
        except BufferError:
            pass  # live views: the mapping goes when the last one is garbage-collected
        os.close(self._fd)
        self._fd = -1
        self._locked = _Locked(self._thread_lock, -1)  # a lock after close fails, as ever


class _Locked:
    __slots__ = ("_thread_lock", "_fd")

    def __init__(self, thread_lock: threading.Lock, fd: int) -> None:
        self._thread_lock = thread_lock
        self._fd = fd

    def __enter__(self) -> None:
        self._thread_lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread_lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()


def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED
    if populate:
        # Build this process's page tables once, now: first touches of a fresh mapping
        # fault page by page and run an order of magnitude slower than mapped memory.
        flags |= mmap.MAP_POPULATE
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def unlink_pool(name: str) -> bool:
    """Remove the pool segment ``name`` from /dev/shm (no mapping needed); False if absent."""
    return unlink_segment(name)
