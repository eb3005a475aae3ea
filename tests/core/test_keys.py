"""handle_key: the collision-free id -> file/MLflow key mapping; check_name: the rule for names (storage/keys.py)."""

import itertools
import re

import pytest

from hookline.storage import HookTypeError, HooklineError, InvalidArgumentError, handle_key
from hookline.storage.keys import MAX_KEY_LEN, MAX_NAME_LEN, check_name

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


@pytest.mark.parametrize("name", ["outputs[blocks.0]", "", "a b", "é層👍", "a\u202eb", "[bold]", "x" * MAX_NAME_LEN])
def test_check_name_accepts_printable_names(name):
    assert check_name(name, "module name") is name


@pytest.mark.parametrize("ch", ["\x00", "\x01", "\t", "\n", "\r", "\x1b", "\x1f", "\x7f", "\x80", "\x9b", "\x9f",
                                "\ud800", "\udfff"])
def test_check_name_refuses_control_characters_and_surrogates(ch):
    name = f"blocks.{ch}0"
    with pytest.raises(InvalidArgumentError) as e:
        check_name(name, "module name", fix="rename it")
    msg = str(e.value)
    assert msg.startswith(f"module name {name!r} contains") and f"U+{ord(ch):04X}) at position 7" in msg
    assert msg.endswith(": rename it")
    assert isinstance(e.value, ValueError) and isinstance(e.value, HooklineError)


def test_check_name_bounds_length_and_type():
    with pytest.raises(InvalidArgumentError, match=r"'x{60}'\.\.\. is 1001 characters long; at most 1000"):
        check_name("x" * (MAX_NAME_LEN + 1), "field name")
    with pytest.raises(HookTypeError, match=r"handle id must be a str, got bytes b'a'"):
        check_name(b"a", "handle id")
