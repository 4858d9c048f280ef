"""Adapters between inference engines' caches and prefixd's state-group payloads.

Each submodule imports its engine lazily on purpose: `import prefixd` never pulls in torch or an
engine, and only the integration a caller imports needs its engine installed.
"""
