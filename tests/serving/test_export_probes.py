"""The probes around a bounded export (`psclient._keras.bounded_export`): a ps that answers its first
probe with an error is left to the export's own calls, as in the probes while it runs.

Seen in a seeded chaos plan (docs/chaos.md, seed 442): a probe of a ps that answered failed with TF's
"Unable to find the relevant tensor remote_handle" (its operand's copy to the ps lost to a reconnect
of the cluster), and that error, raised before the export began, failed the `fit` whose
`ServingExport` made it. No cluster here: the probes are stand-ins; the threads and per-ps bounds
are the export's own.
"""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from psclient._coordinator.checkpoints.checkpoint_parts import PsTimeout  # noqa: E402
from psclient._core.errors import PSUnavailableError  # noqa: E402
from psclient._keras import bounded_export  # noqa: E402

STALE = ("Unable to find the relevant tensor remote_handle: Op ID: 47848, Output num: 0. One possible cause "
         "is that the tensor was accessed after deallocation in a distributed worker setup.")


def test_a_first_probe_answered_with_an_error_does_not_fail_the_export(monkeypatch):
    calls = []

    def probe_of(ps):
        def probe():
            calls.append(ps)
            if ps == 1 and calls.count(1) == 1:  # its first probe only
                raise tf.errors.InvalidArgumentError(None, None, STALE)
        return probe

    monkeypatch.setattr(bounded_export, "_probe_of", probe_of)
    written = bounded_export.export_bounded(lambda publication: publication.may_publish() and "version 7",
                                            num_ps=2, hang_timeout=30.0, describe_ps=str)
    assert written == "version 7"
    assert calls.count(1) >= 1 and calls.count(0) >= 1


def test_a_first_probe_that_does_not_answer_still_gives_the_export_up_naming_the_ps(monkeypatch):
    import threading

    answer = threading.Event()

    def probe_of(ps):
        def probe():
            if ps == 1:
                answer.wait(30)  # hung: answers only once the test ends
        return probe

    monkeypatch.setattr(bounded_export, "_probe_of", probe_of)
    written = []
    try:
        with pytest.raises(PSUnavailableError, match="ps:1 .* did not answer within hang_timeout=0.5 s") as raised:
            bounded_export.export_bounded(lambda publication: written.append(1), num_ps=2,
                                          hang_timeout=0.5, describe_ps=lambda ps: f"host-{ps}")
        assert isinstance(raised.value.__cause__, PsTimeout)
        assert not written  # nothing was written
    finally:
        answer.set()
