"""User-facing errors. Asserts are for invariants; these are for input a user can fix."""

import re

# Credentials in a URI, replaced by *** wherever a value is shown: a URI's user-info
# (``scheme://user:password@host``, a token alone as the user) and parameters that carry secrets
# (``?X-Amz-Signature=``, ``?api_key=``, ``#access_token=``, ``;token=``), and an
# ``Authorization:`` header's value. A user alone (``hdfs://alice@namenode``) is not a secret.
#
# Every pattern here runs on every config value and every error message, on text a user or a
# planted manifest controls: each is matched in time linear in the text's length. A regex only
# starts where a run of its characters starts (the lookbehinds), so no run is scanned from each
# of its positions; what decides between candidates is plain Python over spans found once.
_SCHEME = re.compile(r"(?<![A-Za-z0-9+.-])[0-9+.-]*(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)")
_SEGMENT = re.compile(r"[^\s'\"@]*")  # a URI's user-info ends at an @; it holds no space or quote
_PARAM = re.compile(r"(?<=[?&#;])[\w.-]+=")  # a parameter's name, right after ? & # or ;
# A parameter is secret when its name, lowercased and without _ - ., holds one of these words, or
# one of its parts (between _ - .) is one of _SECRET_PARTS. Looked for with str's own substring
# search over all the names at once, which is linear and fast; a regex alternation is neither.
_SECRET_WORDS = (
    *("secret", "token", "password", "passwd", "pwd", "signature", "credential", "session"),
    *("authorization", "apikey", "accesskey", "privatekey", "accountkey", "sharedkey", "subscriptionkey"),
)
_SECRET_PARTS = tuple(f"\n{p}\n" for p in ("key", "sig", "auth", "pass", "pw"))
_DROP = str.maketrans("", "", "_.-")
_SPLIT = str.maketrans("_.-=", "\n\n\n\n")


def _secret_names(names: str) -> bool:
    """Whether any of ``names`` (lowercased, each ending in "=", one a line) is a secret's."""
    compact = names.translate(_DROP)
    if any(w in compact for w in _SECRET_WORDS):
        return True
    parts = "\n" + names.translate(_SPLIT)
    return any(p in parts for p in _SECRET_PARTS)


_VALUE = re.compile(r"[^&#\s'\"]*")
_HEADER = re.compile(
    r"(?<![\w-])(?P<name>(?:proxy-)?authorization)(?P<sep>[ \t]*[:=][ \t]*)(?:(?:bearer|basic|token|digest)[ \t]+)?"
    r"[^\s'\"&#]+",
    re.IGNORECASE,
)
# A user-info without a password that is a token, not a name (https://ghp_...@github.com).
_TOKEN = re.compile(r"(?:gh[pousr]_|github_pat_|glpat-|hf_|xox[abprs]-|sk-)[\w-]{12}|A[KS]IA[A-Z0-9]{16}")


def _token_like(user: str) -> bool:
    if _TOKEN.match(user):
        return True
    return len(user) >= 32 and any(c.isdigit() for c in user) and any(c.isalpha() for c in user)


def _userinfo_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, scheme) of each ``scheme://<user-info>@`` that holds a secret."""
    spans: list[tuple[int, int, str]] = []
    skip_to = 0  # the end of the last segment looked at: its other schemes were decided with it
    for m in _SCHEME.finditer(text):
        if m.start("scheme") < skip_to:
            continue
        info_start = m.end()
        end = _SEGMENT.match(text, info_start).end()
        skip_to = end
        if end >= len(text) or text[end] != "@":
            continue
        info = text[info_start:end]
        # user:password (a raw secret key may hold "/", which would end the authority), or a
        # user alone that is a token
        if ":" in info or (not re.search(r"[/?#]", info) and _token_like(info)):
            spans.append((m.start("scheme"), end + 1, m["scheme"]))
    return spans


def _any_secret_param(text: str) -> bool:
    names = _PARAM.findall(text)
    return bool(names) and _secret_names("\n".join(names).lower())


def _param_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each secret parameter's value."""
    if not _any_secret_param(text):
        return []  # (the usual case, without a loop in Python over the names)
    names = _PARAM.findall(text)
    secret = []  # which names are secrets': looked at 64 at a time, then one by one where one is
    for lo in range(0, len(names), 64):
        chunk = names[lo : lo + 64]
        if _secret_names("\n".join(chunk).lower()):
            secret += [lo + i for i, name in enumerate(chunk) if _secret_names(name.lower())]
    where = [m.end() for m in _PARAM.finditer(text)]
    spans: list[tuple[int, int]] = []
    done = 0  # the end of the last value redacted: a name inside it is redacted with it
    for i in secret:
        if where[i] - len(names[i]) >= done:
            done = _VALUE.match(text, where[i]).end()
            spans.append((where[i], done))
    return spans


def redact(text: str) -> str:
    """``text`` with every URI's credentials replaced by ***: what an error or a log may show."""
    if not isinstance(text, str):
        text = str(text)
    if "://" in text:
        parts, last = [], 0
        for start, end, scheme in _userinfo_spans(text):
            parts += [text[last:start], scheme, "***@"]
            last = end
        text = "".join([*parts, text[last:]])
    if "=" in text:
        parts, last = [], 0
        for start, end in _param_spans(text):
            parts += [text[last:start], "***"]
            last = end
        text = "".join([*parts, text[last:]])
    return _HEADER.sub(lambda m: f"{m['name']}{m['sep']}***", text)


def has_credentials(text: str) -> bool:
    """A URI in ``text`` carries credentials (user-info, or a secret query parameter)."""
    # (a quick look first: most text holds none; text already redacted holds no credentials)
    maybe = ("://" in text and _userinfo_spans(text)) or _any_secret_param(text) or _HEADER.search(text)
    return bool(maybe) and redact(text) != text


def storage_reason(exc: BaseException) -> str:
    """An object store's error in a line a user reads: the AWS SDK's without its details (its curl
    code, the host again, the request id); Google Cloud's status (``google::cloud::Status(UNAVAILABLE:
    Retry policy exhausted, with a last message of ... error_info={...})``, 600 characters) as its
    code and the underlying message; at most 200 characters."""
    text = " ".join(str(exc).split())
    gcs = re.search(r"google::cloud::Status\((\w+): (.*?)(?: error_info=\{|\)$|$)", text)
    if gcs:
        code, message = gcs.groups()
        message = message.split("with a last message of ", 1)[-1]
        cause = message.split("The underlying error message was: ", 1)
        first = cause[0].split(". ")[0]
        under = cause[1].split(" - ")[-1] if len(cause) > 1 else ""
        under = re.sub(r"^CURL error \[\d+\]=", "", under).strip()
        text = f"Google Cloud Storage: {code}: {first}" + (f" ({under})" if under else "")
    text = text.split("; Details:")[0].split(" (Request ID:")[0]
    return text if len(text) <= 200 else text[:196].rsplit(" ", 1)[0] + " ..."  # (no space: 196 + 4)


class ConfigError(ValueError):
    """A configuration value that cannot work, with the key, the value and what would.

    The message never shows a URI's credentials (see :func:`redact`).

    Args:
        key: the config key (``parallelism.tp``) or the command-line argument.
        value: the value given.
        fix: what is wrong with it and what would work.
    """

    def __init__(self, key: str, value: object, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        # A boolean as the user writes it (TOML and --set): true/false, not Python's True/False.
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        super().__init__(redact(f"{key}={shown}: {fix}"))


class LayoutError(ValueError):
    """A layout that cannot be placed on the cluster's nodes.

    Args:
        message: which group would cross which nodes, and the layouts that would fit.
    """
