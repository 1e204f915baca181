/* SPDX-License-Identifier: GPL-2.0 */
/*
 * A node of a cluster whose pods reach the node through pod-facing devices (Kube-OVN's ovn0;
 * per-pod veths), beyond what the uplinks' programs do (docs/design.md, "On a Cozystack
 * cluster", draws every path):
 *
 * - pod_side4() (the pod-facing hook, tcx ingress on --pod-devices, before netfilter): a managed
 *   pod's packet that leaves the node by an uplink is translated there, as egress does, so the
 *   node's masquerade (Kube-OVN's natOutgoing) never sees the pod IP; and the answer of a
 *   managed pod to a connection that this node opened to its LB IP, which the overlay brings
 *   back to this node with the pod IP as source (cozy-proxy PR #18), gets its LB IP back before
 *   conntrack looks at it. Everything else -- pod to pod, a pod's own connection to a node --
 *   is left as the CNI has it.
 * - to_lb4() (uplink egress): a packet from this node's own address to a managed LB IP whose pod
 *   sits behind a pod-facing device is decided as ingress decides it, translated and handed to
 *   that device at once (through the ToR it would come back with a local source, a martian); its
 *   connection is remembered as a flow of the pod, which is what pod_side4 finds.
 *
 * Both are IPv4 (Kube-OVN as Cozystack runs it has no IPv6) and TCP/UDP for what needs ports;
 * the programs do nothing of this unless flowcfg says pod-facing hooks are attached.
 */
#ifndef COZYEBPF_CLUSTER_H
#define COZYEBPF_CLUSTER_H

/*
 * The rooms, each named after what it does: the FIB's lookups, its cached answers and the node's
 * part of flowcfg (fib.h); the source check, a pod speaks only for itself (source.h); host
 * routing, bpf_redirect_neigh past the stack and the XDP mark (route.h); the pod-facing hook's
 * IPv4 decision and verdict (pod.h); ICMP fragmentation-needed for the node's own too-big
 * packets (frag_needed.h); the node's own packets to an LB IP behind a pod-facing device
 * (to_lb.h).
 */
#include "fib.h"
#include "source.h"
#include "route.h"
#include "pod.h"
#include "frag_needed.h"
#include "to_lb.h"

#endif
