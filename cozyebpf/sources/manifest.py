"""The manifest source: Kubernetes objects from a multi-document YAML file, re-read on change.

The file holds Services and EndpointSlices as `kubectl get -o yaml` prints them (one object per
document, or one `kind: List` with `items`). A thread watches the file's directory with inotify
(an in-place write, an editor's atomic rename, a ConfigMap volume's `..data` swap) and, as a
safety net or where inotify is not available, checks the file's (mtime, size, inode) every
poll interval; a change wakes the agent, whose `take()` reads the file again, document by
document, into the model's records, and hands over the whole set (the model keeps only what
differs). A file that cannot be read or parsed is reported once, and the agent keeps the
previous state programmed.

A file is read whole or not at all. A writer that truncates the file and then writes it (`cat
>`, an editor saving in place) leaves it empty or cut for a moment: read then, it would be a
manifest with fewer Services, and theirs would be removed until the next read. So:

- With inotify, the watch thread itself reads the file when an event batch says its writer
  closed it or renamed it into place (or a ConfigMap's `..data` was swapped), and hands that
  snapshot (the bytes and their signature, read together) to the agent under a lock, but only
  when no event of the file arrived between the batch and SNAPSHOT_SETTLE after the end of the
  read: a truncation that lands there (the next writer) discards the snapshot, and its close
  brings the next one. Before issue 37 the thread stamped the file whole by a `stat` after the
  batch, and a truncation in between was taken as whole: every Service removed. (The kernel
  queues a truncation's event at the end of its system call, when readers already see the
  empty file: the settle covers that moment, but a writer preempted inside it can still hand
  a cut snapshot over; what then holds is the rule below, and the writer's close, which brings
  the whole file.)
- Otherwise (no inotify, a change inotify did not report as a close, a writer that keeps the
  file open) the agent reads the file itself once its (mtime, size, inode) stayed the same for
  half a poll interval, or for WRITER_GRACE while inotify has seen it modified and not yet
  closed: a writer stalled between its truncation and its write (a loaded node) is waited for.
- A read that would remove more than half of the Services read last (MOST) is taken only when
  a second read, CONFIRM_AFTER seconds later or more and with no writer holding the file (as
  inotify sees it), finds the same bytes: a writer that truncates, closes and writes in a
  second open is caught between its two opens, and a deliberate removal of most Services waits
  those seconds. The README recommends an atomic rename (write a temporary file in the same
  directory, then `mv` it over the manifest): the agent sees the old file or the new one,
  never a part.

What is left: a cut snapshot (a writer that truncates, or rewrites in place, right after the
previous close and is slower than SNAPSHOT_SETTLE to have its event queued) that removes fewer
than half of the Services is taken, until that writer's close brings the whole file; and a
writer whose two opens are further apart than CONFIRM_AFTER is taken at its word.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import hashlib
import itertools
import logging
import os
import re
import select
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from cozyebpf.errors import SourceError
from cozyebpf.model import (
    DEFAULT_PROXY_NAME,
    ObjectSet,
    Problem,
    Read,
    gather,
    read_object,
    read_objects,
)
from cozyebpf.sources import ChangeSet, fastyaml, gc_paused

log = logging.getLogger(__name__)

T = TypeVar("T")
FAST = "fastyaml"  # the event reader, as a loader name

_KEEP = "the previous state stays programmed"
#: seconds a file inotify saw modified, and its writer has not closed yet, must stay unchanged
#: before it is read anyway (see the module)
WRITER_GRACE = 5.0
#: a read that removes more than this share of the Services read last needs a second read
#: (see the module): a file emptied or cut by a writer removes all or most of them, an edit
#: rarely more than a few
MOST = 0.5
#: seconds between a read that would remove most Services and the read that confirms it: as
#: long as a stalled writer is waited for (WRITER_GRACE)
CONFIRM_AFTER = WRITER_GRACE
#: seconds the watch thread waits, after reading a snapshot, for an event of the file that
#: comes late: the kernel queues a truncation's or a write's event at the end of its system
#: call, after readers already see the change (ext4 truncates, then notifies). Short, since
#: every change waits for it; the confirmation above is what holds when a writer is slower
SNAPSHOT_SETTLE = 0.01
Signature = tuple[int, int, int]  # (st_mtime_ns, st_size, st_ino)


def _sig(st: os.stat_result) -> Signature:
    return (st.st_mtime_ns, st.st_size, st.st_ino)


@dataclass(frozen=True)
class Snapshot:
    """The file's bytes and its signature, read together (the file did not change under the
    read)."""

    sig: Signature
    data: bytes


@dataclass(frozen=True)
class _Held:
    """A read that would remove most Services, waiting for its confirmation."""

    digest: bytes  # of its bytes
    at: float  # when it was read (the source's clock)


def _what(value: object) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return f"a {type(value).__name__}"


def _position(data: str | bytes, offset: int) -> str:
    """`offset` into `data` as "line L, column C" (both from 1; a column counts characters in
    text, bytes in data that could not be decoded)."""
    if isinstance(data, bytes):
        line, start = data.count(b"\n", 0, offset), data.rfind(b"\n", 0, offset) + 1
    else:
        line, start = data.count("\n", 0, offset), data.rfind("\n", 0, offset) + 1
    return f"line {line + 1}, column {offset - start + 1}"


# inotify(7): what the watch of the directory reports
_IN_MODIFY = 0x002
_IN_ATTRIB = 0x004
_IN_CLOSE_WRITE = 0x008
_IN_MOVED_FROM = 0x040
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_DELETE_SELF = 0x400
_IN_MOVE_SELF = 0x800
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_WATCH_MASK = (
    _IN_MODIFY
    | _IN_ATTRIB
    | _IN_CLOSE_WRITE
    | _IN_MOVED_FROM
    | _IN_MOVED_TO
    | _IN_CREATE
    | _IN_DELETE
    | _IN_DELETE_SELF
    | _IN_MOVE_SELF
)
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


_MARKER = re.compile(r"^(---|\.\.\.)(?=[ \t\r\n]|$)|^%", re.M)


def split_documents(text: str) -> list[str] | None:
    """`text` cut before every document start marker (`---` at the start of a line): each
    piece reads on its own as the same documents (a marker in a block or quoted scalar ends
    it or is an error, in YAML as in libyaml). None for a stream with directives (`%YAML`,
    `%TAG`) or explicit document ends (`...`), which a cut could separate from their
    documents."""
    starts = []
    for m in _MARKER.finditer(text):
        if m.group(1) != "---":
            return None
        starts.append(m.start())
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


class _Inotify:
    """An inotify watch of one directory; events name the entries that changed."""

    def __init__(self, directory: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        wd = libc.inotify_add_watch(self.fd, os.fsencode(directory), _WATCH_MASK)
        if wd < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, os.strerror(err), str(directory))

    def names(self, timeout: float) -> list[tuple[str, int]] | None:
        """(name, event mask) of the entries with events within `timeout` ("" for the
        directory itself); None when nothing happened."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return None
        out: list[tuple[str, int]] = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            off = 0
            while off + _EVENT.size <= len(buf):
                _wd, mask, _cookie, length = _EVENT.unpack_from(buf, off)
                name = buf[off + _EVENT.size : off + _EVENT.size + length].split(b"\0", 1)[0]
                out.append((os.fsdecode(name), mask))
                off += _EVENT.size + length

    def close(self) -> None:
        os.close(self.fd)


