"""`hung_ps_of`: which ps a failed call gave up on because it did not answer (pure, no TensorFlow).

The recovery skips that ps when it checks, after a failed step, whether a ps restarted behind
the coordinator's back: a hung ps would not answer the check either.
"""

from psclient._core.errors import PsTimeout, hung_ps_of


def test_hung_ps_of_names_the_ps_a_call_gave_up_on_through_the_causes():
    timeout = PsTimeout("no answer within 3 s (the ps may hang)")
    timeout._psclient_ps = 2
    try:
        try:
            raise timeout
        except PsTimeout as error:
            raise OSError("ps:2 could not take its snapshot of a checkpoint") from error
    except OSError as wrapped:
        assert hung_ps_of(wrapped) == 2
    failed = RuntimeError("invalid device")  # a ps that answered with an error did not hang
    failed._psclient_ps = 1
    assert hung_ps_of(failed) is None and hung_ps_of(None) is None
