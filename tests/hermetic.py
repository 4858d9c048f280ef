"""The suite's own environment, and a watch on the machine's prefixd paths (tests/conftest.py).

prefixd falls back on default paths for whatever it is not told: the store and socket of the
machine's daemon (/var/lib/prefixd and /run/prefixd/prefixd.sock as root, where a root install
serves them), or the per-user ones under HOME and the XDG directories. A test that leaves one half
of (data dir, socket) to a default would then read, or worse write, the machine's daemon's store.
So the suite runs in an environment of its own (`hermetic_environment`), and a watch on the
machine's default paths (`DefaultPathWatch`, inotify) names any test that opens, creates, deletes,
renames or changes anything there all the same.

The watch ignores reads and writes of files already open (IN_ACCESS, IN_MODIFY): a daemon serving
the machine's engines on the default paths writes its store all the time, beside the suite.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import os
import pwd
import struct
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Set by systemd for a service (a test runner started by a unit has them): the daemon would take
# the first two for its default store and socket and the others as its notify socket, its
# activated sockets and its watchdog.
SYSTEMD_HANDOFF = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_PID",
    "LISTEN_FDS",
    "LISTEN_FDNAMES",
    "STATE_DIRECTORY",
    "RUNTIME_DIRECTORY",
)


@dataclass(frozen=True)
class Hermetic:
    """The suite's environment: what the runner had, and the directories that replace its own."""

    runner_env: dict[str, str] = field(repr=False)  # the environment pytest was started with
    base: Path  # every directory below is in it (short: sockets go in the runtime directories)
    home: Path

    def per_test(self) -> dict[str, str]:
        """The default-path variables of one test, in a fresh directory of `base`: its store and
        socket defaults, for root (systemd's variables: root's FHS defaults ignore HOME and XDG)
        and for any other user (XDG)."""
        tests = self.base / "tests"
        tests.mkdir(exist_ok=True)
        directory = Path(tempfile.mkdtemp(dir=tests))
        runtime = directory / "runtime"
        runtime.mkdir(mode=0o700)
        return {
            "STATE_DIRECTORY": str(directory / "state"),
            "RUNTIME_DIRECTORY": str(runtime),
            "XDG_STATE_HOME": str(directory / "xdg-state"),
            "XDG_RUNTIME_DIR": str(runtime),
        }


@contextmanager
def hermetic_environment(base: Path) -> Iterator[Hermetic]:
    """`os.environ` as the suite's tests and their subprocesses see it, for the session: HOME and
    the XDG directories in `base`, no PREFIXD_* variable and no systemd hand-off of the runner's
    (the suite's own switches, PREFIXD_LONG and the engine suites' PREFIXD_REQUIRE_*, are read
    from `runner_env` or before the session starts: the package refuses unknown PREFIXD_*).

    Kept from the runner: pip's configuration (PIP_CONFIG_FILE names the runner's user file, as
    tests/daemon/test_install.py's pip may need its index), PIP_* and the cache variables a runner
    set on purpose (HF_HOME, TORCH_HOME, ...). No test loads a model from a cache (they build
    theirs), so caches under HOME (vLLM's compile cache, Hugging Face's) start empty each session
    and are shared by its tests."""
    runner_env = dict(os.environ)
    home = base / "home"
    for directory in (home / ".config", home / ".cache", home / ".local" / "share"):
        directory.mkdir(parents=True)
    runtime = base / "runtime"
    runtime.mkdir(mode=0o700)
    with pytest.MonkeyPatch.context() as patch:
        for name in runner_env:
            if name.startswith("PREFIXD_") or name in SYSTEMD_HANDOFF:
                patch.delenv(name)
        pip_config = _pip_user_config(runner_env)
        if pip_config is not None and "PIP_CONFIG_FILE" not in runner_env:
            patch.setenv("PIP_CONFIG_FILE", str(pip_config))
        patch.setenv("HOME", str(home))
        patch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
        patch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
        patch.setenv("XDG_DATA_HOME", str(home / ".local" / "share"))
        defaults = {
            "STATE_DIRECTORY": str(base / "state"),
            "RUNTIME_DIRECTORY": str(runtime),
            "XDG_STATE_HOME": str(home / ".local" / "state"),
            "XDG_RUNTIME_DIR": str(runtime),
        }
        for name, value in defaults.items():
            patch.setenv(name, value)
        # vLLM's engines name a ZeroMQ socket per process here (default: the machine's temporary
        # directory, where a killed engine's socket outlives the run); any user's, as in /tmp
        ipc = base / "ipc"
        ipc.mkdir()
        ipc.chmod(0o1777)
        patch.setenv("VLLM_RPC_BASE_PATH", str(ipc))
        yield Hermetic(runner_env, base, home)


