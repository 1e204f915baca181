"""The bench's variants of the product's programs (bench/variant.py, bench/bpf/variants/): the
product's source with only the varied function replaced, in its place; bpf/ has no switch for
them. (The bench compiles and runs them: `python -m bench --only progrun,datapath`.)"""

from __future__ import annotations

import re

import pytest

from bench.variant import VARIANTS, splice
from cozyebpf.datapath.loader import bpf_dir, flatten

#: variant -> (the product source it varies, the functions it replaces)
EXPECTED = {
    "egress_nocheck.c": ("egress.c", ["cz_src_unsure"]),
    "egress_fib_always.c": ("egress.c", ["spoof_unsure"]),
    "pod_fib_uncached.c": ("pod.c", ["cz_fib4_cached"]),
}


def definition(text: str, name: str) -> str:
    """The one definition of `name` in `text` (signature to closing brace)."""
    found = list(re.finditer(rf"^static __always_inline [^;{{}}()]*?\b{name}\(", text, re.M))
    assert len(found) == 1, f"{name} defined {len(found)} times"
    start = found[0].start()
    end = text.index("\n}\n", start) + 2
    return text[start:end]


def test_every_variant_is_listed() -> None:
    assert sorted(p.name for p in VARIANTS.glob("*.c")) == sorted(EXPECTED)


@pytest.mark.parametrize("variant", EXPECTED)
def test_a_variant_is_the_product_with_one_function_replaced(variant: str) -> None:
    source, replaced = EXPECTED[variant]
    product = flatten(bpf_dir() / source)
    ours = flatten(VARIANTS / variant)  # its comment, the product, its own functions
    i = ours.index(product)
    prefix, suffix = ours[:i], ours[i + len(product) :]
    expected = product
    for name in replaced:
        mine = definition(suffix, name)
        assert mine != definition(product, name)
        expected = expected.replace(definition(product, name), mine)
        suffix = suffix.replace(mine, "")
    assert splice(ours, variant) == prefix + expected + suffix


def test_a_variant_that_replaces_nothing_is_an_error() -> None:
    text = flatten(bpf_dir() / "egress.c")
    with pytest.raises(ValueError, match="defines no function of the product again"):
        splice(text, "plain.c")
