"""`systemctl` for a node in a test's mount namespace, where no systemd runs: it does what systemd
does with prefixd's units, read from /etc/systemd/system as an operator installed them.

    systemctl daemon-reload                     nothing to do: the files are read at start
    systemctl enable --now prefixd.socket       the socket as [Socket] says, then the service
    systemctl stop prefixd.service              SIGTERM, and wait for the exit

The socket: its directory (DirectoryMode=, root's), the socket bound with SocketUser=,
SocketGroup= and SocketMode=. The service: StateDirectory= and RuntimeDirectory= made (or taken
over, with what they hold) with their modes for User= and Group=, the supplementary groups of User= (initgroups, as
systemd does), UMask=, Environment=, STATE_DIRECTORY, RUNTIME_DIRECTORY and the listening socket
as fd 3 (LISTEN_FDS=1); it returns once the daemon said READY=1 (Type=notify). systemd starts the
service on the first connection; this starts it at once, which an engine cannot tell apart. The
unit's sandbox is tests/daemon/test_systemd.py's business.
"""

from __future__ import annotations

import grp
import os
import pwd
import select
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

UNITS = Path("/etc/systemd/system")
STATE = Path("/run/systemctl-standin")  # the started services' pids and logs
READY_TIMEOUT_S = 120.0


def sections(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file's assignments by section, each key's values in order."""
    found: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("["):
            current = found.setdefault(line.strip("[]"), {})
        elif line and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            current.setdefault(key.strip(), []).append(value.strip())
    return found


def last(settings: dict[str, list[str]], key: str, default: str = "") -> str:
    return settings.get(key, [default])[-1]


def listen(unit: str) -> tuple[socket.socket, str]:
    """The socket unit's listening socket, and the service it starts."""
    spec = sections(UNITS / unit)["Socket"]
    path = Path(last(spec, "ListenStream"))
    path.parent.mkdir(mode=int(last(spec, "DirectoryMode", "0755"), 8), parents=True, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chown(
        path,
        pwd.getpwnam(last(spec, "SocketUser")).pw_uid,
        grp.getgrnam(last(spec, "SocketGroup")).gr_gid,
    )
    os.chmod(path, int(last(spec, "SocketMode", "0666"), 8))
    listener.listen(128)
    return listener, last(spec, "Service", unit.replace(".socket", ".service"))


def take_over(directory: Path, uid: int, gid: int) -> None:
    """As systemd does for StateDirectory= and RuntimeDirectory=: a directory another user or
    group owns (a store a root daemon made before the units were installed) changes owner with
    everything in it."""
    found = directory.stat()
    if (found.st_uid, found.st_gid) == (uid, gid):
        return
    for parent, _, names in os.walk(directory):
        for name in names:
            os.chown(os.path.join(parent, name), uid, gid, follow_symlinks=False)
        os.chown(parent, uid, gid)


def start(unit: str, listener: socket.socket) -> int:
    """The service, as systemd starts it, with `listener` passed; its pid once READY=1 came."""
    service = sections(UNITS / unit)["Service"]
    user = pwd.getpwnam(last(service, "User"))
    gid = grp.getgrnam(last(service, "Group", user.pw_name)).gr_gid
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    for kind, base in (("State", "/var/lib"), ("Runtime", "/run")):
        name = last(service, f"{kind}Directory")
        if name:
            directory = Path(base) / name
            directory.mkdir(parents=True, exist_ok=True)
            take_over(directory, user.pw_uid, gid)
            os.chmod(directory, int(last(service, f"{kind}DirectoryMode", "0755"), 8))
            env[f"{kind.upper()}_DIRECTORY"] = str(directory)
    for value in service.get("Environment", []):
        for assignment in shlex.split(value):
            key, _, text = assignment.partition("=")
            env[key] = text
    STATE.mkdir(mode=0o755, exist_ok=True)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = STATE / f"{unit}.notify"
    notify_path.unlink(missing_ok=True)
    notify.bind(str(notify_path))
    os.chmod(notify_path, 0o777)
    env["NOTIFY_SOCKET"] = str(notify_path)
    argv = shlex.split(last(service, "ExecStart"))
    umask = int(last(service, "UMask", "0022"), 8)
    log = os.open(STATE / f"{unit}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid == 0:  # the service's process: a session of its own, the unit's user and fds
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.dup2(listener.fileno(), 3)  # after stdio: the log's own fd may have been 3
            os.set_inheritable(3, True)  # dup2 onto itself keeps close-on-exec
            os.closerange(4, 1 << 16)
            os.umask(umask)
            os.initgroups(user.pw_name, gid)
            os.setgid(gid)
            os.setuid(user.pw_uid)
            env["LISTEN_FDS"] = "1"
            env["LISTEN_PID"] = str(os.getpid())
            os.execve(argv[0], argv, env)
        except BaseException as exc:  # noqa: BLE001 - said in the unit's log, as systemd would
            os.write(2, f"systemctl stand-in: starting {argv[0]}: {exc!r}\n".encode())
        finally:
            os._exit(127)
    (STATE / f"{unit}.pid").write_text(str(pid))
    notify.settimeout(1.0)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            message = notify.recv(4096)
        except TimeoutError:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                said = (STATE / f"{unit}.log").read_text(errors="replace")
                raise SystemExit(f"{unit} exited before READY=1:\n{said}") from None
            continue
        if b"READY=1" in message.split(b"\n"):
            return pid
    raise SystemExit(f"{unit}: no READY=1 within {READY_TIMEOUT_S} s")


def stop(unit: str) -> None:
    pid = int((STATE / f"{unit}.pid").read_text())
    try:
        pidfd = os.pidfd_open(pid)  # not the stand-in's child (another invocation started it)
    except ProcessLookupError:  # not running (it failed to start, or was stopped)
        return
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        exited = select.poll()  # a pidfd turns readable when the process exits: an event
        exited.register(pidfd, select.POLLIN)
        if not exited.poll(READY_TIMEOUT_S * 1000):
            raise SystemExit(f"{unit} ignored SIGTERM")
    except ProcessLookupError:  # it exited meanwhile
        pass
    finally:
        os.close(pidfd)


def main(argv: list[str]) -> int:
    if argv == ["daemon-reload"]:
        return 0
    if argv[:2] == ["enable", "--now"]:
        for unit in argv[2:]:
            listener, service = listen(unit)
            start(service, listener)
            listener.close()  # the service holds it now
        return 0
    if argv[:1] == ["stop"]:
        for unit in argv[1:]:
            stop(unit)
        return 0
    print(f"systemctl stand-in: {shlex.join(argv)} is not one of its commands", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
