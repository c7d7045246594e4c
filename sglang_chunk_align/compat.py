"""Which SGLang releases the plugin supports, declared once as data.

The version is read from package metadata, so checking it imports nothing of
SGLang: the check runs in every process that loads plugins.
"""

import os
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import releases

SUPPORTED_SGLANG = SpecifierSet(releases.SUPPORTED)
# Set to 1 to try an untested newer release: every patch point is still checked.
ALLOW_UNTESTED_ENV = "SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED"
# Set to 0 to keep only the 128-token length alignment (planning.py's rules off).
RULES_ENV = "SGLANG_CHUNK_ALIGN_RULES"
# Set to 1 to turn the radix cache back on under deterministic flashinfer.
RADIX_CACHE_ENV = "SGLANG_CHUNK_ALIGN_RADIX_CACHE"


class ChunkAlignError(RuntimeError):
    """The plugin cannot make this SGLang align chunks correctly."""


def installed_version(dist="sglang"):
    """The installed version of `dist`, or None when it is not installed."""
    try:
        return Version(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return None


def sglang_at_least(release):
    """Whether the installed SGLang is `release` (a releases.py name) or newer."""
    version = installed_version()
    return version is not None and version >= Version(release)


def env_flag(name, default):
    """A 0/1 environment switch; any other value is a ChunkAlignError."""
    raw = os.environ.get(name, "")
    if raw not in ("", "0", "1"):
        raise ChunkAlignError(f"{name}={raw!r} is not valid: use 1 or 0 (unset means {int(default)}).")
    return default if raw == "" else raw == "1"


def allow_untested():
    return env_flag(ALLOW_UNTESTED_ENV, False)


def check_sglang_version(version):
    """Return a warning string for an allowed untested release, else None.

    Raises ChunkAlignError for a missing, older or (without the override)
    newer SGLang.
    """
    override = allow_untested()  # validated even when not needed
    if version is None:
        raise ChunkAlignError("SGLang is not installed: install sglang first.")
    if SUPPORTED_SGLANG.contains(version, prereleases=True):
        return None
    if version < _lowest_supported():
        raise ChunkAlignError(
            f"SGLang {version} is older than sglang-chunk-align supports "
            f"({SUPPORTED_SGLANG}); upgrade SGLang."
        )
    if override:
        return (
            f"SGLang {version} is newer than the tested range ({SUPPORTED_SGLANG}); "
            f"trying it because {ALLOW_UNTESTED_ENV}=1. Every patch point is still checked."
        )
    raise ChunkAlignError(
        f"SGLang {version} is newer than the tested range ({SUPPORTED_SGLANG}). "
        f"Upgrade sglang-chunk-align, or set {ALLOW_UNTESTED_ENV}=1 to try it."
    )


def _lowest_supported():
    return min(Version(spec.version) for spec in SUPPORTED_SGLANG if ">" in spec.operator)
