"""graphpass.torch_compat: the one place differences between torch releases are answered."""
from __future__ import annotations

import torch

from graphpass.torch_compat import TORCH_RELEASE, source_name, torch_release_tuple


def test_source_name_of_a_real_dynamo_source():
    from torch._dynamo.source import AttrSource, LocalSource

    assert source_name(LocalSource("x")) == "L['x']"
    assert source_name(AttrSource(LocalSource("self"), "w")) == "L['self'].w"


def test_source_name_takes_the_method_of_torch_2_9_and_the_property_of_later_releases():
    class Method:  # torch 2.9
        def name(self):
            return "L['a']"

    class Property:  # torch 2.10 and later
        @property
        def name(self):
            return "L['b']"

    assert source_name(Method()) == "L['a']"
    assert source_name(Property()) == "L['b']"


def test_torch_release_tuple():
    assert torch_release_tuple("2.9.0+cu128") == (2, 9)
    assert torch_release_tuple("2.15.0") == (2, 15)
    assert TORCH_RELEASE == torch_release_tuple(torch.__version__) and TORCH_RELEASE >= (2, 9)
