"""Which SGLang releases the plugin supports, declared once as data.

The version is read from package metadata, so checking it imports nothing of
SGLang: the check runs in every process that loads plugins. For the same
reason version gates are read here (admits), not by packaging.specifiers.
"""

import contextlib
import contextvars
import os
from importlib import metadata

from packaging.version import Version

from . import releases

SUPPORTED_SGLANG = releases.SUPPORTED  # a version gate (admits)
# Set to 1 to try an untested newer release: every patch point is still checked.
ALLOW_UNTESTED_ENV = "SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED"
# Set to 0 to keep only the 128-token length alignment (planning.py's rules off).
RULES_ENV = "SGLANG_CHUNK_ALIGN_RULES"
# The radix cache under deterministic flashinfer (radix_cache): unset, on where the grid rules make
# it exact; 0, off as stock keeps it; 1, on, refused where it cannot be exact.
RADIX_CACHE_ENV = "SGLANG_CHUNK_ALIGN_RADIX_CACHE"
# Set to 1 to bound how long decoding requests wait behind prefill chunks (decode_wait.py); unset or 0
# keeps stock's prefill-first order, where they wait behind every queued chunk.
DECODE_WAIT_ENV = "SGLANG_CHUNK_ALIGN_DECODE_WAIT"
# Set to 0 to run every prefill batch as one fa2 call, requests waiting to keep it on one tile, as
# before split attention (split_attention.py); unset or 1 splits a batch by tile class.
SPLIT_ATTENTION_ENV = "SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION"
# Set to 1 to pad a split fa2 call whose extends average too few packed rows for their class's tile
# (planning.call_pad), so that radix hits and chunk cuts leave final pieces of any length; unset or 0
# keeps a final piece long enough for the full tile. Off until a GPU run verifies it (issue 48).
PAD_TILES_ENV = "SGLANG_CHUNK_ALIGN_PAD_TILES"
# Set to 0 to keep stock's eager decode plan, which splits a request's KV at 2048 where its CUDA graphs do
# not (unsplit_decode.py); unset or 1 plans eager decode as the graphs do.
UNSPLIT_DECODE_ENV = "SGLANG_CHUNK_ALIGN_UNSPLIT_DECODE"
# Unset or 1 runs batch-invariant GEMMs on stock's kernel with a tile config per M, each checked for stock's
# bits at startup (gemms.py); 0 keeps stock's one config. On by default since gemms_h200/call2 measured it:
# stock's bits end to end, a decode step at batch 64 18.3 -> 11.8 ms, agents' throughput 1.66x.
GEMMS_ENV = "SGLANG_CHUNK_ALIGN_GEMMS"
# Set to 1 for fast GEMMs (split_k.py): K summed as fixed ranges per shape where that adds tiles,
# batch-invariant but not stock's bits, so a reference must run it too; unset or 0 keeps stock's sums.
FAST_GEMMS_ENV = "SGLANG_CHUNK_ALIGN_FAST_GEMMS"
# Unset or 1 runs an RMSNorm that adds a residual, under batch-invariant mode, as three kernels in stock's
# arithmetic (norms.py); 0 keeps stock's eleven.
NORMS_ENV = "SGLANG_CHUNK_ALIGN_NORMS"
# Where the grid rules run but do not reach radix hits and the tree (scheduler start, doctor).
RADIX_OPT_IN_NEEDS = (
    f"{RADIX_CACHE_ENV}=1 needs SGLang {releases.RADIX_OPT_IN} or newer, where the grid rules reach "
    "radix hits and the tree"
)
# Why the grid rules cannot make radix hits exact with a mamba prefix cache.
MAMBA_NEEDS = "a prefix rounded to the grid would need a mamba state there"
# The environment switches and their defaults (README, "Switches"); None: unset is a third value.
SWITCHES = {
    RULES_ENV: True, RADIX_CACHE_ENV: None, DECODE_WAIT_ENV: False, SPLIT_ATTENTION_ENV: True, PAD_TILES_ENV: False,
    UNSPLIT_DECODE_ENV: True, GEMMS_ENV: True, FAST_GEMMS_ENV: False, NORMS_ENV: True, ALLOW_UNTESTED_ENV: False,
}


class ChunkAlignError(RuntimeError):
    """The plugin cannot make this SGLang align chunks correctly.

    `remedy` is what the user should do; the failure guard repeats it when the
    scheduler refuses to start, so it must name the actual cause.
    """

    remedy = "Install a supported SGLang, or drop chunk_align from SGLANG_PLUGINS."

    def __init__(self, message, remedy=None):
        super().__init__(message)
        if remedy is not None:
            self.remedy = remedy

    def failure_report(self):
        """The one ERROR line a failed load logs: the cause, what to do, and what happens meanwhile."""
        return (
            f"sglang-chunk-align FAILED: {self} {self.remedy} Deterministic flashinfer will refuse "
            "to start while chunk_align is in SGLANG_PLUGINS."
        )