class ManifestSource:
    """A YAML manifest file as a source of Kubernetes objects (the agent's Source protocol:
    `start`, `take`, `stop`, `alive`; `changed`/`load` read the file directly)."""

    def __init__(
        self,
        path: str | Path,
        proxy_name: str = DEFAULT_PROXY_NAME,
        poll_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.clock = clock  # monotonic seconds, for how long a signature has stayed (tests)
        self.proxy_name = proxy_name
        self.poll_interval = poll_interval
        self._ever_read = False
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.inotify = False  # whether changes are seen through inotify (else polling)
        #: what the watch thread and the reader share, each only under it
        self._lock = threading.Lock()
        self._loaded: Signature | None = None  # signature of the content last taken
        #: the file as the watch thread read it when inotify said it is whole, not taken yet
        self._snapshot: Snapshot | None = None
        #: inotify saw the file modified since its writer last closed it (the watch thread)
        self._writing = False
        self._seen: tuple[Signature | None, float] = (None, 0.0)  # a signature, first seen at
        #: the reader's own (the agent's thread): the Services last taken, a read that would
        #: remove most of them
        self._services: set[tuple[str, str]] = set()
        self._held: _Held | None = None
        # a document's digest (of its text) -> what it reads as
        self._cache: dict[bytes, list[Read]] = {}
        #: a seam for tests: called by the watch thread after an event batch that says the file
        #: is whole, before it reads the snapshot (tests/unit/test_manifest.py puts the next
        #: writer's truncation there)
        self.before_snapshot: Callable[[], None] = lambda: None

    def _signature(self) -> Signature | None:
        try:
            return _sig(os.stat(self.path))
        except OSError:
            return None

    def changed(self) -> bool:
        """True on the first call, when the file's (mtime, size, inode) differ from what was
        last taken (an in-place write or an editor's atomic rename; also while a read that would
        remove most Services waits for its confirmation), and while the file cannot be
        stat'ed, so that load() reports why."""
        sig = self._signature()
        with self._lock:
            return sig is None or sig != self._loaded

    def _snapshot_now(self) -> Snapshot | None:
        """The file's bytes and signature, read together; None when it changed under the read
        (its size or mtime moved). Raises SourceError when it cannot be read."""
        try:
            with open(self.path, "rb") as f:
                before = _sig(os.fstat(f.fileno()))
                data = f.read()
                after = _sig(os.fstat(f.fileno()))
        except FileNotFoundError:
            raise SourceError(f"{self.path}: no such file; {_KEEP}") from None
        except OSError as e:
            raise SourceError(f"{self.path}: cannot be read: {e.strerror or e}; {_KEEP}") from e
        return Snapshot(before, data) if before == after else None

    def load(self) -> list[dict[str, Any]]:
        """The objects in the file: one per non-empty document, the `items` of a `kind: List`
        flattened. Raises SourceError naming the file (and, for YAML errors, line and column).

        A file that parsed, or failed to parse, is not reported as changed again until it is
        rewritten; a file that could not be read is.
        """
        return self._parse(self._text())

    def _text(self) -> str:
        """The file's text; records its signature as the one last read."""
        snap = None
        while snap is None:  # a direct read (load, read): until one is not changed under it
            snap = self._snapshot_now()
        with self._lock:
            self._loaded = snap.sig
        return self._decode(snap.data)

    def _decode(self, data: bytes) -> str:
        try:
            return data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise SourceError(
                f"{self.path}: {_position(data, e.start)}: byte 0x{data[e.start]:02x} is not "
                f"valid UTF-8; save the file as UTF-8; {_KEEP}"
            ) from None

    def read(self) -> ObjectSet:
        """The file's objects as the model's records, read document by document (no parsed
        object is kept). Documents whose text is unchanged since the last read are not parsed
        again: their records are kept with their text (`_chunks`), so an edit of one Service
        in a 10k-Service file costs milliseconds. Raises SourceError as load() does, and then
        nothing was read."""
        return self._objects(self._text())

    def _objects(self, text: str) -> ObjectSet:
        """read() of `text`."""
        fast = self._read_chunks(text)
        if fast is not None:
            return fast
        self._cache = {}
        return self._with_loaders(
            lambda loader: read_objects(
                self._documents(text, loader),
                self.proxy_name,
                again=functools.partial(self._documents, text, loader),
            )
        )

    def _document_list(self, text: str, loader: Any) -> list[dict[str, Any]]:
        return list(self._documents(text, loader))

    def _by_chunk(self, text: str, starts: list[int], loader: Any) -> dict[int, list[Read]] | None:
        """The records of `text`, grouped by the piece (split_documents) whose lines start at
        `starts`; None when an object has no name."""
        out: dict[int, list[Read]] = {}
        for obj, line in self._documents_at(text, loader):
            rec = read_object(obj, 0, self.proxy_name)
            if isinstance(rec, Problem):
                return None
            out.setdefault(bisect.bisect_right(starts, line) - 1, []).append(rec)
        return out

    def _read_chunks(self, text: str) -> ObjectSet | None:
        """read() through the cache of documents, or None where only a whole read can say
        what the file holds: a stream with directives or explicit document ends, a document
        that does not read on its own (an error: the whole read names it exactly), an object
        without a name (its Problem names it by its position in the file), a Service defined
        twice."""
        chunks = split_documents(text)
        if chunks is None or len(chunks) < 2:
            return None
        cache: dict[bytes, list[Read]] = {}
        results: list[Read] = []
        # a 128-bit digest, not the text: the cache costs 50 bytes a document, not its size
        digests = [hashlib.blake2b(c.encode(), digest_size=16).digest() for c in chunks]
        new = [d for d in digests if d not in self._cache]
        parsed: dict[int, list[Read]] | None = None
        if len(new) > len(chunks) // 2:  # mostly new (a first read): one parser for all
            starts = list(itertools.accumulate((c.count("\n") for c in chunks[:-1]), initial=0))
            try:
                parsed = self._with_loaders(functools.partial(self._by_chunk, text, starts))
            except SourceError:
                return None
            if parsed is None:
                return None
        for i, (chunk, digest) in enumerate(zip(chunks, digests, strict=True)):
            got = self._cache.get(digest)
            if got is None and parsed is not None:
                got = parsed.get(i, [])
            elif got is None:
                try:
                    objs = self._with_loaders(functools.partial(self._document_list, chunk))
                except SourceError:
                    return None
                got = [read_object(o, 0, self.proxy_name) for o in objs]
                if any(isinstance(r, Problem) for r in got):
                    return None
            cache[digest] = got
            results += got
        out, twice = gather(results)
        if twice:
            return None
        self._cache = cache
        return out

    def _with_loaders(self, fn: Callable[[Any], T]) -> T:
        """fn(loader) with the fastest loader that can read the file: the event reader
        (fastyaml), else libyaml's CSafeLoader (anchors, tags: what fastyaml leaves out), else
        the pure-Python SafeLoader, whose messages the errors here are written for (it also
        says why a C loader refused a file)."""
        fast = fastyaml.available()
        loaders: list[Any] = [FAST, yaml.CSafeLoader] if fast else []
        for loader in [*loaders, yaml.SafeLoader]:
            try:
                return fn(loader)
            except fastyaml.Unsupported:
                continue
            except SourceError:
                if loader is yaml.SafeLoader:
                    raise
                if loader is FAST:  # a YAML error: the precise loader names it
                    loaders.remove(yaml.CSafeLoader)
        raise AssertionError("unreachable: the last loader returns or raises")

    # -- the Source protocol -------------------------------------------------------------

    def check(self) -> None:
        """At start, a path that does not exist is a mistake (a typo, not a file that went
        away): SourceError naming it."""
        if not self.path.exists():
            raise SourceError(
                f"--manifests {self.path}: no such file; give the path of a YAML file with "
                "the Services and EndpointSlices"
            )

    def start(self, notify: Callable[[], None]) -> None:
        """Watch the file (the watch exists when this returns); `notify` on every change."""
        directory = self.path.absolute().parent
        ino: _Inotify | None = None
        try:
            ino = _Inotify(directory)
            self.inotify = True
        except OSError as e:
            log.warning(
                "cannot watch %s with inotify (%s); checking %s every %.1fs instead",
                directory,
                e.strerror or e,
                self.path.name,
                self.poll_interval,
            )
        self._thread = threading.Thread(
            target=self._watch, args=(ino, notify), name="watch-manifest", daemon=True
        )
        self._thread.start()

    def _watch(self, ino: _Inotify | None, notify: Callable[[], None]) -> None:
        try:
            while not self._stop.is_set():
                if ino is not None:
                    events = ino.names(self.poll_interval)
                    if events is not None:
                        if self._batch(ino, events):
                            notify()  # a whole snapshot to take
                        continue  # being written, or not ours: the close (or the poll) wakes
                else:
                    self._stop.wait(self.poll_interval)
                if self.changed():
                    notify()
        finally:
            if ino is not None:
                ino.close()

    def _fold(
        self, events: list[tuple[str, int]], whole: bool, writing: bool
    ) -> tuple[bool, bool] | None:
        """(whole, writing) after `events` of the file, from (whole, writing) before them, in
        order (a batch may hold a write and its close, or a close and the next writer's
        truncation, after which the file is not whole); None when none is the file's."""
        ours = [(n, m) for n, m in events if n in ("", self.path.name) or n.startswith("..")]
        if not ours:
            return None
        for n, m in ours:
            if n.startswith("..") or m & (_IN_CLOSE_WRITE | _IN_MOVED_TO):
                whole, writing = True, False
            elif m & _IN_MODIFY:
                whole, writing = False, True
        return whole, writing

    def _batch(self, ino: _Inotify, events: list[tuple[str, int]]) -> bool:
        """Handle one batch of inotify events in the watch thread: when it leaves the file
        whole, read a snapshot and hand it over, unless an event of the file arrived between
        the batch and the end of that read (then those events decide, in turn). True when a
        snapshot was handed over (or the agent should look itself: the file went away, or an
        event that is neither a write nor a close changed it); False when there is nothing to
        take now (not the file's events; the file as it was taken; or it is being written:
        its close will tell)."""
        with self._lock:
            writing = self._writing
        state = self._fold(events, False, writing)
        if state is None:
            return False  # other files in the directory
        whole, writing = state
        while whole:
            self.before_snapshot()
            try:
                snap = self._snapshot_now()
            except SourceError:  # gone (a rename away): the agent reports it
                snap = None
            after = self._late_events(ino)
            if after is None:
                with self._lock:
                    self._writing = False
                    # the file as taken (a ConfigMap's new `..v2` directory, a close without
                    # a write) is nothing to take: no wake-up
                    fresh = snap is not None and snap.sig != self._loaded
                    if fresh:
                        self._snapshot = snap
                return fresh or (snap is None and self.changed())
            whole, writing = after  # the file changed after the batch: the snapshot is void
        with self._lock:
            self._writing = writing
        return not writing and self.changed()

    def _late_events(self, ino: _Inotify) -> tuple[bool, bool] | None:
        """(whole, writing) after the file's events that arrive within SNAPSHOT_SETTLE of the
        snapshot's read (from whole), or None when none does."""
        deadline = time.monotonic() + SNAPSHOT_SETTLE
        while True:
            left = deadline - time.monotonic()
            more = ino.names(max(0.0, left))
            if more is None:
                return None
            after = self._fold(more, True, False)
            if after is not None:
                return after
            if left <= 0:
                return None

    def stop(self) -> None:
        self._stop.set()

    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    def _is_whole(self) -> bool:
        """May the changed file be read now by the agent itself (see the module): its
        signature has not changed for half a poll interval, or for WRITER_GRACE while inotify
        saw it modified and not yet closed (the watch thread wakes the agent again a poll
        interval later while the file differs from what was taken)."""
        sig = self._signature()
        now = self.clock()
        with self._lock:
            if sig is None:
                return True  # gone: the read says so
            if sig != self._seen[0]:
                self._seen = (sig, now)
                return False
            quiet = max(self.poll_interval / 2, WRITER_GRACE if self._writing else 0.0)
            return now - self._seen[1] >= quiet

    def take(self) -> ChangeSet | None:
        """The whole file as a ChangeSet when it changed and is whole (see the module): the
        watch thread's snapshot, or else the file read now once it has stayed the same long
        enough; an empty one when not, when it cannot be read now (reported once per problem:
        the programmed state stays), or when it would remove most Services and no second read
        has confirmed that yet; None until it has been read once (the first read does not
        wait)."""
        nothing = ChangeSet() if self._ever_read else None
        with self._lock:
            snap, self._snapshot = self._snapshot, None
            if snap is not None and snap.sig == self._loaded and self._held is None:
                snap = None  # closed without a change
        if snap is None:
            if not self.changed():
                self._held = None  # back to what was taken: a removal held is void
                return nothing
            if self._ever_read and not self._is_whole():
                log.debug("%s is changing; reading it once it is whole", self.path)
                return nothing
        t0 = time.monotonic()
        try:
            if snap is None:
                snap = self._snapshot_now()
                if snap is None:
                    log.debug("%s changed while it was read; reading it again", self.path)
                    return nothing
            if self._ever_read:
                log.info("%s changed, reading it", self.path)
            with gc_paused():
                objects = self._objects(self._decode(snap.data))
        except SourceError as e:
            if snap is not None:  # parsed, or failed to: not again until it is rewritten
                with self._lock:
                    self._loaded = snap.sig
            if str(e) != self._last_error:
                log.error("%s", e)
                self._last_error = str(e)
            return nothing
        if self._ever_read and self._removes_most(objects, snap):
            return ChangeSet()
        with self._lock:
            self._loaded = snap.sig
        self._held = None
        self._services = set(objects.services)
        log.info(
            "read %s: %d Services, %d EndpointSlices in %.2fs",
            self.path,
            len(objects.services),
            sum(len(s) for s in objects.slices.values()),
            time.monotonic() - t0,
        )
        self._last_error = None
        self._ever_read = True
        changes = ChangeSet(whole=objects)
        changes.touch()
        return changes

    def _removes_most(self, objects: ObjectSet, snap: Snapshot) -> bool:
        """Whether `objects` would remove more than MOST of the Services taken last and no
        second read confirmed it yet (see the module): the first such read is held (the watch
        thread keeps waking the agent while the file differs from what was taken), a read of
        the same bytes CONFIRM_AFTER later or more, with no writer holding the file, confirms
        it."""
        removed = len(self._services.difference(objects.services))
        if removed <= MOST * len(self._services):
            return False
        digest = hashlib.blake2b(snap.data, digest_size=16).digest()
        now = self.clock()
        held = self._held
        if held is None or held.digest != digest:
            self._held = _Held(digest, now)
            log.warning(
                "%s would remove %d of the %d Services; taking it once a second read, %.0fs "
                "from now or later and with no writer holding the file, finds the same (a "
                "writer that truncated it may not be done)",
                self.path,
                removed,
                len(self._services),
                CONFIRM_AFTER,
            )
            return True
        with self._lock:
            writing = self._writing
        if writing or now - held.at < CONFIRM_AFTER:
            log.debug(
                "%s: the removal of %d Services waits for its confirmation", self.path, removed
            )
            return True
        log.info(
            "%s: a second read %.0fs later finds the same; removing %d of the %d Services",
            self.path,
            now - held.at,
            removed,
            len(self._services),
        )
        return False

    def _parse(self, text: str) -> list[dict[str, Any]]:
        return self._with_loaders(functools.partial(self._document_list, text))

    def _raw(self, text: str, loader: Any) -> Iterator[tuple[Any, int]]:
        """(document, its first line from 0) with `loader`: FAST or a PyYAML loader class."""
        if loader is FAST:
            yield from fastyaml.documents(text)
            return
        yaml_loader = loader(text)
        try:
            while yaml_loader.check_node():
                node = yaml_loader.get_node()
                if node is None:
                    break
                yield yaml_loader.construct_document(node), node.start_mark.line
        finally:
            yaml_loader.dispose()

    def _documents(self, text: str, loader: Any) -> Iterator[dict[str, Any]]:
        """The objects of `text`, one document at a time; SourceError on the first error
        (fastyaml.Unsupported passes through: the caller tries the next loader)."""
        for obj, _line in self._documents_at(text, loader):
            yield obj

    def _documents_at(self, text: str, loader: Any) -> Iterator[tuple[dict[str, Any], int]]:
        """_documents, each object with the line (from 0) where its document starts."""
        try:
            for number, (doc, line) in enumerate(self._raw(text, loader), start=1):
                where = f"document {number} (line {line + 1})"
                if doc is None:
                    continue
                if not isinstance(doc, Mapping):
                    raise SourceError(
                        f"{self.path}: {where} is {_what(doc)}, not a Kubernetes object; "
                        f"fix its indentation or remove it; {_KEEP}"
                    )
                if doc.get("kind") == "List":
                    items = doc.get("items")
                    if items is None:
                        continue
                    if not isinstance(items, list):
                        raise SourceError(
                            f"{self.path}: {where}: items of a List must be a list but is "
                            f"{_what(items)}; fix the file; {_KEEP}"
                        )
                    for i, item in enumerate(items):
                        if item is None:
                            continue
                        if not isinstance(item, Mapping):
                            raise SourceError(
                                f"{self.path}: {where}: items[{i}] is {_what(item)}, not a "
                                f"Kubernetes object; fix or remove it; {_KEEP}"
                            )
                        yield dict(item), line
                else:
                    yield dict(doc), line
        except yaml.MarkedYAMLError as e:
            raise SourceError(self._yaml_message(e)) from None
        except yaml.reader.ReaderError as e:
            raise SourceError(self._reader_message(text, e)) from None
        except yaml.YAMLError as e:
            raise SourceError(f"{self.path}: {e}; {_KEEP}") from None

    def _reader_message(self, text: str, e: yaml.reader.ReaderError) -> str:
        char = f"#x{e.character:04x}" if isinstance(e.character, int) else repr(e.character)
        return (
            f"{self.path}: {_position(text, e.position)}: character {char} is not allowed in "
            f"YAML; remove it; {_KEEP}"
        )

    def _yaml_message(self, e: yaml.MarkedYAMLError) -> str:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = e.problem or e.context or "invalid YAML"
        if e.problem and e.context:
            what += f" ({e.context}"
            if e.context_mark:
                what += f" that starts at line {e.context_mark.line + 1}"
            what += ")"
        return f"{self.path}: {where}{what}; {_KEEP}"
