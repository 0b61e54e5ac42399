"""No new module-level mutable state in psclient (issue 38: state is passed explicitly).

A module-level dict, list, set or weak container is state every strategy in the
process shares. Each one left is listed below with why it is module-level; a
new one fails here until it is passed explicitly or listed with its reason.
Thread-locals are allowed (a tracing context of the calling thread), and so are
read-only tables (`types.MappingProxyType`, tuples, frozensets).
"""

from __future__ import annotations

import ast
import sys

from _paths import ROOT

PACKAGE = ROOT / "psclient"

_MUTABLE_CALLS = frozenset({"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter",
                            "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"})
_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)

PROCESS = "process-wide: "
WEAK = "weakly keyed by an object psclient does not own (a TF graph or trace, a Keras model): dies with it"

#: "module.name" -> why it is module-level.
ALLOWED = {
    "psclient._cluster.task_process._LIVE_TASKS": PROCESS + "the task processes this process owns (closed in a fork)",
    "psclient._cluster.forkserver._servers": PROCESS + "the fork servers this process owns, one per task environment, "
    "shared by its LocalClusters (forgotten in a fork)",
    "psclient._cluster.closing._BEFORE_CLOSE": PROCESS + "what a LocalCluster's close runs before its tasks end "
    "(the registry's shutdown of the strategy connected to them: TF's connection is the process's)",
    "psclient._cluster.throttle._LIVE": PROCESS + "the throttle helpers this process owns (closed in a fork)",
    "psclient._coordinator.connection._coordinator_peers": PROCESS + "the hosts allowed to reach this process's port",
    "psclient._engine.registry._scope_hooks": PROCESS + "what entering any strategy's scope installs (Keras support)",
    "psclient._tf.renewed_captures._dead": PROCESS + "the handles ps recoveries renewed, held weakly (each while "
    "a trace still holds it): TF's function class, whose calls look them up, is the process's",
    "psclient._keras.outside_state._warned": WEAK,
    "psclient._keras.trainer._warned_local": WEAK,
    "psclient._keras.eval._functions": WEAK,
    "psclient._coordinator.tables.dense_shard._last_section": WEAK,
    "psclient._coordinator.training.sync._applied_untracked": WEAK,
    "psclient._coordinator.training.sync._applies": WEAK,
    "psclient._coordinator.tables.shard_restore._traced": PROCESS + "each restore section's concrete function, one "
                                                         "per form of shard (as the tf.function's own traces)",
    "psclient._coordinator.tables.dynamic_tables._local_locks": PROCESS + "the lock of tables made without any "
                                                                "strategy, one per local device name",
    "psclient._tf.executors._read_kinds": PROCESS + "the kinds of local read op this process registered on the "
                                          "tasks (TF's function library is the process's too)",
}


def _module_state() -> dict[str, int]:
    """"module.name" -> line, for every module-level name bound to a mutable container."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            mutable = isinstance(value, _LITERALS)
            if isinstance(value, ast.Call):
                func = value.func
                mutable = (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) in _MUTABLE_CALLS
            for target in targets:
                if mutable and isinstance(target, ast.Name) and target.id != "__all__":
                    found[f"{module}.{target.id}"] = node.lineno
    return found


def test_no_new_module_level_mutable_state():
    new = {name: line for name, line in _module_state().items() if name not in ALLOWED}
    assert not new, (
        "module-level mutable state (shared by every strategy in the process): pass it explicitly, or add "
        f"it to ALLOWED with why it must be module-level: {new}")


def test_every_allowed_entry_still_exists():
    # A removed one leaves the list, so the list stays the true count of what is left.
    gone = sorted(set(ALLOWED) - set(_module_state()))
    assert not gone, f"no longer module-level state, remove from ALLOWED: {gone}"


def test_the_check_finds_each_kind_of_container(tmp_path, monkeypatch):
    # The scanner itself: each form it must catch, and the read-only forms it must not.
    package = tmp_path / "psclient"
    package.mkdir()
    (package / "m.py").write_text(
        "import threading, types, weakref, collections\n"
        "a = {}\nb: list = []\nc = set()\nd = weakref.WeakSet()\ne = collections.deque()\n"
        "f = {k: 1 for k in 'x'}\n"
        "ok1 = types.MappingProxyType({})\nok2 = (1, 2)\nok3 = frozenset()\nok4 = threading.local()\n"
        "__all__ = ['a']\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert sorted(_module_state()) == [f"psclient.m.{n}" for n in "abcdef"]
