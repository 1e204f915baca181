// The real-node lab's backend (cozylab/realnode/): one static binary, the standard library only,
// built by scripts/build-node.sh into an image of its own (no image registry is reachable here).
module cozyebpf.lab/images/echo

go 1.24.0
