"""User-facing errors. Asserts are for invariants; these are for input a user can fix."""

import re

# A URI's user-info (``scheme://user:password@host``) and query parameters that carry secrets
# (``?X-Amz-Signature=...``, ``?sig=...``, ``?token=...``): replaced by *** wherever a value is shown.
# A secret key pasted raw may hold "/" (which ends a URI's authority): any "user:..." up to an @ counts.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s@'\"]*@|[^\s@'\":]*:[^\s@'\"]*@)")
_SECRET_PARAM = re.compile(
    r"(?P<name>[?&](?:[\w.-]*(?:secret|token|password|passwd|signature|credential|access_?key|session)[\w.-]*|sig|key))"
    r"=(?P<value>[^&#\s'\"]*)",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with every URI's credentials replaced by ***: what an error or a log may show."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}***@", text)
    return _SECRET_PARAM.sub(lambda m: f"{m['name']}=***", text)


def has_credentials(text: str) -> bool:
    """A URI in ``text`` carries credentials (user-info, or a secret query parameter)."""
    return redact(text) != text


class ConfigError(ValueError):
    """A configuration value that cannot work, with the key, the value and what would.

    The message never shows a URI's credentials (see :func:`redact`)."""

    def __init__(self, key: str, value: object, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        super().__init__(redact(f"{key}={value!r}: {fix}"))


class LayoutError(ValueError):
    """A layout that cannot be placed on the cluster's nodes."""
