"""psclient._core.ps_access: a coordinator's read of ps variables through a ps loss (pure, fakes)."""

import pytest

from psclient._core import ps_access
from psclient._core.errors import PSUnavailableError


class OpError(Exception):
    """Stands for TF's op errors."""


class UnavailableError(OpError):
    pass


class InvalidArgumentError(OpError):
    pass


class FakeEdge:
    """A recovery that restores a lost ps (or gives up) when waited on."""

    settle_timeout = 30.0

    def __init__(self, lost=(0,), outcome="restored"):
        self.lost = tuple(lost)
        self.outcome = outcome
        self.epoch = 0
        self.reports = []
        self.waits = []
        self.broken = None

    def is_op_error(self, error):
        return isinstance(error, OpError)

    def lost_ps(self):
        return self.lost

    def ps_epoch(self):
        return self.epoch

    changes = 0  # changes of TF's view of the cluster so far (connection_changes)

    def connection_changes(self):
        return self.changes

    def report_lost(self, lost, epoch):
        self.reports.append((lost, epoch))

    def wait_settled(self, epoch, timeout):
        self.waits.append((epoch, timeout))
        if self.outcome == "timeout":
            return False
        self.epoch += 1
        if self.outcome == "gave up":
            self.broken = PSUnavailableError("no checkpoint_dir to restore from")
        else:
            self.lost = ()
        return True

    def given_up(self):
        return self.broken

    def describe(self, lost):
        return f"ps:{lost[0] if lost else 0}", "127.0.0.1:1"


def failing(*errors, value="read"):
    errors = list(errors)

    def access():
        if errors:
            raise errors.pop(0)
        return value

    return access


def no_sleep(seconds):
    no_sleep.slept.append(seconds)


no_sleep.slept = []


def test_a_lost_ps_is_reported_waited_for_and_the_access_runs_again():
    edge = FakeEdge()
    assert ps_access.through_ps_loss(failing(UnavailableError("refused")), edge, "reading", no_sleep) == "read"
    assert edge.reports == [((0,), 0)]
    assert edge.waits == [(0, 30.0)]


def test_without_waiting_a_lost_ps_is_reported_and_unavailable_at_once():
    edge = FakeEdge()
    error = UnavailableError("refused")
    with pytest.raises(PSUnavailableError, match="reading the stats on the coordinator.*being recovered") as info:
        ps_access.through_ps_loss(failing(error), edge, "reading the stats", no_sleep, wait=False)
    assert info.value.__cause__ is error
    assert edge.reports == [((0,), 0)]  # the recovery is told, as a waiting access tells it
    assert edge.waits == []


def test_without_waiting_other_errors_are_handled_as_with_waiting():
    edge = FakeEdge(lost=())  # every ps answers: a connection error is retried, not a loss
    assert ps_access.through_ps_loss(failing(UnavailableError("refused")), edge, "x", no_sleep, wait=False) == "read"
    assert edge.reports == [] and edge.waits == []


def test_a_restarted_ps_invalid_handle_counts_as_lost_too():
    edge = FakeEdge(lost=(1,))
    assert ps_access.through_ps_loss(failing(InvalidArgumentError("invalid device")), edge, "x", no_sleep) == "read"
    assert edge.reports == [((1,), 0)]


def test_recovery_given_up_raises_ps_unavailable_chained_to_tfs_error():
    edge = FakeEdge(outcome="gave up")
    error = UnavailableError("refused")
    with pytest.raises(PSUnavailableError, match="reading the metrics on the coordinator.*no checkpoint_dir") as info:
        ps_access.through_ps_loss(failing(error), edge, "reading the metrics", no_sleep)
    assert info.value.__cause__ is error
    assert info.value.task == "ps:0"


def test_already_given_up_raises_without_reporting_again():
    edge = FakeEdge()
    edge.broken = PSUnavailableError("given up earlier")
    with pytest.raises(PSUnavailableError, match="given up earlier"):
        ps_access.through_ps_loss(failing(UnavailableError("refused")), edge, "x", no_sleep)
    assert edge.reports == []


def test_a_recovery_that_does_not_settle_in_time_gives_up():
    edge = FakeEdge(outcome="timeout")
    with pytest.raises(PSUnavailableError, match="not recovered within 30 s"):
        ps_access.through_ps_loss(failing(UnavailableError("refused")), edge, "x", no_sleep)


def test_a_ps_lost_again_and_again_ends_in_an_error():
    edge = FakeEdge()
    edge.wait_settled = lambda epoch, timeout: True  # "restored", yet the ps is lost each time
    errors = [UnavailableError("refused")] * (ps_access.MAX_PS_RECOVERIES + 1)
    with pytest.raises(PSUnavailableError, match="lost again"):
        ps_access.through_ps_loss(failing(*errors), edge, "x", no_sleep)
    assert len(edge.reports) == ps_access.MAX_PS_RECOVERIES


