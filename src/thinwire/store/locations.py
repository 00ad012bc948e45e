"""Where sites leave their messages: a location is a URL, its objects are written once.

A location holds objects by key ('rounds/0000000007/sites/site-a'): bytes that are created
once and never change. That is all the round agreement needs from a store, and it is what
every store that sites behind NAT can reach offers: a shared or mounted filesystem, or an
S3-API bucket. Three operations, counted:

    put_once(key, data) -> bool     create the object; False when the key already exists
                                    (never overwrites: the first writer wins, atomically)
    get(key) -> bytes | None        the whole object, or None when there is none
    list(prefix) -> [key, ...]      the keys under a folder prefix ('rounds/0000000007/'),
                                    sorted; a prefix is matched segment by segment, as
                                    object_store and S3 delimiters do, not as a bare string

Keys are '/'-separated segments of letters, digits, '.', '_' and '-', none starting with
'.', so the filesystem location can keep its temporary names ('.<name>.tmp-...') out of
every listing and no key escapes the location's folder.
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from dataclasses import dataclass, fields
from pathlib import Path

_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
SCHEMES = ("file", "s3")


class LocationError(RuntimeError):
    """The location itself cannot be used: a missing bucket or folder, refused credentials."""


@dataclass
class StoreTraffic:
    """Requests and bytes one site sent to its location (cumulative, or a round's difference).

    bytes_written counts every object this site sent, including a put_once that lost (the
    bytes crossed the link either way); bytes_read counts the objects' bytes that came back.
    Listings count as requests, not bytes: their size depends on the store's XML or JSON.
    """

    puts: int = 0
    gets: int = 0
    lists: int = 0
    bytes_written: int = 0
    bytes_read: int = 0

    @property
    def requests(self) -> int:
        return self.puts + self.gets + self.lists

    def minus(self, earlier: StoreTraffic) -> StoreTraffic:
        return StoreTraffic(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def copy(self) -> StoreTraffic:
        return self.minus(StoreTraffic())

    def as_dict(self) -> dict[str, int]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "requests": self.requests}


def check_key(key: str) -> str:
    """`key` if it is a valid object key, else ValueError naming it."""
    segments = key.split("/")
    if not key or not all(_SEGMENT.fullmatch(s) for s in segments):
        raise ValueError(f"invalid object key {key!r}: '/'-separated segments of [A-Za-z0-9._-], "
                         "none empty or starting with '.'")
    return key


def _folder(prefix: str) -> str:
    """A listing prefix as a folder: '' (everything) or 'a/b' (checked, no trailing '/')."""
    prefix = prefix.strip("/")
    return check_key(prefix) if prefix else ""


class Location:
    """A store of write-once objects, with the traffic this process sent to it.

    Subclasses implement `_put_once`, `_get`, `_list` and `check`; this class validates keys
    and counts. It is safe to call from several threads (the round exchange reads in parallel).
    """

    url: str

    def __init__(self) -> None:
        self.traffic = StoreTraffic()
        self._count_lock = threading.Lock()

    def put_once(self, key: str, data: bytes) -> bool:
        data = bytes(data)
        created = self._put_once(check_key(key), data)
        with self._count_lock:
            self.traffic.puts += 1
            self.traffic.bytes_written += len(data)
        return created

    def get(self, key: str) -> bytes | None:
        data = self._get(check_key(key))
        with self._count_lock:
            self.traffic.gets += 1
            self.traffic.bytes_read += len(data or b"")
        return data

    def list(self, prefix: str = "") -> list[str]:
        keys = sorted(self._list(_folder(prefix)))
        with self._count_lock:
            self.traffic.lists += 1
        return keys

    def check(self) -> None:
        """Raise LocationError when the location cannot be used (called once, at setup)."""
        raise NotImplementedError

    def _put_once(self, key: str, data: bytes) -> bool:
        raise NotImplementedError

    def _get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def _list(self, folder: str) -> list[str]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class FileLocation(Location):
    """A folder on a real filesystem: one machine, NFS, or a mounted bucket.

    An object is written under a temporary name in its final folder and then hard-linked
    to its key: link(2) is atomic and fails when the key exists (the O_EXCL guarantee, with
    the content already complete), so a reader never sees half an object and two writers of
    one key cannot both win. rename(2) would silently replace an existing key instead.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        super().__init__()
        self.root = Path(root)
        self.url = self.root.as_uri()

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as err:
            raise LocationError(f"{self.url}: {self.root} exists and is not a folder") from err
        except PermissionError as err:
            raise LocationError(f"{self.url}: cannot create the folder {self.root}: {err}") from err

    def _put_once(self, key: str, data: bytes) -> bool:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
        with open(temp, "xb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())     # the content is on disk before the key can be seen
        try:
            os.link(temp, path)
            return True
        except FileExistsError:
            return False
        finally:
            temp.unlink()

    def _get(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _list(self, folder: str) -> list[str]:
        base = self.root / folder if folder else self.root
        keys = []
        for parent, dirs, names in os.walk(base):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            rel = Path(parent).relative_to(self.root)
            keys += [(rel / n).as_posix() for n in names if not n.startswith(".")]
        return keys
