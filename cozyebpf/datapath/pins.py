"""The pins: every map of the registry under one bpffs directory, created with a checked layout,
opened from another process, migrated when a pin has another layout; and `Pins`, their file
descriptors with the bulk reads and writes the rest of the datapath uses. A flock on the
directory says that a monitor reads its events (one at a time)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from cozyebpf import __version__
from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.layout import (
    ALL_MAPS,
    LAYOUT_VERSION,
    META,
    OLDEST_COMPATIBLE,
    SAME_SINCE,
    Layout,
    MapSpec,
    MetaVal,
    map_specs,
    possible_cpus,
)
from cozyebpf.datapath.slots import ServiceSlots
from cozyebpf.errors import DatapathError

log = logging.getLogger(__name__)

DEFAULT_PIN_DIR = "/sys/fs/bpf/cozyebpf"


class MonitorBusy(DatapathError):
    """Another monitor holds the events."""


def lock_pin_dir(pin_dir: str, wait: float = 0.0) -> int:
    """An fd holding an exclusive flock on `pin_dir`, or MonitorBusy. A monitor holds it while
    it runs; the agent takes it for an instant to see whether a monitor is alive."""
    fd = os.open(pin_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
            if time.monotonic() >= deadline:
                os.close(fd)
                raise MonitorBusy(
                    f"another `cozyebpf monitor` is reading the events of {pin_dir} (one at a "
                    "time); stop it first"
                ) from None
            time.sleep(0.05)


def monitor_running(pin_dir: str) -> bool:
    """Is a monitor holding the events (its lock) right now?"""
    try:
        fd = lock_pin_dir(pin_dir)
    except MonitorBusy:
        return True
    except OSError:
        return False
    os.close(fd)
    return False


def release_parts(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a release "X.Y.Z" (a suffix such as "rc1" is left out);
    (0, 0, 0) for anything else."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        return (0, 0, 0)
    major, minor, patch = (min(int(x), 0xFFFF) for x in m.groups())
    return (major, minor, patch)


def meta_value(release: str = __version__) -> MetaVal:
    """What this agent records in meta: its layout, the oldest that can run on it, itself."""
    major, minor, patch = release_parts(release)
    return MetaVal(
        layout_version=LAYOUT_VERSION,
        oldest_compatible=OLDEST_COMPATIBLE,
        release_major=major,
        release_minor=minor,
        release_patch=patch,
    )


@dataclass(frozen=True)
class PinnedLayout:
    """What `meta` says of the maps pinned beside it."""

    version: int  # their layout
    oldest: int  # the oldest layout that can run on them (0: not recorded, only `version`)
    release: str  # the cozyebpf release that wrote them ("": not recorded, before 0.2.0)

    @property
    def writer(self) -> str:
        if self.release:
            return f"cozyebpf {self.release}"
        return "a cozyebpf release before 0.2.0 (which did not record itself)"

    @property
    def needs(self) -> int:
        """The oldest layout that can run on them."""
        return self.oldest or self.version

    def runnable(self, layout: int = LAYOUT_VERSION) -> bool:
        """Can an agent of `layout` run on these maps? Older ones it upgrades; newer ones
        only when they say so (an additive change)."""
        return self.version <= layout or self.needs <= layout

    def as_dict(self) -> dict[str, object]:
        return {"layout_version": self.version, "oldest": self.needs, "written_by": self.release}


def read_meta(fd: int) -> PinnedLayout | None:
    val = MetaVal()
    if not bpfsys.map_lookup(fd, ctypes.c_uint32(0), val):
        return None
    parts = (val.release_major, val.release_minor, val.release_patch)
    release = ".".join(map(str, parts)) if any(parts) else ""
    return PinnedLayout(int(val.layout_version), int(val.oldest_compatible), release)


def read_version(fd: int) -> int | None:
    found = read_meta(fd)
    return None if found is None else found.version


def read_pinned_meta(pin_dir: str) -> PinnedLayout | None:
    """What the meta pinned in `pin_dir` says; None without a meta of ours there."""
    path = os.path.join(pin_dir, META.name)
    try:
        fd = bpfsys.obj_get(path)
    except bpfsys.BpfError as e:
        if e.errno == errno.ENOENT:
            return None
        raise DatapathError(f"cannot open {path}: {e}") from e
    try:
        info = bpfsys.map_info(fd)
        if _kind_problem(META, info) or _size_problem(META, info):
            return None
        return read_meta(fd)
    finally:
        os.close(fd)


class LayoutTooNew(DatapathError):
    """The maps were written by a newer release, with a layout this one cannot run on. The
    agent changes nothing (fail-static) and exits."""

    def __init__(self, pin_dir: str, found: PinnedLayout, why: str = "", reader: bool = False):
        self.pin_dir = pin_dir
        self.found = found
        need = f"layout {found.needs} or newer" + (f" ({why})" if why else "")
        head = (
            f"the maps in {pin_dir} have layout {found.version}, written by {found.writer}, "
            f"and need {need}; this cozyebpf {__version__} has layout {LAYOUT_VERSION}"
        )
        if reader:
            msg = f"{head} and cannot read them: use the `cozyebpf` of {found.writer}"
        else:
            msg = (
                f"{head}. Nothing was changed: the maps and the programs attached stay as "
                f"they are and traffic goes on as {found.writer} left it (fail-static). Run "
                f"{found.writer} (or newer) on this node; to start over with this version "
                f"instead, with empty maps (every flow lost), run `cozyebpf detach --pin-dir "
                f"{pin_dir}` first"
            )
        super().__init__(msg)


def refuse_too_new(pin_dir: str, layout: Layout, found: PinnedLayout | None) -> None:
    """Raise LayoutTooNew, before anything in `pin_dir` is changed, unless this agent can run
    on the maps there: a newer layout must name ours compatible (an additive change), and every
    map of ours that it holds must have our key and value."""
    if found is None or found.version <= LAYOUT_VERSION:
        return
    if not found.runnable():
        raise LayoutTooNew(pin_dir, found)
    for spec in layout.all:
        try:
            fd = bpfsys.obj_get(os.path.join(pin_dir, spec.name))
        except bpfsys.BpfError:
            continue  # created (a map newer layouts dropped) or reported when opened
        try:
            problem = _kind_problem(spec, bpfsys.map_info(fd))
        finally:
            os.close(fd)
        if problem:
            raise LayoutTooNew(
                pin_dir,
                found,
                f"it says layout {found.needs} can, yet its {spec.name} has {problem}",
            )


def _kind_problem(spec: MapSpec, info: bpfsys.MapInfo) -> str | None:
    """What differs in type, key or value size (the layout proper, not the size)."""
    want = (spec.map_type, spec.key_size, spec.value_size)
    have = (info.type, info.key_size, info.value_size)
    names = ("type", "key size", "value size")
    diffs = [f"{n} {h} (want {w})" for n, h, w in zip(names, have, want, strict=True) if h != w]
    return ", ".join(diffs) or None


def _size_problem(spec: MapSpec, info: bpfsys.MapInfo) -> str | None:
    if info.max_entries == spec.max_entries:
        return None
    return f"max entries {info.max_entries} (want {spec.max_entries})"


def _check_bpffs(pin_dir: str) -> None:
    """The pin directory, or where it will be made, must be on a bpf filesystem: pins cannot
    live anywhere else, and nothing is created or changed (no mkdir, no chmod) elsewhere."""
    existing = os.path.abspath(pin_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not bpfsys.on_bpffs(existing):
        raise DatapathError(
            f"--pin-dir {pin_dir} is not on a bpf filesystem ({existing} is not); give a "
            f"directory under a bpffs mount such as {DEFAULT_PIN_DIR} (mount -t bpf bpf "
            "/sys/fs/bpf)"
        )


@contextlib.contextmanager
def closed_on_error(fds: dict[str, int], pin_dir: str = "") -> Iterator[None]:
    """Close `fds` if the block fails; with `pin_dir`, a failed bpf(2) call becomes a
    DatapathError about preparing the maps there."""
    try:
        yield
    except BaseException as e:
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        if pin_dir and isinstance(e, bpfsys.BpfError):
            hint = " (cozyebpf needs CAP_SYS_ADMIN)" if e.errno == errno.EPERM else ""
            raise DatapathError(f"preparing the maps in {pin_dir} failed: {e}{hint}") from e
        raise


def open_pins(pin_dir: str) -> tuple[dict[str, int], Layout]:
    """Open existing pins (for `maps dump`), whatever their size; every map must be there with
    our layout and version, but that the maps of a layout this one can run on and read (from
    OLDEST_COMPATIBLE on: an older release still running on the node) may lack the maps added
    after it, and those added to its layout after a release of it (MapSpec.late), which only
    the agent writes (those are then not in the fds). Their fds, and the layout their sizes
    say."""
    found = read_pinned_meta(pin_dir)
    if found is not None and not found.runnable():
        raise LayoutTooNew(pin_dir, found, reader=True)
    version = found.version if found is not None else LAYOUT_VERSION
    fds: dict[str, int] = {}
    with closed_on_error(fds):
        for spec in map_specs().all:
            path = os.path.join(pin_dir, spec.name)
            try:
                fds[spec.name] = fd = bpfsys.obj_get(path)
            except bpfsys.BpfError as e:
                # newer than the maps' layout, or added to it after a release of it (late):
                # nothing of theirs is in it
                if (
                    e.errno == errno.ENOENT
                    and version >= OLDEST_COMPATIBLE
                    and (version < SAME_SINCE[spec.name] or spec.late)
                ):
                    continue
                if e.errno == errno.ENOENT:
                    raise DatapathError(
                        f"no cozyebpf map pinned at {path}: is `cozyebpf run` running on this "
                        f"node (and is --pin-dir the same)? (maps of an older cozyebpf are "
                        f"upgraded by `cozyebpf run` of this version)"
                    ) from None
                raise DatapathError(f"cannot open {path}: {e}") from e
            problem = _kind_problem(spec, bpfsys.map_info(fd))
            if problem:
                raise DatapathError(
                    f"pinned map {path} has another layout ({problem}): it was made by another "
                    f"cozyebpf version; this one cannot read it. `cozyebpf run` of this version "
                    f"migrates it"
                )
        found = read_meta(fds[META.name])
        if found is None:
            raise DatapathError(f"{pin_dir}/meta holds no layout version")
        if found.version < OLDEST_COMPATIBLE:
            raise DatapathError(
                f"maps in {pin_dir} have layout version {found.version}, this cozyebpf uses "
                f"{LAYOUT_VERSION}; `cozyebpf run` of this version migrates them"
            )
        services = bpfsys.map_info(fds["addr4"]).max_entries // 2
        slots = bpfsys.map_info(fds["svcstats"]).max_entries - 1
    return fds, map_specs(max(1, services), max(1, slots))


@dataclass
class Ensured:
    """What `ensure_pins` found and did."""

    fds: dict[str, int] = field(default_factory=dict)
    version: int | None = None  # the pins' layout version (None: none of ours)
    found: PinnedLayout | None = None  # what their meta said
    created: list[str] = field(default_factory=list)
    #: flow maps replaced by a resize, still open: their flows are copied again once the old
    #: programs are gone (`FlowTables.seed_flow_hints`)
    old_flows: list[tuple[MapSpec, int]] = field(default_factory=list)
    reseed: bool = False  # the flow hint or the flow maps are new: seed the hints


# (longer than 80 lines: one pass over the maps deciding keep / create / copy / rebuild per
# map, the contract of docs/design.md in one place)
def ensure_pins(pin_dir: str, layout: Layout) -> Ensured:
    """Open the pins of `layout`, creating (and pinning, mode 0600 in a 0700 dir) any that are
    missing. Maps of a newer layout are run on as they are when it says that ours can (an
    additive change); otherwise LayoutTooNew is raised before anything is changed
    (`refuse_too_new`). A pin with another layout is never reused as it is: a map whose type,
    key and value sizes are unchanged since its layout version (SAME_SINCE) and whose only
    change is its size is migrated, its entries copied, and so is one whose values only grew at
    their end (MapSpec.padded_since), zero-padded; any other map is rebuilt empty (the
    controller refills services, pods and ports; flows and counters start over). The flow maps
    go first: their entries are what nothing else can give back. Each migration is logged. The
    layout version in meta is left as it was (the caller writes it last)."""
    _check_bpffs(pin_dir)
    found = read_pinned_meta(pin_dir) if os.path.isdir(pin_dir) else None
    refuse_too_new(pin_dir, layout, found)
    os.makedirs(pin_dir, mode=0o700, exist_ok=True)
    os.chmod(pin_dir, 0o700)
    out = Ensured(found=found)
    fds = out.fds
    with closed_on_error(fds, pin_dir):
        meta_path = os.path.join(pin_dir, META.name)
        try:
            fds[META.name] = bpfsys.obj_get(meta_path)
        except bpfsys.BpfError as e:
            if e.errno != errno.ENOENT:
                raise DatapathError(f"cannot open {meta_path}: {e}") from e
            fds[META.name] = _create(META, meta_path)
            out.created.append(META.name)
        else:
            info = bpfsys.map_info(fds[META.name])
            problem = _kind_problem(META, info) or _size_problem(META, info)
            if problem:  # not a meta of ours: nothing is proven, a new one
                fds[META.name] = _migrate(META, fds[META.name], info, meta_path, problem, False)
            else:
                out.version = read_version(fds[META.name])
        version = out.version
        if version is not None and version > LAYOUT_VERSION:
            # a newer release's, which says that this layout can run on them (else
            # refuse_too_new raised): every map of ours is as ours
            assert found is not None
            log.warning(
                "maps in %s have layout %d, written by %s, newer than this cozyebpf's %d; "
                "layout %d or newer can run on them: every map of this layout is kept as it "
                "is (flows included); maps only layout %d has stay pinned, unused",
                pin_dir,
                version,
                found.writer,
                LAYOUT_VERSION,
                found.needs,
                version,
            )
            version = LAYOUT_VERSION
        for spec in sorted(layout.all, key=lambda m: m.name not in FLOW_MAPS):
            if spec.name == META.name:
                continue
            path = os.path.join(pin_dir, spec.name)
            try:
                fd = bpfsys.obj_get(path)
            except bpfsys.BpfError as e:
                if e.errno != errno.ENOENT:
                    raise DatapathError(f"cannot open {path}: {e}") from e
                fds[spec.name] = _create(spec, path)
                out.created.append(spec.name)
                out.reseed = out.reseed or spec.name == "flowhint"
                continue
            info = bpfsys.map_info(fd)
            proven = version is not None and version >= SAME_SINCE[spec.name]
            kind_problem = _kind_problem(spec, info)
            size_problem = _size_problem(spec, info)
            if proven and not kind_problem and not size_problem:
                fds[spec.name] = fd
                continue
            why = kind_problem or size_problem or f"layout version {version}"
            if not proven and not kind_problem:
                why = f"layout version {version} (want {LAYOUT_VERSION})"
            padded = _padded(spec, info, version)
            if padded:
                why += ", values zero-padded"
            # the hints' bits depend on their size: rebuilt, then seeded from the flows (the
            # address hint from addr4, at every start); prog arrays are filled by the loader
            copy = ((proven and not kind_problem) or padded) and spec.name not in HINT_MAPS
            copy = copy and spec.map_type != bpfsys.BPF_MAP_TYPE_PROG_ARRAY
            keep_old = copy and spec.name in FLOW_MAPS
            fds[spec.name] = _migrate(spec, fd, info, path, why, copy, keep_old)
            if keep_old:
                out.old_flows.append((spec, fd))
            out.reseed = out.reseed or spec.name in ("flowhint", *FLOW_MAPS)
    return out


FLOW_MAPS = ("flow4", "flow6")
HINT_MAPS = ("flowhint", "addrhint", "rolehint")


def _padded(spec: MapSpec, info: bpfsys.MapInfo, version: int | None) -> bool:
    """Is the pin `info`, of layout `version`, one whose values are a prefix of ours?"""
    return (
        bool(spec.padded_since)
        and version is not None
        and version >= spec.padded_since
        and (info.type, info.key_size) == (spec.map_type, spec.key_size)
        and info.value_size < spec.value_size
    )


def _new_map(spec: MapSpec) -> int:
    return bpfsys.map_create(
        spec.map_type,
        spec.key_size,
        spec.value_size,
        spec.max_entries,
        f"cz_{spec.name}",
        spec.flags,
    )


def _create(spec: MapSpec, path: str) -> int:
    fd = _new_map(spec)
    bpfsys.obj_pin(fd, path)
    os.chmod(path, 0o600)
    return fd


def _migrate(
    spec: MapSpec,
    old_fd: int,
    info: bpfsys.MapInfo,
    path: str,
    why: str,
    copy: bool,
    keep_old: bool = False,
) -> int:
    """Replace the pin at `path` by a map with our layout, copying entries if `copy`. The old
    map's fd is closed unless `keep_old`."""
    ringbuf = info.type == bpfsys.BPF_MAP_TYPE_RINGBUF  # no keys
    keys = [] if ringbuf else bpfsys.map_keys(old_fd, info.key_size)
    new_fd = _new_map(spec)
    copied = copy_entries(spec, old_fd, new_fd, keys, info.value_size) if copy else 0
    if info.type == bpfsys.BPF_MAP_TYPE_PROG_ARRAY:
        retire(path, info.id)  # its programs stay in it while the old entries run
    else:
        os.unlink(path)
    if not keep_old:
        os.close(old_fd)
    bpfsys.obj_pin(new_fd, path)
    os.chmod(path, 0o600)
    if copy:
        log.warning("migrated map %s (%s): %d of %d entries copied", path, why, copied, len(keys))
    else:
        log.warning(
            "rebuilt map %s (%s): %d old entries dropped%s",
            path,
            why,
            len(keys),
            "; until the first sync packets to its addresses pass untranslated"
            if spec.name in ("addr4", "addr6")
            else " (counters start again from zero)"
            if spec.name == "svcstats"
            else "",
        )
    return new_fd


