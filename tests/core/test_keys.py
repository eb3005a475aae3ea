"""handle_key: the collision-free id -> file/MLflow key mapping (storage/keys.py)."""

import itertools
import re

import pytest

from hookline.storage import HookTypeError, HooklineError, handle_key
from hookline.storage.keys import MAX_KEY_LEN

MLFLOW_KEY = re.compile(r"^[/\w.\- :]*$")


@pytest.mark.parametrize(
    "handle_id, key",
    [
        ("outputs[blocks.0.mlp]", "outputs/blocks.0.mlp"),
        ("grads[encoder.layers.11]", "grads/encoder.layers.11"),
        ("my-hook[]", "my-2dhook/-e"),
        ("plain", "plain"),
        ("a/b", "a-2fb"),
        ("x[.]", "x/-d."),
        ("x[..]", "x/-d.."),
        ("ü[m]", "-c3-bc/m"),
    ],
)
def test_known_keys(handle_id, key):
    assert handle_key(handle_id) == key


def test_keys_are_injective_and_mlflow_safe():
    parts = ["", "a", "a-2d", "-", "a-b", "a[b]", "[", "]", ".", "..", "a/b", "a b", "x" * 200, "x" * 201, "é", "<f at 0x1>"]
    ids = set()
    for fn, mod in itertools.product(parts, repeat=2):
        ids.add(f"{fn}[{mod}]")
        ids.add(fn + mod)
    keys = {}
    for i in ids:
        k = handle_key(i)
        assert MLFLOW_KEY.match(k), (i, k)
        assert len(k) <= MAX_KEY_LEN
        assert "//" not in k and not k.startswith("/") and not k.endswith("/")
        for comp in k.split("/"):
            assert comp not in ("", ".", ".."), (i, k)
        assert keys.setdefault(k, i) == i, f"collision: {i!r} and {keys[k]!r} -> {k!r}"


def test_long_ids_are_hashed_and_distinct():
    a, b = "h[" + "m" * 300 + "1]", "h[" + "m" * 300 + "2]"
    ka, kb = handle_key(a), handle_key(b)
    assert ka != kb and len(ka) <= MAX_KEY_LEN and "-h" in ka


def test_non_str_id_is_a_clear_type_error():
    with pytest.raises(HookTypeError, match=r"42") as e:
        handle_key(42)
    assert isinstance(e.value, TypeError) and isinstance(e.value, HooklineError)
