"""User-facing errors. Asserts are for invariants; these are for input a user can fix."""


class ConfigError(ValueError):
    """A configuration value that cannot work, with the key, the value and what would."""

    def __init__(self, key: str, value: object, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key}={value!r}: {fix}")


class LayoutError(ValueError):
    """A layout that cannot be placed on the cluster's nodes."""
