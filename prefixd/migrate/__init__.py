"""Ordered, resumable migrations of the on-disk schema (`prefixd migrate`)."""

from prefixd.migrate.runner import (
    MigrationError,
    MigrationStatus,
    Migrator,
    UpgradeReport,
)
from prefixd.migrate.steps import Migration, registry

__all__ = [
    "Migration",
    "MigrationError",
    "MigrationStatus",
    "Migrator",
    "UpgradeReport",
    "registry",
]