#: <pin dir>/retired/<name>-<map id>: prog arrays replaced by a migration, kept pinned until the
#: new programs are attached (`retire`, `drop_retired`)
RETIRED = "retired"
_RETIRED_NAME = re.compile(r"^(\w+)-(\d+)$")


def retire(path: str, map_id: int) -> str:
    """Move the pin of a prog array that a migration replaces to <pin dir>/retired/<name>-<id>.
    A prog array empties itself when the last pin or file descriptor of it goes (the kernel
    clears it as its last user reference is dropped), and the entry programs still attached
    tail-call through it until the new ones replace them: unpinned there, every frame they
    hand to a full or rare path would miss its tail call and be dropped (ARP included), for
    the whole compile window. `drop_retired` removes it once the new programs are attached."""
    pin_dir, name = os.path.split(path)
    where = os.path.join(pin_dir, RETIRED)
    os.makedirs(where, mode=0o700, exist_ok=True)
    dest = os.path.join(where, f"{name}-{map_id}")
    os.rename(path, dest)
    log.info(
        "kept the replaced prog array %s pinned at %s until the new programs are attached: "
        "the programs attached now still hand frames on through it",
        path,
        dest,
    )
    return dest


def drop_retired(pin_dir: str) -> list[str]:
    """Unpin the prog arrays `retire` kept (the programs that used them are detached): what was
    removed. Only names of ours (<prog array>-<id>) are unlinked."""
    arrays = {m.name for m in ALL_MAPS if m.map_type == bpfsys.BPF_MAP_TYPE_PROG_ARRAY}
    where = os.path.join(pin_dir, RETIRED)
    removed: list[str] = []
    if not os.path.isdir(where):
        return removed
    for name in sorted(os.listdir(where)):
        m = _RETIRED_NAME.match(name)
        if m and m.group(1) in arrays:
            os.unlink(os.path.join(where, name))
            removed.append(os.path.join(where, name))
    with contextlib.suppress(OSError):  # not empty: something that is not ours
        os.rmdir(where)
    if removed:
        log.info("unpinned the replaced prog arrays: %s", ", ".join(removed))
    return removed


