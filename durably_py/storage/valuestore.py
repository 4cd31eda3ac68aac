"""Values stored once: large or repeated values of a run's records kept once, content-addressed, beside its log.

An agent loop returns (or snapshots) its whole, growing conversation at every turn; written as it is, each
record repeats everything before it and the log grows with the square of the turns. Before a long line is
appended (`StorageFront.append`), `externalise` walks it as plain JSON, bottom-up, and replaces

- any object member or array element whose compact encoding is at least `VALUE_MIN` bytes by a reference
  token ``{"$blob":"<sha256 hex>"}``, its bytes kept once under that digest (its own large members were
  replaced first, so a message shared by many records is kept once, whatever holds it);
- each aligned block of `BLOCK` elements of a long array by one token of a *fragment*: the elements'
  encodings joined by commas, without brackets, so an array that grows by appending shares all its full
  blocks with its earlier versions and a record holds a few block tokens plus its loose tail.

Reading is byte-level (`resolve`): each token in a line is replaced by its blob's bytes, recursively, which
gives back the original line (up to JSON spelling). A JSON string cannot hold the token's bytes unescaped, and
the value codec wraps a user dict whose only key is ``"$blob"`` as ``{"$esc": {...}}``: a token right after
``{"$esc":`` is user data and never resolved, and `externalise` never puts a token there.

The blobs are the run's own (deleted with it, so nothing global needs collecting); each adapter keeps them
durably before the record that refers to them (files: ``runs/<id>.blobs``; SQLite and PostgreSQL: the
``run_blobs`` table, in the record's transaction; memory: a dict). Nothing here knows the kinds of records.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

__all__ = [
    "BLOCK", "LINE_MIN", "TOKEN", "VALUE_MIN", "enabled", "externalise", "parse_blob_lines", "resolve",
    "resolve_line",
]

LINE_MIN = 2048
"""Lines shorter than this are appended as they are (the plain step path pays one `len`)."""
VALUE_MIN = 384
"""A member or element whose compact encoding is at least this long is kept as a blob."""
BLOCK = 4
"""Elements (or tokens of blocks) per block of a long array."""
TOKEN = b'{"$blob":"'
"""How every reference token starts: a log without these bytes needs no resolving."""
_BLOCK_MIN = 160
"""An array whose blocks average less than this (two tokens' worth) is not cut: its blocks cost more than they
share."""
ENV = "DURABLY_VALUES_ONCE"
"""Set to 0 to write plain logs (every value inline) where a storage is not told otherwise."""

_TOKEN_RE = re.compile(rb'(?<!\{"\$esc":)\{"\$blob":"([0-9a-f]{64})"\}')
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
Blobs = Callable[[], Mapping[str, bytes]]
"""The blobs of one run by digest, fetched only when a line holds a token."""


def enabled(setting: bool | None) -> bool:
    """Whether a storage stores values once: its own `values_once` when set, else `DURABLY_VALUES_ONCE`
    (on unless it is 0, false, no or off)."""
    if setting is not None:
        return setting
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def externalise(data: bytes, kept: set[str]) -> tuple[bytes, dict[str, bytes]]:
    """`data` (newline-terminated JSON lines) with the large and repeated values of its long lines replaced by
    tokens, and the blobs it refers to that `kept` (the digests the run is known to hold) lacks, by digest.
    A line that is not JSON, or in which nothing was replaced, is left byte for byte."""
    new: dict[str, bytes] = {}
    lines = data.split(b"\n")
    changed = False
    for i, line in enumerate(lines):
        if len(line) < LINE_MIN:
            continue
        try:
            record = _decode(line)
        except msgspec.DecodeError:
            continue
        walker = _Walk(kept, new)
        out = walker.value(record)
        if walker.replaced:
            lines[i] = _encode(out)
            changed = True
    return (b"\n".join(lines) if changed else data), new


class _Walk:
    """One line's bottom-up walk; `replaced` says whether any token was put in, `cut` whether the value being
    walked holds an array cut into blocks."""

    __slots__ = ("cut", "kept", "new", "replaced")

    def __init__(self, kept: set[str], new: dict[str, bytes]) -> None:
        self.kept = kept
        self.new = new
        self.replaced = False
        self.cut = False

    def token(self, data: bytes) -> dict[str, str]:
        """The token of `data`, kept as a new blob unless the run holds it already."""
        digest = hashlib.sha256(data).hexdigest()
        if digest not in self.kept and digest not in self.new:
            self.new[digest] = data
        self.replaced = True
        return {"$blob": digest}

    def value(self, value: Any) -> Any:
        """`value` with its large members and elements (and blocks of long arrays) replaced by tokens."""
        if type(value) is dict:  # never a token right after "$esc": it would read as user data
            return {key: self.value(item) if key == "$esc" else self.child(item) for key, item in value.items()}
        if type(value) is list:
            items = [self.child(item) for item in value]
            return self.blocks(items) if len(items) >= BLOCK else items
        return value

    def blocks(self, items: list[Any]) -> list[Any]:
        """A long array as tokens of aligned blocks plus its loose tail: `BLOCK` elements make a block, `BLOCK`
        block tokens a block of the next level, and so on, so an array grown by appending shares every full
        block with its earlier versions and holds at most `BLOCK` - 1 tokens per level. An array of small
        elements (blocks shorter than `VALUE_MIN`) is left whole."""
        encoded = [_encode(item) for item in items]
        if sum(map(len, encoded)) < _BLOCK_MIN * (len(items) // BLOCK):
            return items
        full = len(items) - len(items) % BLOCK
        rest: list[Any] = items[full:]
        level = [self.token(b",".join(encoded[i:i + BLOCK])) for i in range(0, full, BLOCK)]
        while len(level) >= BLOCK:
            full = len(level) - len(level) % BLOCK
            rest = level[full:] + rest
            level = [self.token(b",".join(map(_encode, level[i:i + BLOCK]))) for i in range(0, full, BLOCK)]
        self.cut = True
        return level + rest

    def child(self, item: Any) -> Any:
        """A member or element: walked, then a token when its encoding is still large. A value holding an
        array cut into blocks stays where it is: its blocks are what later versions share, the rest is new."""
        kind = type(item)
        if kind is dict or kind is list:
            outer, self.cut = self.cut, False
            item = self.value(item)
            cut, self.cut = self.cut, outer or self.cut
            if cut:
                return item
        elif kind is not str:
            return item
        data = _encode(item)
        return self.token(data) if len(data) >= VALUE_MIN else item


def resolve(data: bytes, blobs: Blobs) -> tuple[bytes, set[str]]:
    """`data` with every token replaced by its blob's bytes, recursively, and the digests of tokens whose blob
    the run lacks (left in place). Data without a token is returned as it is, nothing fetched."""
    if TOKEN not in data:
        return data, set()
    table = blobs()
    done: dict[str, bytes] = {}
    missing: set[str] = set()

    def expand(match: re.Match[bytes]) -> bytes:
        digest = match.group(1).decode()
        found = done.get(digest)
        if found is None:
            raw = table.get(digest)
            if raw is None:
                missing.add(digest)
                return match.group(0)
            found = done[digest] = _TOKEN_RE.sub(expand, raw) if TOKEN in raw else raw
        return found

    return _TOKEN_RE.sub(expand, data), missing


def resolve_line(line: bytes, blobs: Blobs) -> bytes:
    """One line resolved (`resolve`), a token whose blob is missing left in place (for summaries such as a
    run's last record, which never fail a listing)."""
    return resolve(line, blobs)[0] if TOKEN in line else line


def parse_blob_lines(data: bytes) -> Mapping[str, bytes]:
    """The blobs of a file sidecar: lines ``<digest> <bytes>``; a line whose bytes are not its digest's (cut short
    by a crash) is left out. Each value is checked against its digest when first looked up, so a reader that
    resolves one line hashes only what that line refers to."""
    return _SidecarValues(data)


class _SidecarValues(Mapping[str, bytes]):
    """Sidecar lines by digest, each checked against its digest on first lookup (`parse_blob_lines`)."""

    def __init__(self, data: bytes) -> None:
        self._lines: dict[str, list[bytes]] = {}
        self._good: dict[str, bytes] = {}
        for line in data.split(b"\n")[:-1]:
            digest, _, value = line.partition(b" ")
            if len(digest) == 64:
                self._lines.setdefault(digest.decode("ascii", "replace"), []).append(value)

    def __getitem__(self, digest: str) -> bytes:
        found = self._good.get(digest)
        if found is None:
            found = next((value for value in self._lines.get(digest, ())
                          if hashlib.sha256(value).hexdigest() == digest), None)
            if found is None:
                raise KeyError(digest)
            self._good[digest] = found
        return found

    def __iter__(self) -> Iterator[str]:
        return (digest for digest in self._lines if digest in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def blob_lines(blobs: Mapping[str, bytes]) -> bytes:
    """The sidecar lines of `blobs` (`parse_blob_lines` reads them back)."""
    return b"".join(digest.encode() + b" " + data + b"\n" for digest, data in blobs.items())
