#!/usr/bin/env python3
"""Generates the sync client (rollbox_sdk/client.py) from the async one (rollbox_sdk/aio.py).

Usage: python3 sdk/python/tools/unasync.py [--output PATH]   (default: rollbox_sdk/client.py)

The async source is rewritten token by token: ``async`` and ``await`` go, and the names in
RENAMES become their sync twins (``AsyncClient`` -> ``Client``, ``__aiter__`` -> ``__iter__``,
``aread`` -> ``read``...), in code and in docstrings alike. What truly differs between the two
clients is marked in aio.py as a block

    # unasync: NAME
    ...the async lines...
    # unasync: end

which the sync file gets as HOOKS[NAME] instead. Every block needs its hook and every hook its
block, and the result may not say ``async``, ``await`` or ``Async`` anywhere: each of these is
an error naming the line. Standard library only.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Dict, List, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "rollbox_sdk"

RENAMES: Dict[str, str] = {
    "AsyncClient": "Client",
    "AsyncExecStream": "ExecStream",
    "AsyncHTTPTransport": "HTTPTransport",
    "AsyncIterator": "Iterator",
    "AsyncUpload": "Upload",
    "aupload_body": "upload_body",
    "aclose": "close",
    "aread": "read",
    "aiter_bytes": "iter_bytes",
    "aiter_lines": "iter_lines",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__aiter__": "__iter__",
    "__anext__": "__next__",
}

HOOKS: Dict[str, str] = {
    "module-doc": '''\
# Generated from aio.py by sdk/python/tools/unasync.py: do not edit. Edit aio.py, then run
# `python3 sdk/python/tools/unasync.py` (scripts/check-sdk-sync.sh fails while they differ).
"""The synchronous client."""
''',
    "client-doc": '''\
    """A client of `rollbox serve`'s native API.

    Args:
        url: ``http://127.0.0.1:PORT`` of a daemon serving loopback TCP.
        socket: the daemon's Unix socket.
        api_key: the bearer key.
        timeout: seconds for ordinary calls. Creates, forks, resets, snapshots and execs wait
            as long as they take (an exec with ``timeout_s`` waits that plus 30 s).

    Without ``url`` or ``socket``: ``$ROLLBOX_URL``, else ``$ROLLBOX_SOCKET``, else
    ``/run/rollbox/rollbox.sock``. Without ``api_key``: ``$ROLLBOX_API_KEY``.

    Every method raises a :class:`~rollbox_sdk.errors.ApiError` subclass when the daemon
    refuses (BadRequest with ``.field``, NotFound, Conflict, Overloaded with
    ``.retry_after``...), and :class:`~rollbox_sdk.errors.TransportError` when it cannot be
    reached. Use it as a context manager, or call :meth:`close`.

    Example::

        with Client() as rb:
            sb = rb.create_sandbox("python", ttl_s=600)
            print(rb.run(sb, ["python3", "-c", "print(6*7)"]).stdout)
            rb.delete_sandbox(sb)
    """
''',
    "stream-doc": '''\
        """Start a command and stream its events (see :class:`ExecStream`).

        With ``stdin_open`` its stdin stays open for :meth:`ExecStream.write_stdin`."""
''',
    "exec-stream-doc": '''\
    """A streaming exec: iterate it for :class:`ExecEvent` s (``started``, ``stdout``,
    ``stderr``, then ``exit``); ``seq`` runs from 0 without gaps.

    An ``error`` line, a gap in ``seq`` or a body cut short raises
    :class:`~rollbox_sdk.errors.StreamError`. :attr:`pid` is known once it is open.

    Example::

        with rb.stream(sb, ["cat"], stdin_open=True) as proc:
            proc.write_stdin(b"hello\\\\n")
            proc.close_stdin()
            for event in proc:
                print(event.type, event.data)
    """
''',
    # The sync stream is open once made; the async one opens in `async with` (or `start`).
    "stream-init": "        self._start()\n",
    "start": "",
    "enter": "        return self\n",
}

BEGIN = re.compile(r"^\s*# unasync: (?P<name>[\w-]+)\s*$")
END = "# unasync: end"
# What may not survive into the sync file.
LEFTOVER = re.compile(r"\b(async|await)\b|Async|__a(enter|exit|iter|next)__")
# Tokens whose text is renamed word by word (Python 3.12 splits f-strings into parts).
TEXT = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
WORD = re.compile(r"\b(" + "|".join(map(re.escape, RENAMES)) + r")\b")


class UnasyncError(Exception):
    """aio.py cannot be turned into client.py; the message names the line."""


def blocks(lines: List[str]) -> List[Tuple[int, int, str]]:
    """The hook blocks as (first line, last line, name), 0-based and inclusive."""
    found = []
    start = None
    for number, line in enumerate(lines):
        begin = BEGIN.match(line)
        if begin and begin.group("name") != "end":
            if start is not None:
                raise UnasyncError(f"aio.py:{number + 1}: block inside block {start[1]!r}")
            start = (number, begin.group("name"))
        elif line.strip() == END:
            if start is None:
                raise UnasyncError(f"aio.py:{number + 1}: `{END}` without its block")
            found.append((start[0], number, start[1]))
            start = None
    if start is not None:
        raise UnasyncError(f"aio.py:{start[0] + 1}: block {start[1]!r} has no `{END}`")
    names = [name for _, _, name in found]
    for name in names:
        if name not in HOOKS:
            raise UnasyncError(f"aio.py: block {name!r} has no hook in unasync.py")
        if names.count(name) > 1:
            raise UnasyncError(f"aio.py: block {name!r} appears {names.count(name)} times")
    for name in HOOKS:
        if name not in names:
            raise UnasyncError(f"unasync.py: hook {name!r} has no block in aio.py")
    return found


def unasync(source: str) -> str:
    """client.py's text from aio.py's."""
    lines = source.splitlines(keepends=True)
    spans = blocks(lines)
    hooked = {n for first, last, _ in spans for n in range(first, last + 1)}
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(row_col: Tuple[int, int]) -> int:
        return starts[row_col[0] - 1] + row_col[1]

    # (start, end, replacement) by offset in source; tokens in hook blocks are left alone.
    edits: List[Tuple[int, int, str]] = []
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for token, after in zip(tokens, tokens[1:] + tokens[-1:]):
        if token.start[0] - 1 in hooked:
            continue
        start, end = offset(token.start), offset(token.end)
        if token.type == tokenize.NAME and token.string in ("async", "await"):
            # The keyword and the blank after it.
            if after.start[0] == token.end[0]:
                end = offset(after.start)
            edits.append((start, end, ""))
        elif token.type == tokenize.NAME and token.string in RENAMES:
            edits.append((start, end, RENAMES[token.string]))
        elif token.type in TEXT:
            renamed = WORD.sub(lambda m: RENAMES[m.group(1)], token.string)
            if renamed != token.string:
                edits.append((start, end, renamed))
    for first, last, name in spans:
        edits.append((starts[first], starts[last + 1], HOOKS[name]))
    edits.sort()
    out = []
    at = 0
    for start, end, replacement in edits:
        if start < at:
            raise UnasyncError(f"aio.py: a token overlaps a hook block near offset {start}")
        out.append(source[at:start])
        out.append(replacement)
        at = end
    out.append(source[at:])
    result = "".join(out)
    for number, line in enumerate(result.splitlines(), 1):
        if LEFTOVER.search(line):
            raise UnasyncError(f"client.py:{number}: still async after unasync: {line.strip()}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description="Generate client.py from aio.py.")
    parser.add_argument("--output", type=Path, default=PACKAGE / "client.py")
    args = parser.parse_args()
    try:
        text = unasync((PACKAGE / "aio.py").read_text(encoding="utf-8"))
    except UnasyncError as e:
        print(f"unasync: {e}", file=sys.stderr)
        return 1
    args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