def copy_entries(
    spec: MapSpec, old_fd: int, new_fd: int, keys: list[bytes], old_value_size: int = 0
) -> int:
    """Copy the entries of `keys` (those still there) from one map of `spec`'s layout, or of
    values of `old_value_size` that ours extend (zero-padded), to another; those that do not
    fit are left out. How many were copied."""
    old_size = old_value_size or spec.value_size
    per_cpu = spec.map_type == bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY
    cpus = possible_cpus() if per_cpu else 1
    old_stride = (old_size + 7) // 8 * 8 if per_cpu else old_size
    new_stride = (spec.value_size + 7) // 8 * 8 if per_cpu else spec.value_size
    copied = 0
    for raw in keys:
        key = ctypes.create_string_buffer(raw, len(raw))
        val = ctypes.create_string_buffer(max(old_stride, new_stride) * cpus)
        if not bpfsys.map_lookup(old_fd, key, val):
            continue
        if per_cpu and old_stride != new_stride:
            out = ctypes.create_string_buffer(new_stride * cpus)
            for cpu in range(cpus):
                at = cpu * old_stride
                ctypes.memmove(
                    ctypes.byref(out, cpu * new_stride), val.raw[at : at + old_size], old_size
                )
            val = out
        try:
            bpfsys.map_update(new_fd, key, val)
            copied += 1
        except bpfsys.BpfError as e:
            if e.errno not in (errno.E2BIG, errno.ENOSPC):
                raise
    return copied


