"""Section 8: an agent restarts (SIGTERM, then a new one) while datagrams flow to VMs on its
node and on the others; not one may be lost."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

from cozylab.cluster.rows import Case, Check, Group
from cozylab.cluster.spec import node_name
from cozylab.netns import wait_for
from cozylab.traffic import UdpStream

if TYPE_CHECKING:
    from cozylab.cluster.lab import ClusterLab

SCENARIO = "8 agent restart"
RESTART_NODE = 2
RESTART_STREAMS = ("vm-a", "vm-b", "vm-e")  # one or more VMs per node, node2's included


class Restart:
    """node `RESTART_NODE`'s agent restarts under one stream per VM of `RESTART_STREAMS`;
    a row per stream. `at`: where the VMs are when its turn comes (the plan)."""

    def __init__(self, lab: ClusterLab, at: dict[str, int]) -> None:
        self.lab = lab
        self.at = dict(at)
        self.err = "not run; "
        self.streams = {
            name: UdpStream(lab.lab, lab.client, (lab.workloads[name].lb_ip or "", 53), drain=1.0)
            for name in RESTART_STREAMS
        }

    def group(self) -> Group:
        n = RESTART_NODE
        cases = []
        for name in RESTART_STREAMS:
            where = "the restarted node" if self.at[name] == n else "another node"
            case = f"{node_name(n)} restarts: udp 100 pkt/s to {self.lab.where(name, self.at)}"
            cases.append(Case(SCENARIO, f"{case} ({where})", partial(self._row, name)))
        return Group(cases, around=self.running)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self.run()
        yield

    def run(self) -> None:
        lab, n = self.lab, RESTART_NODE
        for u in self.streams.values():
            u.start()
        self.err = ""
        try:
            wait_for(lambda: all(len(u.got) > 20 for u in self.streams.values()), 5, "the streams")
            rc = lab.agents.stop(n)
            lab.agents.start(n)
            lab.wait_programmed()
            lab.sync_agents()
            t_ready = time.monotonic()
            wait_for(
                lambda: all(
                    any(ts > t_ready for ts in u.got.values()) for u in self.streams.values()
                ),
                5,
                "the streams after the restart",
            )
            if rc not in (0, None):
                self.err = f"the agent exited with {rc}; "
        except (TimeoutError, RuntimeError) as e:
            self.err = f"{e}; "
        finally:
            for u in self.streams.values():
                u.stop()

    def _row(self, name: str) -> Check:
        u = self.streams[name]
        return not self.err and not u.lost(), self.err + u.summary()