def installed_release(dist):
    """The one reader of installed versions: `dist`'s version string from its metadata (nothing
    imported), or None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


_pretended = contextvars.ContextVar("sglang_chunk_align.compat.pretended", default=None)


@contextlib.contextmanager
def pretended_sglang(release):
    """Within this block, the plugin takes SGLang `release` for the installed one: the tests' way
    to ask how it answers another release's version check, never by patching a reader."""
    token = _pretended.set(Version(release))
    try:
        yield
    finally:
        _pretended.reset(token)


def installed_version(dist="sglang"):
    """The installed version of `dist`, parsed (SGLang's as pretended_sglang pretends it), or None
    when it is not installed."""
    pretended = _pretended.get() if dist == "sglang" else None
    if pretended is not None:
        return pretended
    release = installed_release(dist)
    return None if release is None else Version(release)


def admits(gate, version):
    """Whether `version` passes `gate`, comma-separated ">=A" and "<B" clauses ("" passes all).

    It answers as packaging's SpecifierSet(gate).contains(version, prereleases=True)
    does (tests/test_loading.py checks every gate): "<B" also refuses B's own pre-, dev- and
    post-releases. Importing packaging.specifiers would cost every process that loads
    plugins ~5 ms: it compiles a large regular expression.
    """
    return all(
        version >= bound if operator == ">=" else version < bound and Version(version.base_version) != bound
        for operator, bound in _clauses(gate)
    )


def _clauses(gate):
    for clause in filter(None, (c.strip() for c in gate.split(","))):
        operator = ">=" if clause.startswith(">=") else "<" if clause.startswith("<") else None
        if operator is None:
            raise ValueError(f"version gate {gate!r}: each clause is >=A or <B")
        yield operator, Version(clause[len(operator):])


def sglang_at_least(release):
    """Whether the installed SGLang is `release` (a releases.py name) or newer."""
    version = installed_version()
    return version is not None and version >= Version(release)


def req_prefix_len(req):
    """Tokens of an SGLang Req whose KV it already has: Req.prefix_len from 0.5.22, the
    length of its KV indices (Req.prefix_indices) before. The newer name is tried first:
    a try that does not raise costs nothing, and the PrefillAdder wrappers ask per request."""
    try:
        return req.prefix_len
    except AttributeError:
        return len(req.prefix_indices)


def req_extend_end(req):
    """Where an SGLang Req's admitted extend ends: Req.extend_end from 0.5.22, Req.extend_range before."""
    try:
        return req.extend_end
    except AttributeError:
        return req.extend_range.end


def env_flag(name, default):
    """A 0/1 environment switch (`default` where unset); any other value is a ChunkAlignError."""
    raw = os.environ.get(name, "")
    if raw not in ("", "0", "1"):
        raise ChunkAlignError(_invalid_switch(name, raw, default))
    return default if raw == "" else raw == "1"


def switch(name):
    """A switch of SWITCHES as the environment sets it, its default where unset."""
    return env_flag(name, SWITCHES[name])


def _invalid_switch(name, raw, default):
    unset = "on where the grid rules make it exact" if default is None else int(default)  # None: the radix switch
    return f"{name}={raw!r} is not valid: use 1 or 0 (unset means {unset})."


def switch_values():
    """Every switch's value (name -> bool, or None for the radix switch unset), an invalid one's raw
    text (str) in its place: doctor shows it next to the problem."""
    values = {}
    for name, default in SWITCHES.items():
        try:
            values[name] = env_flag(name, default)
        except ChunkAlignError:
            values[name] = os.environ[name]
    return values


def check_switches():
    """Every switch's value (as switch_values); one ChunkAlignError naming each invalid value.

    Called at load time (check_sglang_version, the first step of apply()),
    so a typo fails there rather than when the scheduler first reads it.
    """
    values = switch_values()
    bad = {name: raw for name, raw in values.items() if isinstance(raw, str)}
    if bad:
        raise ChunkAlignError(
            " ".join(_invalid_switch(name, raw, SWITCHES[name]) for name, raw in bad.items()),
            remedy=f"Fix {', '.join(bad)} (1 or 0, or unset).",
        )
    return values


