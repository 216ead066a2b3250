"""The disk tier's layout: `<root>/<digest>/` holds one complete, digest-checked adapter; nothing else is trusted.

Several replicas on one node each claim their own slot under the configured directory (`<dir>/slot-<k>/`, held by an
exclusive file lock for the life of the process): a restarted replica takes over a free slot, and with it the disk
cache its predecessor left.

Downloads land in `<root>/.staging/<digest>-<random>/` and become visible by one atomic rename, so a directory named
by a digest is always complete; evicted directories are renamed into `<root>/.trash/` first (atomic, so a new download
of the same digest never meets a half-deleted one) and removed afterwards. Leftovers of both are cleared at start.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO

DIGEST_DIR = re.compile(r"^[0-9a-f]{64}$")
STAGING, TRASH = ".staging", ".trash"


@dataclass(frozen=True)
class DiskEntry:
    """An adapter found on disk at start."""

    digest: str
    size_bytes: int
    last_used_ns: int  # the directory's mtime: refreshed on each use, so recency survives restarts


class DiskStore:
    """Owns the disk tier's directory under `root`: staging, installing, finding, retiring adapter directories."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.staging_root = self.root / STAGING
        self.trash_root = self.root / TRASH

    def path(self, digest: str) -> Path:
        return self.root / digest

    def scan(self) -> list[DiskEntry]:
        """Create the layout, clear staging and trash left by a previous process, and list the adapters held."""
        for d in (self.root, self.staging_root, self.trash_root):
            d.mkdir(parents=True, exist_ok=True)
        for leftover in (*self.staging_root.iterdir(), *self.trash_root.iterdir()):
            _remove(leftover)
        entries = []
        for d in self.root.iterdir():
            if d.is_dir() and DIGEST_DIR.match(d.name):
                size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
                entries.append(DiskEntry(d.name, size, d.stat().st_mtime_ns))
        return sorted(entries, key=lambda e: e.last_used_ns)

    def new_staging(self, digest: str) -> Path:
        path = self.staging_root / f"{digest}-{secrets.token_hex(4)}"
        path.mkdir(parents=True)
        return path

    def install(self, staging: Path, digest: str) -> Path:
        """Make a staged, verified directory visible under its digest (atomic rename)."""
        dest = self.path(digest)
        os.replace(staging, dest)  # an existing dest would be an empty-or-equal dir: replace fails loudly otherwise
        return dest

    def retire(self, digest: str) -> Path | None:
        """Take an adapter directory out of sight at once (rename into trash); `remove` the returned path later."""
        src = self.path(digest)
        if not src.exists():
            return None
        dest = self.trash_root / f"{digest}-{secrets.token_hex(4)}"
        os.replace(src, dest)
        return dest

    def touch(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.path(digest))

    @staticmethod
    def remove(path: Path | None) -> None:
        if path is not None:
            _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def claim_slot(root: Path, *, max_slots: int = 256) -> tuple[Path, IO[bytes]]:
    """Claim the first free `<root>/slot-<k>` directory for this process; keep the returned file open to hold it
    (the lock goes with the process, so a dead replica's slot is free again at once)."""
    root.mkdir(parents=True, exist_ok=True)
    for k in range(max_slots):
        slot = root / f"slot-{k}"
        slot.mkdir(exist_ok=True)
        handle = (slot / ".lock").open("ab")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return slot, handle
    raise RuntimeError(f"all {max_slots} disk cache slots under {root} are held by other processes")
