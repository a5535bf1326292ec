import pytest

from graphpass.patterns import compile_pattern
from graphpass.errors import PatternError


@pytest.mark.parametrize(
    "pattern,name,hit",
    [
        ("layers.0-31", "layers.0", True),
        ("layers.0-31", "layers.31", True),
        ("layers.0-31", "layers.32", False),
        ("layers.0-31", "layers.3.mlp", False),
        ("model.layers.2-3.mlp", "model.layers.3.mlp", True),
        ("lm_head", "lm_head", True),
        ("lm_head", "lm_headX", False),
        ("layers.1", "layersX1", False),  # plain names match dots literally
        (r"layers\.\d+", "layers.12", True),
        ("layers.*", "layers.4", True),
        (".*self_attn", "model.layers.0.self_attn", True),
        (".*self_attn", "model.layers.0.self_attn.q_proj", False),
        ("(layers|blocks).1-2", "blocks.2", True),
    ],
)
def test_pattern_matching(pattern, name, hit):
    assert compile_pattern(pattern, "traps").matches(name) is hit


@pytest.mark.parametrize("bad", ["layers.9-1", "x.(", "", "a[", "?x"])
def test_bad_patterns(bad):
    with pytest.raises(PatternError):
        compile_pattern(bad, "traps")
