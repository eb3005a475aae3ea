"""Flattening to tensor leaves: order, paths, skipped leaves, round trips."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections import OrderedDict, namedtuple

import torch

from hookline.tracker import Leaves
from hookline.tracker.hooks.pytree import flatten, flatten_call, unflatten, unflatten_call

t0, t1, t2, t3 = (torch.full((1,), float(i)) for i in range(4))
HC = namedtuple("HC", "h c")


@dataclasses.dataclass
class Output:
    last_hidden_state: torch.Tensor
    hidden_states: tuple | None = None
    loss: torch.Tensor | None = None


def test_paths_and_skipped():
    cases = [
        (t0, ("0",), ()),
        ((t0, t1), ("0", "1"), ()),
        ((t0, (t1, t2)), ("0", "1.0", "1.1"), ()),  # an LSTM's (out, (h, c))
        ([t0, None, 3], ("0",), ("1", "2")),
        ({"logits": t0, "past": [t1, t2], "loss": None}, ("logits", "past.0", "past.1"), ("loss",)),
        (HC(t0, t1), ("h", "c"), ()),
        (Output(t0, (t1, t2)), ("last_hidden_state", "hidden_states.0", "hidden_states.1"), ("loss",)),
        (None, (), ("0",)),
    ]
    for obj, paths, skipped in cases:
        leaves, _ = flatten(obj)
        assert isinstance(leaves, Leaves)
        assert leaves.paths == paths and leaves.skipped == skipped, obj
        assert len(leaves) == len(paths)


def test_round_trip_keeps_structure_and_non_tensor_leaves():
    objs = [t0, (t0, t1), (t0, (t1, t2)), [t0, None, "s"], OrderedDict(a=t0, b=(t1, 2)), HC(t0, [t1]),
            Output(t0, (t1,)), {"x": {"y": t0}}]
    for obj in objs:
        leaves, spec = flatten(obj)
        new = unflatten(spec, [t + 10 for t in leaves])
        assert type(new) is type(obj)
        new_leaves, _ = flatten(new)
        assert new_leaves.paths == leaves.paths
        assert all(torch.equal(a + 10, b) for a, b in zip(leaves, new_leaves))
        assert flatten(obj)[0][0].item() < 10  # original untouched


def test_call_flattening_positional_then_keywords_in_call_order():
    leaves, spec = flatten_call((t0, None, (t1,)), {"z": t2, "a": {"m": t3}, "flag": True})
    assert leaves.paths == ("0", "2.0", "z", "a.m") and leaves.skipped == ("1", "flag")
    args, kwargs = unflatten_call(spec, [t * 2 for t in leaves])
    assert args[1] is None and list(kwargs) == ["z", "a", "flag"] and kwargs["flag"] is True
    assert torch.equal(kwargs["a"]["m"], t3 * 2)


def test_fast_paths():
    leaves, spec = flatten_call((t0, t1), {})
    assert tuple(leaves) == (t0, t1) and unflatten_call(spec, [t2, t3]) == ((t2, t3), {})
    leaves, spec = flatten((t0, t1))
    assert unflatten(spec, (t2, t3)) == (t2, t3)
    leaves, spec = flatten(t0)
    assert unflatten(spec, (t1,)) is t1
    param = torch.nn.Parameter(torch.ones(1))
    assert flatten((param, t0))[0].paths == ("0", "1")


def test_leaves_copy_pickle_and_torch_save_round_trip(tmp_path):
    """Hook arguments a user keeps can be copied and saved (torch.load failed before)."""
    leaves = flatten_call((t0, None, (t1,)), {"z": t2})[0]
    for other in (copy.copy(leaves), copy.deepcopy(leaves), pickle.loads(pickle.dumps(leaves))):
        assert type(other) is Leaves and other.paths == leaves.paths and other.skipped == leaves.skipped
        assert all(torch.equal(a, b) for a, b in zip(other, leaves))
    torch.save({"outputs": leaves}, tmp_path / "hooked.pt")
    loaded = torch.load(tmp_path / "hooked.pt", weights_only=False)["outputs"]
    assert loaded.paths == ("0", "2.0", "z") and torch.equal(loaded[2], t2)
