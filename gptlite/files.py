"""File-system faults in plain words, and the lock that gives a run folder to one process at a time.

Commands turn an OSError into one line that names the path, the cause (e.g. "no space left on device") and
what to do, instead of a traceback (`fault`); folders are made with such errors (`make_dir`).

A file or folder is written whole or not at all: under a temporary name beside it, .NAME.tmp-PID (`temp_path`),
which takes its name only when whole. A write killed before that (kill -9, a crash) leaves its temporary behind; the
next write of the same target removes those whose process no longer runs, and says so (it sees this machine's
processes only: on a folder that machines share, give every job its own target, as for the lock below).

A run folder is locked with an OS-level lock (fcntl.flock on RUN/.lock) for as long as the process that
holds it lives: a crash or kill -9 frees it, so no stale lock is ever left behind. The lock file names its
holder (pid, host, command) for the refusal message. flock works between processes of one machine; on
network filesystems (NFS, Lustre) whether it also excludes processes of other machines depends on the
filesystem and its mount options, so on a cluster give every job its own out_dir.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# errno -> (the cause in plain words, what to do about it)
CAUSES = {
    errno.ENOSPC: ("no space left on device", "free space or use a folder on another disk"),
    errno.EDQUOT: ("disk quota exceeded", "free space or use a folder on another disk"),
    errno.EROFS: ("read-only file system", "use a writable folder"),
    errno.EACCES: ("permission denied", "use a folder you can write to"),
    errno.EPERM: ("operation not permitted", "use a folder you can write to"),
    errno.ENOTDIR: ("a file is in the way where a folder should be", "choose another path"),
    errno.EEXIST: ("a file is in the way where a folder should be", "choose another path"),
    errno.EISDIR: ("it is a folder, not a file", "give the path of a file"),
    errno.ENOENT: ("it does not exist", "check the path"),
    errno.EIO: ("an input/output error of the disk", "check the disk"),
    # fault says which of the two it was (too_large); a message no command described names both
    errno.EFBIG: (
        "the file reached this process's file size limit (ulimit -f) or the largest its file system holds",
        "raise the limit (ulimit -f unlimited) or use a folder on another file system",
    ),
}
SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")  # numpy's tofile, when the disk fills up


def error(errno_: int | None, message: str) -> OSError:
    """An OSError that prints as `message` alone (no "[Errno N]" before it), keeping its errno."""
    e = OSError(message)
    e.errno = errno_
    return e


def fault(e: OSError, doing: str, path: str | Path | None = None) -> OSError:
    """An OSError whose message is one line: `doing` (e.g. "could not write checkpoint X"), the cause in plain
    words and the fix. Raise it `from None`. A short write (numpy's "N requested and M written", with no errno:
    the GGUF writer's tensors) of the file `path` is the file size limit's (ulimit -f) where the file reached it, and
    a full disk's otherwise. Python ignores SIGXFSZ, so a write past that limit fails (EFBIG) rather than killing
    the process, and is said as the limit it is."""
    number = e.errno
    if number is None and SHORT_WRITE.fullmatch(str(e)):
        number = errno.EFBIG if at_size_limit(path) else errno.ENOSPC
    if number == errno.EFBIG:
        cause, fix = too_large()
    else:
        cause, fix = CAUSES.get(number, (e.strerror or str(e), "check the path and the disk"))
    return error(number, f"{doing}: {cause}; {fix}")


def size_limit() -> int | None:
    """The largest file this process may write, in bytes (ulimit -f; RLIMIT_FSIZE), or None: no limit."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def at_size_limit(path: str | Path | None) -> bool:
    """Whether the file `path` is as large as this process may write a file."""
    limit = size_limit()
    try:
        return limit is not None and path is not None and os.stat(path).st_size >= limit
    except OSError:
        return False


def too_large() -> tuple[str, str]:
    """(the cause, the fix) of EFBIG: the file size limit of this process where it has one, else the file system's
    largest file."""
    limit = size_limit()
    if limit is not None:
        return (
            f"the file reached this process's file size limit (ulimit -f: {limit:,} bytes)",
            "raise it (ulimit -f unlimited) and run it again",
        )
    return "the file is larger than this file system holds", "write it to a folder on another file system"


def make_dir(path: str | Path, what: str = "folder") -> Path:
    """mkdir -p, with a one-line error naming the path when a file is in the way or it cannot be written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise error(errno.EEXIST, f"{what} {path} is a file, not a folder; choose another path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise fault(e, f"cannot create {what} {path}") from None
    return path


TEMP_SUFFIX = ".tmp-"  # .NAME.tmp-PID: the temporary name of NAME that process PID writes


def temp_path(target: str | Path, log: Callable[[str], None] | None = None) -> Path:
    """The temporary name this process writes `target` under before renaming it: .NAME.tmp-PID beside it. The
    temporaries of the same target that processes no longer running left (a killed or crashed write) are removed
    first, and `log` (a note on stderr by default) is told in one line; a running process's, and anything not named
    so, are left alone."""
    target = Path(target)
    removed = []
    size = 0
    for pid, path in stale_temps(target).items():
        held = disk_size(path)
        remove(path)
        if not os.path.lexists(path):
            removed.append((pid, path))
            size += held
    if removed:
        names = ", ".join(path.name for _, path in removed)
        pids = ", ".join(str(pid) for pid, _ in removed)
        (log or note)(
            f"removed {names} ({size / 2**20:,.1f} MiB) beside {target}: left by a write whose process "
            f"({'pid' if len(removed) == 1 else 'pids'} {pids}) no longer runs (killed or crashed)"
        )
    return target.parent / f".{target.name}{TEMP_SUFFIX}{os.getpid()}"


def stale_temps(target: Path) -> dict[int, Path]:
    """pid -> the temporary of `target` (.NAME.tmp-PID beside it) of each process PID that no longer runs."""
    pattern = re.compile(re.escape(f".{target.name}{TEMP_SUFFIX}") + r"([0-9]+)")
    try:
        entries = list(target.parent.iterdir())
    except OSError:  # no folder yet, or one this process cannot list: nothing of ours is there
        return {}
    stale = {}
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and not process_runs(int(match.group(1))):
            stale[int(match.group(1))] = entry
    return dict(sorted(stale.items()))


def process_runs(pid: int) -> bool:
    """Whether process `pid` runs on this machine; True where that cannot be told (not POSIX, not a pid), so that
    nothing is taken from a process that may still be writing it."""
    if os.name != "posix" or pid <= 0 or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or a number no pid can be
        return True
    return True


def disk_size(path: Path) -> int:
    """The bytes of a file, or of the files in a folder (0 where it cannot be read)."""
    try:
        if path.is_dir() and not path.is_symlink():
            return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
        return path.lstat().st_size
    except OSError:
        return 0


def remove(path: Path) -> None:
    """Delete a file, a link or a whole folder; one that cannot be deleted stays, as it was."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def note(line: str) -> None:
    """A line on stderr that tells what was done beside what was asked."""
    print(f"note: {line}", file=sys.stderr, flush=True)


def write_folder(
    target: str | Path,
    write: Callable[[Path], None],
    overwrite: bool = False,
    what: str = "folder",
    log: Callable[[str], None] | None = None,
) -> Path | None:
    """Make `target` hold exactly the files `write(tmp)` writes, all or nothing: they are written into a temporary
    folder beside it, which then takes its name. A target folder that exists already is refused unless `overwrite`; with
    it, the earlier folder, whole, moves aside to TARGET-previous-TIME beside it (returned; None if there was none), so
    nothing in it is lost. A failure (a full disk, an interruption) before the swap leaves the earlier folder untouched
    and no temporary folder behind (and a later write removes what a killed one left: temp_path, which tells `log`). The
    caller checks every input before calling."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise error(errno.EEXIST, f"{what} {target} is a file, not a folder; choose another path")
    earlier = target.is_dir() and any(target.iterdir())
    if earlier and not overwrite:
        names = sorted(p.name for p in target.iterdir())
        raise FileExistsError(
            f"{target} already holds {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}; choose "
            "a new folder, or pass overwrite (--overwrite) to replace it (the earlier one is kept "
            "beside it as TARGET-previous-TIME)"
        )
    parent = make_dir(target.parent)
    tmp = temp_path(target, log)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        fsync_dir(tmp)
    except BaseException as e:  # nothing half-written stays behind; the earlier folder is untouched
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, FileExistsError):
            raise fault(e, f"could not write {what} {target}") from None
        raise
    previous = None
    if target.is_dir():
        previous = parent / f"{target.name}-previous-{time.strftime('%Y%m%d-%H%M%S')}"
        if earlier:
            os.replace(target, previous)  # from here to the next rename, the earlier folder is whole at `previous`
        else:
            target.rmdir()
            previous = None
    os.replace(tmp, target)
    fsync_dir(parent)
    return previous


def fsync_dir(folder: str | Path) -> None:
    """Make a folder's new names durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (temp file + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    """`text` in `path`, whole or not at all: written beside it first and renamed; a fault is one line naming it."""
    tmp = temp_path(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise fault(e, f"could not write {path}") from None


class FolderLock:
    """An exclusive flock on folder/.lock, held until `release` or the process's end (see the module docstring).
    Where fcntl does not exist (Windows) nothing is locked."""

    NAME = ".lock"

    def __init__(self, folder: str | Path, what: str = "run folder"):
        self.path = Path(folder) / self.NAME
        self.file = None
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return
        try:
            self.file = open(self.path, "a+", encoding="utf-8")
        except OSError as e:
            raise fault(e, f"cannot write in {what} {self.path.parent}") from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise ValueError(
                f"{what} {self.path.parent} is in use by {holder}; wait for it to finish, stop it, or "
                "choose another folder"
            ) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"process {os.getpid()} on {socket.gethostname()} ({' '.join(sys.argv)[:200]})\n")
        self.file.flush()

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing the file releases the lock
            self.file = None


def read_jsonl(
    path: Path, fix: str, name: Callable[[int], str] | None = None, errors: str = "strict"
) -> Iterator[tuple[str, object]]:
    """(how errors name the line, its JSON value) for each non-blank line of a JSONL file; `name(n)` names line n
    ("PATH line n" by default). A line that is not JSON is a ValueError naming it, the parser's reason and `fix`;
    `errors` is how bytes that are not UTF-8 are decoded (open's argument)."""
    with open(path, encoding="utf-8", errors=errors) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = name(number) if name else f"{path} line {number}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not JSON ({e.msg}); {fix}") from None
            yield where, value
