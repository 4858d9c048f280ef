"""The clients are tested against real daemons: the daemon tests' fixtures."""

from tests.daemon.conftest import (  # noqa: F401  (fixtures)
    daemon,
    daemon_factory,
    module_daemon_factory,
    sock_dir,
)
