"""Ordered, resumable migrations of the on-disk schema (`prefixd migrate`)."""

from prefixd.errors import MigrationError
from prefixd.migrate.runner import MigrationStatus, Migrator, UpgradeReport
from prefixd.migrate.steps import Migration, registry

__all__ = [
    "Migration",
    "MigrationError",
    "MigrationStatus",
    "Migrator",
    "UpgradeReport",
    "registry",
]
