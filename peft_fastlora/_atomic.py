"""Writes that replace user files: build the new files in a temporary sibling folder, then move them into place.

An interrupted write (an exception, Ctrl-C, SIGKILL, a full disk) must leave the files it was replacing
byte-identical. So every writer (``save_pretrained``, ``export_lora``, the ``merge`` command) writes into a fresh
folder beside the destination, on the same filesystem, and only when everything is written and flushed does
[`commit`] move the files into the destination with one ``os.replace`` each: each file is then either the old one
or the new one, never a partial one. A destination that does not exist yet is created by renaming the whole
temporary folder, which is atomic. Files of the destination that the writer does not write are kept.

Only stdlib: the command line imports this module before torch.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Union

STAGING_MARK = ".peft-fastlora-tmp-"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT loads adapter_model.safetensors whenever it exists: a new .bin written beside an old .safetensors (or the other
# way round) would be shadowed by, or stand beside, stale weights. Writing one removes the other from that folder.
ADAPTER_SUPERSEDES = {ADAPTER_WEIGHTS[0]: (ADAPTER_WEIGHTS[1],), ADAPTER_WEIGHTS[1]: (ADAPTER_WEIGHTS[0],)}
# Moved last, so that a crash between two renames leaves the old card describing the old weights, not the reverse.
_MOVE_LAST = ("adapter_config.json", "config.json", "README.md")

PathLike = Union[str, os.PathLike]


def staging_folder(dst: PathLike) -> Path:
    """Creates and returns an empty folder beside ``dst`` (same filesystem, so that ``os.replace`` into ``dst`` works).

    Its name starts with a dot and holds ``.peft-fastlora-tmp-``: a process killed before [`commit`] leaves it behind,
    and it is safe to delete. Where the parent folder is not writable but ``dst`` is, it goes inside ``dst``. It is
    made with ``os.mkdir`` (not ``tempfile.mkdtemp``, which makes it private), so a destination created by renaming
    it gets the permissions any new folder gets.
    """
    target = Path(dst).resolve()
    if target.is_file():
        raise ValueError(f"{str(dst)!r} is a file, not a folder: pass a folder to write to.")
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        path = target.parent / f".{target.name}{STAGING_MARK}{secrets.token_hex(4)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except PermissionError:  # a folder we may write into but not beside (e.g. ".", in a read-only parent)
            if not target.is_dir():
                raise
            path = target / path.name
            path.mkdir()
            return path


def destination_of(path: PathLike) -> Path:
    """The destination folder that a staging folder made by [`staging_folder`] stands for (for messages); any other
    path is returned as it is."""
    path = Path(path)
    name, mark, _ = path.name.partition(STAGING_MARK)
    if not mark or not name.startswith("."):
        return path
    name = name[1:]
    return path.parent if path.parent.name == name else path.parent / name


def _fsync(path: Path, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:  # Windows cannot open a directory; its renames need no directory sync
        if not directory:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the data files were synced
        if not directory:
            raise
    finally:
        os.close(fd)


def _move_order(rel: Path) -> tuple:
    return (rel.parent.parts, rel.name in _MOVE_LAST, _MOVE_LAST.index(rel.name) if rel.name in _MOVE_LAST else 0)


def commit(
    staging: PathLike,
    dst: PathLike,
    supersedes: Mapping[str, Sequence[str]] = ADAPTER_SUPERSEDES,
    stale: Sequence[str] = (),
) -> Path:
    """Moves every file of ``staging`` into ``dst`` (same relative paths), then removes ``staging``.

    Every file is flushed to disk first. Conflicts (a staged file whose place in ``dst`` is a folder, or below a
    file) are found before anything moves. ``supersedes`` maps a file name to sibling names that writing it removes
    from the same folder of ``dst`` (by default, a new adapter weight file removes the other format's). ``stale``
    holds glob patterns of files at the top of ``dst`` that are removed after the move unless just written (the
    shards of an earlier checkpoint, which the new one's index would not name but a loader could still pick up).

    Returns:
        `Path`: ``dst``.
    """
    staging, dst = Path(staging), Path(dst)
    files = sorted((p.relative_to(staging) for p in staging.rglob("*") if p.is_file()), key=_move_order)
    for rel in files:
        _fsync(staging / rel)
    target = dst.resolve()
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _fsync(staging, directory=True)
        os.rename(staging, target)  # a new destination appears whole, or not at all
        _fsync(target.parent, directory=True)
        return dst
    for rel in files:
        place = target / rel
        for parent in [*reversed(rel.parents)][1:]:
            if (target / parent).exists() and not (target / parent).is_dir():
                raise FileExistsError(f"Cannot write {str(place)!r}: {str(target / parent)!r} is a file.")
        if place.is_dir():
            raise IsADirectoryError(f"Cannot write {str(place)!r}: it is a folder.")
    for rel in files:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, target / rel)
    for rel in files:
        for other in supersedes.get(rel.name, ()):
            if (staging / rel.parent / other).exists():
                continue  # written too (both formats on purpose)
            with contextlib.suppress(FileNotFoundError):
                (target / rel.parent / other).unlink()
    written = {target / rel for rel in files}
    for pattern in stale:
        for path in target.glob(pattern):
            if path.is_file() and path not in written:
                path.unlink()
    for folder in {(target / rel).parent for rel in files}:
        _fsync(folder, directory=True)
    shutil.rmtree(staging, ignore_errors=True)
    return dst


@contextlib.contextmanager
def staged_write(
    dst: PathLike, keep: Sequence[str] = (), supersedes=ADAPTER_SUPERSEDES, stale: Sequence[str] = ()
) -> Iterator[Path]:
    """Yields a temporary folder to write into instead of ``dst``; commits it to ``dst`` when the block succeeds.

    On any exception (``KeyboardInterrupt`` included) the temporary folder is removed and ``dst`` is left as it was.

    Args:
        dst (`str` or `os.PathLike`): The folder the files are meant for (created if missing).
        keep (`Sequence[str]`): Files of ``dst`` that the writer *updates* rather than replaces (PEFT's README.md,
            whose text outside PEFT's own fields is the user's): copied into the temporary folder first.
        supersedes (`Mapping[str, Sequence[str]]`), stale (`Sequence[str]`): See [`commit`].
    """
    staging = staging_folder(dst)
    try:
        for name in keep:
            if (Path(dst) / name).is_file():
                shutil.copy2(Path(dst) / name, staging / name)
        yield staging
        commit(staging, dst, supersedes, stale)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
