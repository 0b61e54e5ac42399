"""The engine's protocols (`psclient._engine.edge`) are the contract its parts are held to.

Two checks, no cluster:
- every name the engine's modules call on the edge, the variable store, the
  per-worker values and the checkpoints is a member of that protocol (the
  protocol says what the engine uses, nothing it does not say);
- the real implementations (TensorFlow's) and the fakes the tests and the
  simulator run the engine on have every member, with parameters that accept
  every call the protocol allows.
"""

from __future__ import annotations

import ast
import inspect
import sys
import typing

import pytest

from psclient._engine import edge as edge_module

from _paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

# How each protocol's object is named inside psclient/_engine (attribute or parameter names).
NAMES = {
    edge_module.Edge: {"_edge", "edge"},
    edge_module.VariableStore: {"_store", "store"},
    edge_module.PerWorkerValues: {"_per_worker", "_iterators", "per_worker"},
    edge_module.CheckpointStore: {"checkpoints", "_checkpoints"},
}


def _members(protocol) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(value) for name, value in vars(protocol).items()
        if callable(value) and not name.startswith("_")
    }


def _engine_calls() -> dict[str, set[str]]:
    """Names of object -> attributes called on it, across psclient/_engine/*.py."""
    calls: dict[str, set[str]] = {}
    for path in sorted((ROOT / "psclient" / "_engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self":
                name = owner.attr
            elif isinstance(owner, ast.Name):
                name = owner.id
            else:
                continue
            calls.setdefault(name, set()).add(node.func.attr)
    return calls


@pytest.mark.parametrize("protocol", list(NAMES), ids=lambda p: p.__name__)
def test_every_call_the_engine_makes_is_in_the_protocol(protocol):
    members = set(_members(protocol))
    calls = _engine_calls()
    used = set().union(*(calls.get(name, set()) for name in NAMES[protocol]))
    assert used, f"the engine calls nothing on {protocol.__name__}: the names in NAMES are stale"
    assert used <= members, (f"the engine calls {sorted(used - members)} on a {protocol.__name__}, "
                             f"which the protocol does not name")


def _accepts(implementation: inspect.Signature, protocol: inspect.Signature) -> list[str]:
    """What in `protocol`'s parameters `implementation` does not accept (empty: compatible)."""
    problems = []
    have = dict(implementation.parameters)
    have.pop("self", None)
    want = [p for p in protocol.parameters.values() if p.name != "self"]
    takes_var_kw = any(p.kind is p.VAR_KEYWORD for p in have.values())
    positional = [p for p in have.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for index, parameter in enumerate(want):
        other = have.get(parameter.name)
        if parameter.kind is parameter.KEYWORD_ONLY:
            if other is None and not takes_var_kw:
                problems.append(f"no keyword {parameter.name!r}")
            elif other is not None and other.kind is other.POSITIONAL_ONLY:
                problems.append(f"{parameter.name!r} is positional only")
        elif index >= len(positional) or positional[index].name != parameter.name:
            problems.append(f"positional parameter {index} is not {parameter.name!r}")
    named = {p.name for p in want}
    for extra in have.values():
        if extra.name not in named and extra.default is extra.empty and \
                extra.kind not in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD):
            problems.append(f"{extra.name!r} has no default (the protocol never passes it)")
    return problems


def _implementations():
    from _fake_edge import EmptyStore, FakeEdge, NoPerWorker
    from _sim import SimCluster

    from psclient._coordinator.checkpoints.checkpoint import Checkpoints
    from psclient._coordinator.engine_edge import TFEdge
    from psclient._coordinator.stores import PerWorkerRegistry, VariableStore

    return [
        (edge_module.Edge, TFEdge), (edge_module.Edge, FakeEdge), (edge_module.Edge, SimCluster),
        (edge_module.VariableStore, VariableStore), (edge_module.VariableStore, EmptyStore),
        (edge_module.PerWorkerValues, PerWorkerRegistry), (edge_module.PerWorkerValues, NoPerWorker),
        (edge_module.CheckpointStore, Checkpoints),
    ]


def test_the_real_parts_and_the_fakes_meet_the_protocols():
    problems = []
    for protocol, implementation in _implementations():
        for name, signature in _members(protocol).items():
            member = getattr(implementation, name, None)
            if member is None:
                problems.append(f"{implementation.__name__} has no {name}")
                continue
            for problem in _accepts(inspect.signature(member), signature):
                problems.append(f"{implementation.__name__}.{name}: {problem}")
    assert not problems, "\n".join(problems)


def test_the_checker_finds_a_missing_keyword_and_an_extra_required_parameter():
    # The check above must be able to fail.
    class Protocol(typing.Protocol):
        def save(self, variables, *, meta=None): ...

    def lacks_meta(self, variables): ...

    def needs_more(self, variables, completed, *, meta=None): ...

    want = inspect.signature(Protocol.save)
    assert _accepts(inspect.signature(lacks_meta), want) == ["no keyword 'meta'"]
    assert _accepts(inspect.signature(needs_more), want) == ["'completed' has no default (the protocol never passes it)"]
