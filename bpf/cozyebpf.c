// SPDX-License-Identifier: GPL-2.0
/*
 * All programs in one compilation unit: the agent compiles this file once and loads the three
 * programs from it (each one alone is compiled by tests and tools as well).
 */
#include "ingress.c"
#include "ingress_tc.c"
#include "egress.c"
