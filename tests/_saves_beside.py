"""Checkpoints taken while `model.fit` trains in another thread, until a cut read rows again."""

import threading


#: `checkpoints_to_keep` for a strategy whose saves are all read back: more than a test's own saves and
#: `saves_beside_fit`'s tries (with the default of 3, a loaded machine's 5th try pruned the 2nd save).
KEEP_EVERY_SAVE = 16


def saves_beside_fit(strategy, model, data, tries: int = 8) -> list:
    """[(path, rows the cut read again)] of up to `tries` saves, each while `fit` trains `data` in a
    thread of its own, the last one a cut that read rows again (asserted: a step wrote during its
    copy). The training is stopped and joined, its errors raised as an assertion."""
    stop, errors, seen = threading.Event(), [], []

    def train():
        try:
            for _ in range(200):  # bounded: stopped long before
                if stop.is_set():
                    return
                model.fit(data, epochs=1, steps_per_epoch=8, verbose=0)
        except Exception as error:  # noqa: BLE001 - asserted below
            errors.append(error)

    thread = threading.Thread(target=train, name="test-fit")
    thread.start()
    try:
        for _ in range(tries):
            seen.append((strategy.save_checkpoint(), strategy.stats()["checkpoints"]["last_rows_read_again"]))
            if seen[-1][1]:
                break
    finally:
        stop.set()
        thread.join(300)
    assert not thread.is_alive() and not errors, errors
    assert seen[-1][1] > 0, f"no step wrote during a copy: {seen}"
    return seen
