"""Ordered, resumable migrations of the on-disk schema (`prefixd migrate`)."""

from prefixd.errors import MigrationError
from prefixd.migrate.runner import MigrationStatus, Migrator, UpgradeReport, registry
from prefixd.migrate.steps import Migration

__all__ = [
    "Migration",
    "MigrationError",
    "MigrationStatus",
    "Migrator",
    "UpgradeReport",
    "registry",
]
