"""`DirStore`: an `ObjectStore` keeping objects as files under a local directory.

The embedded default zoo (``./.kiln/zoo``) and the trainer's local checkpoints live in one. A key
``a/b/c`` is the file ``root/a/b/c``; writes are atomic (temporary file, fsync, rename), so a
reader never sees a partial object, even across processes.

Callers: `store.open_store` (paths and ``file://`` URIs), the trainer's checkpoints, tests; all
through `store.DirStore`. Non-goals: no locking between writers of one key (the last rename
wins), no caching, never imports torch.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from kiln.zoo import objectstore


class DirStore:
    """Objects as files under `root`; a key ``a/b/c`` is the file ``root/a/b/c``.

    Writes go to a temporary file in the target directory, are flushed to disk, then renamed
    over the target, so a reader never sees a partial object, even across processes. The root
    is created on the first write.
    """

    def __init__(self, root: Path | str) -> None:
        """Use (and on the first write create) the directory `root`.

        Args:
            root: the directory; a relative path is taken from the current working directory now.

        Raises:
            ValueError: `root`, or a folder above it, is an existing file: no object could ever
                be written there (checked now, so a run fails before training, not after).
        """
        self.root = Path(root).expanduser().absolute()
        for path in (self.root, *self.root.parents):
            if path.is_dir():
                break
            if path.exists():
                where = "" if path == self.root else f" (it lies under {path})"
                raise ValueError(f"{path} is a file, not a directory{where}; point the zoo at a "
                                 "directory")

    def describe(self) -> str:
        return f"directory {self.root}"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*objectstore.check_key(key).split("/"))

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write atomically (temp file, fsync, rename).

        Raises:
            ValueError: bad key, or the key clashes with a directory (``a`` beside ``a/b``).
            StoreUnavailable: the directory is not writable or the disk is full.
        """
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=objectstore.TMP_PREFIX, dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as file:
                    os.fchmod(file.fileno(), 0o644)  # mkstemp makes 0600; others read the zoo
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(tmp_name, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp_name)
                raise
        except (IsADirectoryError, NotADirectoryError, FileExistsError) as exc:
            raise ValueError(
                f"object key {key!r} clashes with another key in {self.describe()}: a directory "
                "store cannot hold both 'a' and 'a/b'"
            ) from exc
        except OSError as exc:
            raise objectstore.StoreUnavailable(
                f"cannot write {key!r} to {self.describe()}: {exc.strerror or exc}; check that "
                "the directory is writable and the disk has space"
            ) from exc

    def get_bytes(self, key: str) -> bytes:
        """Read the file under `key`.

        Raises:
            ObjectNotFound: no file under the key.
            StoreUnavailable: the file exists but cannot be read (permissions, I/O error).
        """
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise objectstore.ObjectNotFound(key, self.describe()) from None
        except OSError as exc:
            raise objectstore.StoreUnavailable(
                f"cannot read {key!r} from {self.describe()}: {exc.strerror or exc}; check the "
                "file's permissions"
            ) from exc

    def list_keys(self, prefix: str) -> list[str]:
        """Every key starting with `prefix`, sorted; temporary files are hidden.

        Raises:
            StoreUnavailable: a directory under the root cannot be listed.
        """
        head, _, _ = objectstore.check_prefix(prefix).rpartition("/")
        base = self.root.joinpath(*head.split("/")) if head else self.root

        def fail(exc: OSError) -> None:
            if not isinstance(exc, FileNotFoundError | NotADirectoryError):  # absent, or gone
                raise objectstore.StoreUnavailable(
                    f"cannot list {exc.filename} in {self.describe()}: {exc.strerror or exc}"
                ) from exc

        keys = []
        for dir_path, _, file_names in os.walk(base, onerror=fail):
            rel = Path(dir_path).relative_to(self.root).as_posix()
            for name in file_names:
                key = name if rel == "." else f"{rel}/{name}"
                if not name.startswith(objectstore.TMP_PREFIX) and key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        """Remove the file under `key`, if any (empty directories stay).

        Raises:
            StoreUnavailable: the file exists but cannot be removed.
        """
        try:
            self._path(key).unlink(missing_ok=True)
        except (IsADirectoryError, NotADirectoryError):
            return  # no object under this key, only longer keys
        except OSError as exc:
            raise objectstore.StoreUnavailable(
                f"cannot delete {key!r} from {self.describe()}: {exc.strerror or exc}"
            ) from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()