def _pip_user_config(env: Mapping[str, str]) -> Path | None:
    """The runner's per-user pip configuration file, if it has one (pip's own search order)."""
    home = Path(env.get("HOME") or pwd.getpwuid(os.geteuid()).pw_dir)
    config_home = env.get("XDG_CONFIG_HOME", "")
    config = Path(config_home) if os.path.isabs(config_home) else home / ".config"
    for candidate in (config / "pip" / "pip.conf", home / ".pip" / "pip.conf"):
        if candidate.is_file():
            return candidate
    return None


# --- the machine's default paths --------------------------------------------------------------


@dataclass(frozen=True)
class Watched:
    """A directory whose entries named like `names` (fnmatch patterns; none: every entry and the
    directory itself) are the machine's."""

    directory: Path
    names: tuple[str, ...] = ()

    def covers(self, name: str) -> bool:
        return not self.names or any(fnmatch.fnmatchcase(name, p) for p in self.names)


def machine_default_dirs(env: Mapping[str, str], uid: int) -> list[Path]:
    """The directories of the machine's prefixd daemons, as the runner's environment `env` names
    them (prefixd/paths.py): root's, the per-user ones of `uid`, and systemd's when the runner
    was given some."""
    home = Path(env.get("HOME") or pwd.getpwuid(uid).pw_dir)
    state_home = env.get("XDG_STATE_HOME", "")
    runtime = env.get("XDG_RUNTIME_DIR", "")
    dirs = [
        Path("/var/lib/prefixd"),
        Path("/run/prefixd"),
        (Path(state_home) if os.path.isabs(state_home) else home / ".local" / "state") / "prefixd",
        home / ".local" / "state" / "prefixd",
        Path(f"/tmp/prefixd-{uid}"),
    ]
    if os.path.isabs(runtime):
        dirs.append(Path(runtime) / "prefixd")
    for name in ("STATE_DIRECTORY", "RUNTIME_DIRECTORY"):
        if env.get(name):
            dirs.append(Path(env[name].split(":")[0]))
    return list(dict.fromkeys(dirs))


def watched_for(dirs: Sequence[Path]) -> list[Watched]:
    """What to watch so that nothing happens unseen to `dirs` or to their instances' siblings
    (`prefixd-NAME` beside `prefixd`): each that exists, whole, and its parent's entries of those
    names. A parent that does not exist (no ~/.local/state) cannot be watched: only the snapshot
    at the end sees what was made there."""
    names: dict[Path, set[str]] = {}
    whole: set[Path] = set()
    for directory in dirs:
        names.setdefault(directory.parent, set()).update({directory.name, directory.name + "-*"})
        if directory.parent.is_dir():
            whole.update(p for p in directory.parent.glob(directory.name + "-*") if p.is_dir())
        if directory.is_dir():
            whole.add(directory)
    watched = [Watched(d) for d in sorted(whole)]
    watched += [Watched(d, tuple(sorted(n))) for d, n in sorted(names.items()) if d not in whole]
    return watched


def snapshot(watched: Sequence[Watched]) -> dict[str, tuple[int, ...]]:
    """Who each watched entry is (inode, type and mode, owner), and when each directory watched
    whole last had an entry added, removed or renamed (its mtime): not the files' mtimes, which a
    serving daemon changes."""
    seen: dict[str, tuple[int, ...]] = {}
    for item in watched:
        try:
            entries = sorted(os.scandir(item.directory), key=lambda e: e.name)
            if not item.names:
                info = os.lstat(item.directory)
                seen[str(item.directory)] = (
                    info.st_ino,
                    info.st_mode,
                    info.st_uid,
                    info.st_mtime_ns,
                )
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if not item.covers(entry.name):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            seen[entry.path] = (info.st_ino, info.st_mode, info.st_uid)
    return seen


