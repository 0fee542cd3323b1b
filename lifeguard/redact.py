"""One redaction for everything lifeguard logs, prints or stores: URIs and free text.

A tracking URI may carry a password (``https://user:pw@host``), a token may sit in a query string,
and a server's error text may echo an ``Authorization`` header. Every log record of lifeguard's
logger passes through :func:`redact` (see ``_log.py``), and so does every line and ``--json``
field of ``lifeguard sweep`` that can hold a URI or an error text. What goes:

* the user-info part of every URL (``scheme://user:pw@host`` -> ``scheme://host``);
* ``Bearer``/``Basic`` credentials and ``token=``/``password=``-like values;
* the literal values of the secret environment variables MLflow reads
  (``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_PASSWORD``, ...) and the password of
  ``$MLFLOW_TRACKING_URI`` and of any URI passed to :func:`remember_uri`, wherever they appear.

Imports ``re`` lazily: only text that is about to be shown pays for it.
"""

from __future__ import annotations

import os

__all__ = ["MASK", "redact", "redact_uri", "remember_uri"]

MASK = "***"
SECRET_ENV = (
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "DATABRICKS_TOKEN",
    "DATABRICKS_PASSWORD",
    "DATABRICKS_CLIENT_SECRET",
)
# Shorter values would mask ordinary words; no real credential is this short.
MIN_SECRET = 4
_SECRET_KEYS = (
    "access_token|refresh_token|id_token|token|api_key|apikey|password|passwd|pwd|"
    "client_secret|secret|sig|signature"
)

_remembered: set[str] = set()


def redact_uri(uri: str) -> str:
    """``https://user:secret@host/x?token=t`` -> ``https://host/x?token=***``: exact for one URI
    (the journal stores and compares URIs in this form)."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return redact(uri)
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = authority.rsplit("@", 1)[1]
    return redact(f"{scheme}://{authority}{slash}{path}")


def remember_uri(uri: str) -> None:
    """Mask this URI's password (and its decoded form) wherever it shows up from now on."""
    _remembered.update(_uri_secrets(uri))


def redact(text: str) -> str:
    """``text`` with every credential lifeguard can recognise replaced by ``***``."""
    import re

    for secret in sorted(_secrets(), key=len, reverse=True):
        text = text.replace(secret, MASK)
    # User-info: up to the last '@' before the authority ends.
    text = re.sub(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^\s/?#]*@", r"\1", text)
    text = re.sub(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+", rf"\1\2{MASK}", text)
    text = re.sub(
        rf"(?i)\b({_SECRET_KEYS})(['\"]?\s*[=:]\s*['\"]?)(?!\*\*\*)[^\s&'\",;}})\]]+",
        rf"\1\2{MASK}",
        text,
    )
    return text


def _secrets() -> set[str]:
    found = set(_remembered)
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value:
            found.add(value)
    found.update(_uri_secrets(os.environ.get("MLFLOW_TRACKING_URI", "")))
    return {s for s in found if len(s) >= MIN_SECRET}


def _uri_secrets(uri: str) -> set[str]:
    _, sep, rest = uri.partition("://")
    authority = rest.partition("/")[0]
    if not sep or "@" not in authority:
        return set()
    userinfo = authority.rsplit("@", 1)[0]
    password = userinfo.partition(":")[2]
    if not password:
        return set()
    from urllib.parse import unquote

    return {password, unquote(password)}
