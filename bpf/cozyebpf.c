// SPDX-License-Identifier: GPL-2.0
/*
 * All programs in one compilation unit: the agent compiles this file once and loads the programs
 * of every hook from it -- XDP ingress, tc ingress, the uplinks' egress, the pod-facing hook (each
 * entry file alone is compiled by tests and tools as well).
 */
#include "ingress.c"
#include "ingress_tc.c"
#include "egress.c"
#include "pod.c"