class Pins:
    """File descriptors of every map under one pin directory, the Services' counter slots, and
    bulk reads and writes (batched where the kernel has batch operations)."""

    def __init__(self, pin_dir: str, fds: dict[str, int], layout: Layout) -> None:
        self.pin_dir = pin_dir
        self.fds = fds
        self.layout = layout
        self.slots = ServiceSlots(
            fds[layout.svcnames.name],
            fds[layout.svcstats.name],
            layout.slots,
            possible_cpus(),
            # (maps an older agent's pins lack until an agent of ours ensures them)
            tuple(
                (fds[m.name], m.value_size)
                for m in (layout.limits, layout.buckets)
                if m.name in fds
            ),
        )
        self._no_batch = False  # set when the kernel refuses batch operations
        self._old_flows: list[tuple[MapSpec, int]] = []  # flow maps replaced by a resize
        #: the flow hints must be seeded again once the new egress program runs (the maps
        #: were upgraded or resized while older programs were recording flows)
        self.hints_need_seed = False

    @property
    def max_services(self) -> int:
        return self.layout.max_services

    def close(self) -> None:
        for fd in [*self.fds.values(), *(f for _, f in self._old_flows)]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = {}
        self._old_flows = []

    def _items(self, spec: MapSpec) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) pairs of a hash map: BPF_MAP_LOOKUP_BATCH (about 17x faster than a key
        walk, bench/), or the walk on kernels without batch operations."""
        fd, key_size, value_size = self.fds[spec.name], spec.key_size, spec.value_size
        if not self._no_batch:
            try:
                yield from bpfsys.map_items_batch(fd, key_size, value_size)
                return
            except bpfsys.BpfError as e:
                if e.errno not in bpfsys.BATCH_UNSUPPORTED:
                    raise
                self._no_batch = True
        for raw in bpfsys.map_keys(fd, key_size):
            val = ctypes.create_string_buffer(value_size)
            if bpfsys.map_lookup(fd, ctypes.create_string_buffer(raw, key_size), val):
                yield raw, val.raw  # gone meanwhile: skipped

    def _keys(self, spec: MapSpec) -> list[bytes]:
        return bpfsys.map_keys(self.fds[spec.name], spec.key_size)

    def _lookup(self, spec: MapSpec, key: bytes) -> bytes | None:
        """The value of `key`, by one lookup."""
        val = ctypes.create_string_buffer(spec.value_size)
        k = ctypes.create_string_buffer(key, len(key))
        found = bpfsys.map_lookup(self.fds[spec.name], k, val)
        return val.raw if found else None

    def percpu(self, spec: MapSpec, key: int) -> list[bytes] | None:
        """The value of `key` in a per-CPU array, one bytes per possible CPU."""
        ncpu = possible_cpus()
        stride = (spec.value_size + 7) // 8 * 8
        buf = ctypes.create_string_buffer(stride * ncpu)
        if not bpfsys.map_lookup(self.fds[spec.name], ctypes.c_uint32(key), buf):
            return None
        raw = buf.raw
        return [raw[c * stride : c * stride + spec.value_size] for c in range(ncpu)]

    def _read_slots(self) -> None:
        self.slots.load(self._items(self.layout.svcnames))

    def _update_batch(self, spec: MapSpec, keys: list[bytes], values: list[bytes]) -> None:
        fd = self.fds[spec.name]
        if not keys:
            return
        if not self._no_batch:
            try:
                bpfsys.map_update_batch(fd, b"".join(keys), b"".join(values), len(keys))
                return
            except bpfsys.BpfError as e:
                if e.errno not in bpfsys.BATCH_UNSUPPORTED:
                    raise
                self._no_batch = True
                log.info("this kernel has no batch map operations: one call per entry")
        for k, v in zip(keys, values, strict=True):
            bpfsys.map_update(
                fd, ctypes.create_string_buffer(k, len(k)), ctypes.create_string_buffer(v, len(v))
            )

    def _delete_batch(self, spec: MapSpec, keys: list[bytes]) -> None:
        fd = self.fds[spec.name]
        if not keys:
            return
        if not self._no_batch:
            try:
                bpfsys.map_delete_batch(fd, b"".join(keys), spec.key_size)
                return
            except bpfsys.BpfError as e:
                if e.errno not in bpfsys.BATCH_UNSUPPORTED:
                    raise
                self._no_batch = True
        for k in keys:
            bpfsys.map_delete(fd, ctypes.create_string_buffer(k, len(k)))
