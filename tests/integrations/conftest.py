"""The daemon fixtures of tests/daemon, for the tests of the engines' link to the daemon."""

from ..daemon.conftest import daemon, daemon_factory, sock_dir  # noqa: F401