def snapshot_changes(
    before: Mapping[str, tuple[int, ...]], after: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """What differs between two snapshots, one line per path."""
    lines = [f"created: {p}" for p in sorted(after.keys() - before.keys())]
    lines += [f"removed: {p}" for p in sorted(before.keys() - after.keys())]
    lines += [
        f"changed: {p} (inode, mode, owner[, mtime]: {before[p]} -> {after[p]})"
        for p in sorted(before.keys() & after.keys())
        if before[p] != after[p]
    ]
    return lines


# --- inotify ----------------------------------------------------------------------------------

IN_ATTRIB = 0x00000004
IN_OPEN = 0x00000020
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
WATCHED_EVENTS = (
    IN_OPEN | IN_ATTRIB | IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO
    | IN_DELETE_SELF | IN_MOVE_SELF
)  # fmt: skip
_EVENT_NAMES = {
    IN_OPEN: "opened",
    IN_ATTRIB: "attributes changed",
    IN_CREATE: "created",
    IN_DELETE: "deleted",
    IN_MOVED_FROM: "moved away",
    IN_MOVED_TO: "moved in",
    IN_DELETE_SELF: "deleted",
    IN_MOVE_SELF: "moved",
}
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of NUL-padded name)


class DefaultPathWatch:
    """An inotify watch on the machine's default paths, and their snapshot when it began:
    `drain()` says what happened since the last drain, one line per event on a watched entry;
    `finish()` adds what differs from the snapshot. Without inotify (no watch left to this user)
    only the snapshot is compared, with a warning. With `compare` False there is no snapshot, so
    the watch opens nothing there itself: the watch of a worker of a run in several processes,
    whose snapshots the other workers' watches would report. With `events` False there is no
    inotify queue: the watch of that run's controller, which compares and never drains (its
    queue, filled by the workers' temporary files beside a watched path, would overflow)."""

    def __init__(
        self, watched: Sequence[Watched], *, compare: bool = True, events: bool = True
    ) -> None:
        self.watched = list(watched)
        self._by_wd: dict[int, Watched] = {}
        self.fd: int | None = None
        try:
            self.fd = self._start() if events else None
        except OSError as exc:
            warnings.warn(f"the machine's prefixd paths are only compared at the end: {exc}")
        self.before = snapshot(self.watched) if compare else None
        self.drain()  # the snapshot's own opens

    def _start(self) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        fd: int = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        for item in self.watched:
            wd = libc.inotify_add_watch(
                fd, os.fsencode(item.directory), ctypes.c_uint32(WATCHED_EVENTS)
            )
            if wd < 0:
                code = ctypes.get_errno()
                if code == errno.ENOENT:
                    continue  # gone since it was listed: the snapshot reports it
                os.close(fd)
                raise OSError(code, f"inotify_add_watch {item.directory}")
            self._by_wd[wd] = item
        return fd

    def finish(self) -> list[str]:
        """What happened since the last drain, and how the paths differ from the snapshot."""
        lines = self.drain()
        if self.before is not None:
            lines += snapshot_changes(self.before, snapshot(self.watched))
        self.close()
        return lines

    def drain(self) -> list[str]:
        lines: list[str] = []
        while self.fd is not None:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return lines
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size
                name = os.fsdecode(data[offset : offset + length].rstrip(b"\0"))
                offset += length
                line = self._describe(wd, mask, name)
                if line:
                    lines.append(line)
        return lines

    def _describe(self, wd: int, mask: int, name: str) -> str | None:
        if mask & IN_Q_OVERFLOW:
            return "inotify's queue overflowed: events were lost (the snapshot still compares)"
        item = self._by_wd.get(wd)
        if item is None or mask & IN_IGNORED:
            return None
        if name and not item.covers(name) or not name and item.names:
            return None
        what = ", ".join(text for bit, text in _EVENT_NAMES.items() if mask & bit)
        path = item.directory / name if name else item.directory
        return f"{path}{'/' if mask & IN_ISDIR and name else ''}: {what}"

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
