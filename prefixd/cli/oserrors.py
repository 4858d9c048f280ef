"""One line for an OS error a command meets on a path: what is wrong and what to do, naming the
setting, instead of Python's `[Errno N] ...: 'PATH'`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path

from prefixd.trust import user_name

# errno values that mean "a file stands where a directory must be"
_NOT_A_DIRECTORY = (errno.EEXIST, errno.ENOTDIR)
_NOT_ALLOWED = (errno.EACCES, errno.EPERM, errno.EROFS)


def explain(exc: OSError, env: Mapping[str, str], flags: Mapping[Path, str] | None = None) -> str:
    """What `exc` means for its path; `flags` maps the paths a command was given to their flags,
    so the fix can name one."""
    if exc.filename is None:
        return str(exc)
    path = Path(os.fsdecode(exc.filename))
    reason = exc.strerror or str(exc)
    given, flag = _flag_of(path, flags or {})
    give = f"give {flag} another path" if flag else "give another path"
    if exc.errno in _NOT_A_DIRECTORY:
        blocker = _file_in_the_way(path)
        if blocker is not None and flag == "--data-dir" and blocker == given:
            return (
                f"{blocker} is not a directory: give --data-dir a directory, or a path that "
                "does not exist yet"
            )
        if blocker is not None:
            return f"{blocker} is not a directory, so nothing can be created in it: {give}"
    if exc.errno in _NOT_ALLOWED:
        home = _missing_home(path, env)
        if home is not None:
            return (
                f"cannot create {path} ({reason}): HOME={home} does not exist, and a user other "
                "than root keeps its default data directory under HOME: give --data-dir (and "
                "--socket) paths this user may create, or set HOME to a directory it owns"
            )
        return (
            f"cannot create or open {path} ({reason}) as {_user()}: run as a user who may, "
            f"or {give} (one this user may write)"
        )
    if exc.errno == errno.ENOSPC:
        return f"{path}: no space left on the device: free some, or {give}"
    return f"{path}: {reason}"


def _flag_of(path: Path, flags: Mapping[Path, str]) -> tuple[Path | None, str | None]:
    """The given path, and its flag, that `path` is, lies in, or is a directory above."""
    for given, flag in flags.items():
        if path == given or path in given.parents or given in path.parents:
            return given, flag
    return None, None


def _file_in_the_way(path: Path) -> Path | None:
    """The first of `path` and its directories, from the top, that exists and is no directory."""
    for each in (*reversed(path.parents), path):
        if each.exists() and not each.is_dir():
            return each
    return None


def _missing_home(path: Path, env: Mapping[str, str]) -> Path | None:
    """HOME, when it does not exist and `path` is it or lies in it (XDG defaults of a system
    user such as nobody, whose HOME is /nonexistent)."""
    text = env.get("HOME")
    if not text:
        return None
    home = Path(text)
    if (path == home or home in path.parents) and not home.exists():
        return home
    return None


def _user() -> str:
    return f"uid {os.geteuid()} ({user_name(os.geteuid())})"
