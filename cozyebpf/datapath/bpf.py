"""The real datapath: pinned maps + the XDP ingress and TC egress programs on the devices."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from cozyebpf.datapath import attach, loader
from cozyebpf.datapath.maps import DEFAULT_PIN_DIR, PinnedMaps
from cozyebpf.dump import build_dump
from cozyebpf.errors import DatapathError
from cozyebpf.state import MapDiff, MapState

log = logging.getLogger(__name__)


class BpfDatapath:
    """Implements the Datapath protocol on the kernel. `start()` creates or adopts the pinned
    maps, loads both programs and attaches them to every device; `close()` releases our file
    descriptors only: links and maps stay pinned, so forwarding goes on (fail-static) until
    `cozyebpf detach`."""

    def __init__(
        self,
        devices: Sequence[str],
        pin_dir: str = DEFAULT_PIN_DIR,
        xdp_mode: str = "native",
        tc_mode: str = "auto",
    ) -> None:
        if not devices:
            raise DatapathError("no devices given: name the uplink devices with --devices")
        self.devices = list(devices)
        self.pin_dir = pin_dir
        self.xdp_mode = xdp_mode
        self.tc_mode = tc_mode
        self.maps: PinnedMaps | None = None
        self.programs: list[loader.Program] = []
        self.attachments: list[attach.Attachment] = []

    def start(self) -> None:
        for dev in self.devices:
            attach.ifindex_of(dev)  # fail on a typo before touching anything
        self.maps = PinnedMaps.ensure(self.pin_dir)
        ingress = loader.load("ingress.c", "cz_ingress", "xdp", self.pin_dir)
        egress = loader.load("egress.c", "cz_egress", "sched_cls", self.pin_dir)
        self.programs = [ingress, egress]
        for dev in self.devices:
            self.attachments.append(attach.attach_xdp(ingress.fd, dev, self.pin_dir, self.xdp_mode))
            self.attachments.append(
                attach.attach_tc_egress(egress.fd, dev, self.pin_dir, self.tc_mode)
            )

    def _maps(self) -> PinnedMaps:
        if self.maps is None:
            raise DatapathError("datapath not started")
        return self.maps

    def read_state(self) -> MapState:
        return self._maps().read_state()

    def apply(self, diff: MapDiff) -> None:
        self._maps().apply(diff)

    def dump(self) -> dict[str, Any]:
        m = self._maps()
        return build_dump(
            m.read_state(),
            m.flows_by_pod(),
            m.counters(),
            [a.as_dict() for a in attach.list_attachments(self.pin_dir)],
            self.pin_dir,
        )

    def close(self) -> None:
        if self.maps:
            self.maps.close()
            self.maps = None
        self.programs = []  # drops bcc's modules; the pinned links keep the programs


def dump_pinned(pin_dir: str = DEFAULT_PIN_DIR) -> dict[str, Any]:
    """`maps dump` from another process: read the pins, no compilation."""
    with PinnedMaps.open(pin_dir) as m:
        return build_dump(
            m.read_state(),
            m.flows_by_pod(),
            m.counters(),
            [a.as_dict() for a in attach.list_attachments(pin_dir)],
            pin_dir,
        )
