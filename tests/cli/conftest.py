"""The daemon fixtures of tests/daemon, for the commands that talk to a daemon."""

from ..daemon.conftest import daemon, daemon_factory, sock_dir  # noqa: F401
