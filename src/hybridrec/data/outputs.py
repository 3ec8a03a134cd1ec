"""Outputs written whole or not at all, and never over an input.

The rules every writing command follows (``data synth``, ``data preprocess``, ``predict``,
``export``; the exported ``score.py`` keeps a small copy of its own, as it runs without
hybridrec):

- **Whole or not at all.** An output is written under a temporary name beside its final one
  (``NAME.tmp-<pid>``, :func:`~hybridrec.data.shards.tmp_path`: the same file system, so one
  rename), fsynced, and renamed to its final name only once complete. A failure on the way (a
  malformed line, a full disk, Ctrl-C) removes the temporary, and an earlier complete output
  under the final name stays as it was. (Whole JSON or text files written at once:
  :func:`hybridrec.files.write_text_atomic`, whose module also holds the fsync helpers;
  this module is for outputs streamed into a file and for directories.)
- **Never over an input.** Before anything is opened for writing, an output that is one of
  the command's inputs is refused in one line: the same resolved path, or the same file by
  another name (a hard link, a bind mount: :func:`os.path.samestat`). So is an output
  directory that holds an input, since replacing the directory would delete it.
- **Replacing a directory** (``--overwrite``) takes only a directory the command itself
  wrote: its known files and nothing else (:func:`unknown_entry`); anything else is refused
  in one line naming what is in the way, and is left as it was.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from hybridrec.data.shards import TMP_MARK, tmp_path
from hybridrec.errors import ConfigError
from hybridrec.files import fsync_dir, fsync_file, fsync_tree


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file or directory: the same resolved path, or (both
    existing) the same device and inode."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    try:
        return os.path.samestat(os.stat(a), os.stat(b))
    except OSError:
        return False


def holds(directory: Path, path: Path) -> bool:
    """Whether ``path`` lies inside ``directory`` (by resolved path, or a parent of
    ``path`` being ``directory`` by device and inode)."""
    directory, path = Path(directory), Path(path)
    resolved = path.resolve()
    if directory.resolve() in resolved.parents:
        return True
    try:
        st = os.stat(directory)
    except OSError:
        return False
    for parent in resolved.parents:
        with contextlib.suppress(OSError):
            if os.path.samestat(st, os.stat(parent)):
                return True
    return False


def refuse_over_inputs(out: Path, inputs: Iterable[tuple[str, Path]], *, option: str = "--out") -> None:
    """Raise :class:`ConfigError` (one line) when ``out`` is one of ``inputs`` or holds one.
    ``inputs``: ``(what, path)`` pairs, e.g. ``("the input", day_0.tsv)``, ``("the --like
    dataset", D)``."""
    for what, path in inputs:
        if same_file(out, path):
            raise ConfigError(f"{option} {out}: is {what} {path}; write the output elsewhere")
        if holds(out, path):
            raise ConfigError(f"{option} {out}: holds {what} {path}, which replacing it would "
                              "delete; write the output elsewhere")


def commit_file(tmp: Path, out: Path) -> None:
    """A complete, closed ``tmp`` renamed over ``out`` (same directory), durably."""
    fsync_file(tmp)
    os.replace(tmp, out)
    fsync_dir(out.parent)


@contextlib.contextmanager
def staged_file(out: Path) -> Iterator[Path]:
    """The temporary path to write ``out`` through: renamed to ``out`` when the block ends
    without error (the block closes what it opened), removed when it raises."""
    tmp = tmp_path(out)
    try:
        yield tmp
        commit_file(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def replace_dir(tmp: Path, out: Path) -> None:
    """A complete directory ``tmp`` renamed to ``out`` (same parent), durably. An earlier
    ``out`` is moved aside first (``OUT.old-<pid>``) and removed once ``tmp`` is in place (it is
    put back if that rename fails); a crash between the two renames leaves it there, whole.
    (POSIX has no rename that swaps two directories at once.)"""
    fsync_tree(tmp)
    if out.exists() or out.is_symlink():
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        fsync_dir(out.parent)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    else:
        os.rename(tmp, out)
        fsync_dir(out.parent)


_STALE = re.compile(re.escape(TMP_MARK) + r"\d+$")


def unknown_entry(directory: Path, known: Callable[[str], bool]) -> str | None:
    """The first entry under ``directory`` (its path relative to it; a directory's ends in
    ``/``) that ``known`` does not accept, or None when it accepts every one. Directories
    accepted are looked into; symbolic links are never accepted; a known name with a
    ``.tmp-<pid>`` suffix (what a killed writer left) is accepted."""
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        is_dir = entry.is_dir(follow_symlinks=False)
        rel = entry.name + ("/" if is_dir else "")
        if entry.is_symlink() or not known(_STALE.sub("", rel)):
            return rel
        if is_dir:
            inner = unknown_entry(Path(entry.path), lambda r, d=rel: known(d + r))
            if inner is not None:
                return rel + inner
    return None
