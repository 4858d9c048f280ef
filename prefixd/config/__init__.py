"""The settings of `prefixd serve` and of the commands that find its store and socket: typed
(settings), read from a TOML file, PREFIXD_* variables and flags (sources)."""