def radix_cache(switches, version, mamba=False):
    """Whether the radix cache stays on under deterministic flashinfer where the plugin is armed:
    (on, why, refusals). The one decision the launcher acts on (scheduler_hooks.
    keep_radix_cache_where_exact), the scheduler logs and enforces, and doctor reports.

    Stock SGLang turns the radix cache off there because radix hits were not exact; the grid
    rules make them exact on SGLang RADIX_OPT_IN or newer, with the rules on and no mamba
    prefix cache, so by default it stays on wherever that holds, and elsewhere it is off, as
    stock keeps it. RADIX_CACHE_ENV=0 keeps stock's behaviour everywhere; RADIX_CACHE_ENV=1
    asks for it and is refused where it cannot be exact (`refusals`: one message per
    obstacle, in the order the scheduler checks them; it raises the first, doctor lists them
    all). `why` says on or off and why, as the scheduler's startup line and doctor show it.
    `switches` as check_switches returns them; `version` None (SGLang not installed) skips the
    release check; `mamba`: the model keeps mamba state in its prefix cache.
    """
    asked = switches[RADIX_CACHE_ENV]
    if asked is False:
        return False, f"off, as stock ({RADIX_CACHE_ENV}=0)", []
    obstacles = _radix_obstacles(switches, version, mamba)
    if asked and obstacles:
        return False, f"refused ({obstacles[0][0]})", [refusal for _, refusal in obstacles]
    if obstacles:
        return False, f"off, as stock ({obstacles[0][0]})", []
    return True, f"on ({RADIX_CACHE_ENV}=1)" if asked else "on (default: the grid rules make radix hits exact)", []


def _radix_obstacles(switches, version, mamba):
    """What keeps the grid rules from making radix hits exact: (why, the refusal of RADIX_CACHE_ENV=1)."""
    obstacles = []
    if version is not None and version < Version(releases.RADIX_OPT_IN):
        obstacles.append((
            f"SGLang {version} is older than {releases.RADIX_OPT_IN}, where the grid rules reach radix hits and the tree",
            f"{RADIX_OPT_IN_NEEDS}: drop {RADIX_CACHE_ENV}, or upgrade SGLang.",
        ))
    if not switches[RULES_ENV]:
        obstacles.append((
            f"the grid rules are off: {RULES_ENV}=0",
            f"{RADIX_CACHE_ENV}=1 needs the grid rules ({RULES_ENV} not 0): "
            f"drop {RADIX_CACHE_ENV}, or turn the rules back on.",
        ))
    if mamba:
        obstacles.append((
            f"a mamba prefix cache: {MAMBA_NEEDS}",
            f"{RADIX_CACHE_ENV}=1 is not supported with a mamba prefix cache: {MAMBA_NEEDS}. "
            f"Drop {RADIX_CACHE_ENV} for this model.",
        ))
    return obstacles


def check_sglang_version(version):
    """Return a warning string for an allowed untested release, else None.

    Raises ChunkAlignError for a missing, older or (without the override)
    newer SGLang.
    """
    override = check_switches()[ALLOW_UNTESTED_ENV]  # every switch is validated, needed or not
    if version is None:
        raise sglang_missing()
    if admits(SUPPORTED_SGLANG, version):
        return None
    if version < _lowest_supported():
        raise ChunkAlignError(
            f"SGLang {version} is older than sglang-chunk-align supports "
            f"({SUPPORTED_SGLANG}); upgrade SGLang.",
            remedy=f"Upgrade SGLang to a supported release ({SUPPORTED_SGLANG}), or drop chunk_align from SGLANG_PLUGINS.",
        )
    if override:
        return (
            f"SGLang {version} is newer than the tested range ({SUPPORTED_SGLANG}); "
            f"trying it because {ALLOW_UNTESTED_ENV}=1. Every patch point is still checked."
        )
    raise ChunkAlignError(
        f"SGLang {version} is newer than the tested range ({SUPPORTED_SGLANG}). "
        f"Upgrade sglang-chunk-align, or set {ALLOW_UNTESTED_ENV}=1 to try it.",
        remedy=f"Upgrade sglang-chunk-align, set {ALLOW_UNTESTED_ENV}=1, or drop chunk_align from SGLANG_PLUGINS.",
    )


def sglang_missing():
    """The error for an environment without SGLang: it names the releases to install."""
    install = f"pip install 'sglang{SUPPORTED_SGLANG}'"
    return ChunkAlignError(
        f"SGLang is not installed: install a supported release, {install} "
        f"(the newest, sglang=={releases.NEWEST}, needs Python 3.11 or newer).",
        remedy=f"Install SGLang: {install}.",
    )


def _lowest_supported():
    return min(bound for operator, bound in _clauses(SUPPORTED_SGLANG) if operator == ">=")