def test_a_connection_error_while_every_ps_answers_is_retried_a_few_times_then_raised():
    edge = FakeEdge(lost=())
    no_sleep.slept.clear()
    assert ps_access.through_ps_loss(failing(UnavailableError("blip")), edge, "x", no_sleep) == "read"
    assert no_sleep.slept == [0.5] and edge.reports == []
    errors = [UnavailableError(f"blip {i}") for i in range(10)]
    with pytest.raises(UnavailableError, match="blip 3"):
        ps_access.through_ps_loss(failing(*errors), edge, "x", no_sleep)


def test_the_accesss_own_errors_pass_unchanged():
    edge = FakeEdge()
    with pytest.raises(ValueError, match="bug"):
        ps_access.through_ps_loss(failing(ValueError("bug")), edge, "x", no_sleep)
    edge.lost = ()
    with pytest.raises(InvalidArgumentError, match="shape"):
        ps_access.through_ps_loss(failing(InvalidArgumentError("shape")), edge, "x", no_sleep)
    assert edge.reports == []


def test_an_access_nested_in_another_runs_plainly_and_the_outer_one_waits_and_runs_it_all_again():
    # A read at trace time inside schedule()'s guarded trace: the outer access waits (holding no
    # lock of psclient's), the inner one only raises.
    edge = FakeEdge()
    inner_error = [UnavailableError("refused")]
    runs = []

    def inner():
        runs.append(("inner", ps_access.guarding()))
        if inner_error:
            raise inner_error.pop()
        return "row count"

    def outer():
        runs.append(("outer", ps_access.guarding()))
        return ps_access.through_ps_loss(inner, edge, "inner", no_sleep)

    assert not ps_access.guarding()
    assert ps_access.through_ps_loss(outer, edge, "outer", no_sleep) == "row count"
    assert runs == [("outer", True), ("inner", True)] * 2  # made again whole, once
    assert edge.reports == [((0,), 0)] and len(edge.waits) == 1  # one report, one wait: the outer one's
    assert not ps_access.guarding()


def test_a_thread_whose_ps_losses_are_handled_elsewhere_never_waits():
    edge = FakeEdge()
    with ps_access.handled_elsewhere():
        with pytest.raises(UnavailableError):
            ps_access.through_ps_loss(failing(UnavailableError("refused")), edge, "x", no_sleep)
    assert edge.reports == [] and edge.waits == []
    assert ps_access.through_ps_loss(failing(UnavailableError("refused")), edge, "x", no_sleep) == "read"


STALE = "Unable to find the relevant tensor remote_handle: Op ID: 11156, Output num: 0."


def straddling(edge, errors, changes_per_run=2):
    """An access that fails with `errors` in turn, TF's view of the cluster changing during each failed run."""
    errors = list(errors)
    runs = []

    def access():
        runs.append(1)
        if errors:
            edge.changes += changes_per_run  # a reconnect began and ended while it ran
            raise errors.pop(0)
        return "read"

    return access, runs


def test_a_tensor_lost_to_a_reconnect_during_the_access_runs_it_again():
    """Seed 450 of the chaos plans: a Keras metric's read on the coordinator failed with TF's "Unable to
    find the relevant tensor remote_handle" from a ps that answered, the cluster reconnected meanwhile."""
    edge = FakeEdge(lost=())
    access, runs = straddling(edge, [InvalidArgumentError(STALE)])
    no_sleep.slept.clear()
    assert ps_access.through_ps_loss(access, edge, "reading the metrics", no_sleep) == "read"
    assert len(runs) == 2 and edge.reports == []  # run again, no ps reported lost
    assert no_sleep.slept == [0.5]  # after a pause: a change still under way ends first


def test_a_lost_tensor_without_a_reconnect_is_the_accesses_own_error():
    edge = FakeEdge(lost=())
    error = InvalidArgumentError(STALE)
    access, runs = straddling(edge, [error], changes_per_run=0)
    with pytest.raises(InvalidArgumentError) as raised:
        ps_access.through_ps_loss(access, edge, "x", no_sleep)
    assert raised.value is error and len(runs) == 1


def test_tensors_lost_to_reconnect_after_reconnect_end_in_the_error():
    edge = FakeEdge(lost=())
    errors = [InvalidArgumentError(STALE) for _ in range(ps_access.MAX_STRADDLES + 1)]
    access, runs = straddling(edge, errors)
    with pytest.raises(InvalidArgumentError):
        ps_access.through_ps_loss(access, edge, "x", no_sleep)
    assert len(runs) == ps_access.MAX_STRADDLES + 1  # bounded


def test_another_invalid_argument_during_a_reconnect_is_not_run_again():
    edge = FakeEdge(lost=())
    access, runs = straddling(edge, [InvalidArgumentError("Incompatible shapes: [2] vs. [3]")])
    with pytest.raises(InvalidArgumentError, match="Incompatible shapes"):
        ps_access.through_ps_loss(access, edge, "x", no_sleep)
    assert len(runs) == 1
